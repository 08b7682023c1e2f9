"""The drafter from an extraction: speculators' layout, training, acceptance."""
