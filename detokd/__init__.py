"""detokd: a detokenizer sidecar for LLM serving engines."""

__version__ = "0.1.0"
