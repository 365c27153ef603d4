"""The model's kernels (Triton) and their torch references.

Callers use `raypaged.kernels.ops`: write_kv, paged_decode, paged_prefill, copy_blocks, linear
(and its GEMM epilogues), rms_norm, add_rms_norm, silu_and_mul, rope_tables, rope_in_place, and
set_backend, the one switch between the Triton kernels and the references. `reference` holds the
torch oracles; the Triton launchers live one concept per file.
"""
