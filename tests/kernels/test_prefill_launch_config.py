"""The CUDA prefill launch config fits an SM's shared memory for every head width served."""

import pytest
import torch

from raypaged.kernels.paged_prefill import VARIANTS, default_launch_config

HOPPER_SHARED_BYTES = 232448  # Triton's per-block limit on sm_90 (its OutOfResources message)


def shared_memory_bytes(config: dict, head_dim: int, element_bytes: int) -> int:
    """The Q tile, and one K and one V tile per stage (what Triton's pipeliner keeps in flight):
    within 1 KB of what Triton reported for the 128 x 128 x 3-stage tiles at head_dim 256."""
    dim_pad = 1 << (head_dim - 1).bit_length()
    q_tile = config["block_m"] * dim_pad * element_bytes
    return q_tile + 2 * config["block_n"] * dim_pad * element_bytes * config["num_stages"]


def test_the_estimate_flags_the_default_tiles_at_head_dim_256():
    assert shared_memory_bytes(VARIANTS["tma"], 256, 2) > HOPPER_SHARED_BYTES


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_bf16_config_fits_shared_memory(head_dim):
    config = default_launch_config(head_dim, torch.bfloat16, torch.device("cuda"))
    assert shared_memory_bytes(config, head_dim, 2) <= HOPPER_SHARED_BYTES
