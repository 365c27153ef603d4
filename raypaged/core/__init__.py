"""Pure-Python bookkeeping of PagedAttention's memory side: no torch, no ray."""
