"""kvconform: conformance and regression checks for LLM-serving KV-cache stacks."""

__version__ = "0.1.0"
