"""raypaged: LLM serving with PagedAttention on Ray."""

__version__ = "0.1.0"
