"""eagle3-regenerate: the target's own answers to a dataset's prompts."""
