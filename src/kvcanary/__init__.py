"""kvcanary: make KV-cache corruption in LLM serving engines impossible to miss."""

__version__ = "0.1.0"
