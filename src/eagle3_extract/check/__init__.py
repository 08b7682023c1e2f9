"""Reading a finished run: the run directory, eagle3-validate, eagle3-verify, eagle3-status."""
