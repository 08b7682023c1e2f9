"""eagle3-extract: EAGLE-3 training data from vLLM 0.16 prefill."""

__version__ = "0.1.0"
