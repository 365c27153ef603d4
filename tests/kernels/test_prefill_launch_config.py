"""The CUDA prefill launch config fits an SM's shared memory for every head width served."""

import pytest
import torch

from raypaged.kernels.paged_prefill import VARIANTS, default_launch_config, shared_memory_bytes

HOPPER_SHARED_BYTES = 232448  # Triton's per-block limit on sm_90 (its OutOfResources message)


def test_the_estimate_flags_the_default_tiles_at_head_dim_256():
    assert shared_memory_bytes(VARIANTS["tma"], 256, 2) > HOPPER_SHARED_BYTES


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_bf16_config_fits_shared_memory(head_dim):
    config = default_launch_config(head_dim, torch.bfloat16, torch.device("cuda"))
    assert shared_memory_bytes(config, head_dim, 2) <= HOPPER_SHARED_BYTES
