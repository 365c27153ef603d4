"""Paged-attention kernels (Triton) and their torch references.

Callers use `raypaged.kernels.ops`: write_kv, paged_decode, paged_prefill, copy_blocks,
set_backend. `reference` holds the torch oracles; the Triton launchers live one per file.
"""
