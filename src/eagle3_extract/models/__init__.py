"""Model configs and the test models made without a network (tiny, SmolLM2)."""
