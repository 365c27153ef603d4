"""Which launch config the skinny GEMM (gemv.py) runs a product with, or whether it runs it at all.

Which rows take the kernel is ops.linear's choice (`launch_config`): up to DEFAULT_ROWS everywhere,
up to MAX_ROWS where the device's tuned table (gemv_table.py, written by bench_gemv.py) found it
faster than cuBLAS for that weight's shape. The fused epilogues (rope, SwiGLU) are chosen by
`epilogue_config`, only for shapes the table measured and only from EPILOGUE_MIN_ROWS rows, among
those RAYPAGED_GEMM_EPILOGUES allows (`set_epilogues`). Pure host-side planning: no kernel here.
"""

from __future__ import annotations

import torch
import triton

from raypaged import envs

from . import gemv_table
from .triton_common import device_properties

# The most rows the kernel's tiles take (the rows' tile pads to 16, 32 or 64).
MAX_ROWS = 64
# Steps of up to this many rows take the kernel on any device with the default config: measured
# faster than cuBLAS from 1 to 16 rows on every 8B shape on the H200 (gemv_h200.json).
DEFAULT_ROWS = 16
# Steps of fewer rows run rope and SwiGLU as separate kernels (see epilogue_config).
EPILOGUE_MIN_ROWS = DEFAULT_ROWS + 1
EPILOGUES = ("rope", "silu")


def padded_rows(rows: int) -> int:
    """The row count the kernel's tiles take: tl.dot's minimum of 16, else the next power of 2."""
    return max(16, triton.next_power_of_2(rows))


def default_config(out_features: int, in_features: int, element_size: int = 2,
                   shared_memory: int = 227 * 1024, rows: int = 1) -> dict:
    """Launch config where the device has no tuned one, from the H200 sweeps at 1-16 rows
    (benchmarks/bench_gemv.py): 64 output features per program with 4
    warps were best on every 8B shape; 256-wide K tiles where there are few programs (out <= 4096:
    o, down), 128-wide otherwise; as many pipeline stages as shared memory holds, up to 5; no
    split-K."""
    block_n = 64
    # FP8 weights (one byte an element): 256-wide K tiles on every shape.
    block_k = 256 if out_features <= 4096 or element_size == 1 else 128
    m_pad = padded_rows(rows)
    budget = shared_memory - 8 * 1024
    while block_k > 32 and 2 * (block_n + m_pad) * block_k * element_size > budget:
        block_k //= 2  # fp32 on a card with less shared memory: two stages must fit
    stage_bytes = (block_n + m_pad) * block_k * element_size  # the weight tile and the rows' tile
    stages = max(2, min(5, budget // stage_bytes))
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages,
            "split_k": 1}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_triton takes this product: 2-D, at most MAX_ROWS rows, both contiguous
    along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)


def tuned_entry(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The device's tuned entry for this product's shape, dtype and padded row count, if any."""
    if not x.is_cuda:
        return None
    return gemv_table.lookup(device_properties(x.device).name, str(x.dtype).removeprefix("torch."),
                             weight.shape[0], weight.shape[1], padded_rows(x.shape[0]))


def default_for(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """default_config for this product on its device (its shared memory; the H200's off CUDA)."""
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    return default_config(weight.shape[0], weight.shape[1], x.element_size(), shared_memory, x.shape[0])


def launch_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The config ops.linear launches this product with, or None where cuBLAS should take it:
    what the device's tuned table measured for the shape, else the default up to DEFAULT_ROWS
    rows."""
    if not supports(x, weight):
        return None
    entry = tuned_entry(x, weight)
    if entry is not None:
        return entry["config"] if entry["backend"] == "triton" else None
    return default_for(x, weight) if x.shape[0] <= DEFAULT_ROWS else None


def allowed_epilogues(setting: str) -> frozenset[str]:
    """The epilogues a RAYPAGED_GEMM_EPILOGUES value allows ("rope,silu"; "0" or "": none)."""
    return frozenset(name.strip() for name in setting.split(",")) & frozenset(EPILOGUES)


# The epilogues epilogue_config may choose (set_epilogues; RAYPAGED_GEMM_EPILOGUES narrows them).
_epilogues = allowed_epilogues(envs.RAYPAGED_GEMM_EPILOGUES)


def set_epilogues(enabled: bool) -> None:
    """Allow the fused epilogues (those RAYPAGED_GEMM_EPILOGUES names) for the products planned
    from now on in this process, or none. The worker sets it before it builds the model."""
    global _epilogues
    _epilogues = allowed_epilogues(envs.RAYPAGED_GEMM_EPILOGUES) if enabled else frozenset()


def epilogue_allowed(name: str) -> bool:
    """Whether the fused epilogue `name` may be chosen now (set_epilogues, RAYPAGED_GEMM_EPILOGUES)."""
    return name in _epilogues


def epilogue_config(x: torch.Tensor, weight: torch.Tensor, group: int, name: str) -> dict | None:
    """The config to run this product with the fused epilogue `name` ("rope": gemv_rope, "silu":
    gemv_silu_mul) whose pairs of output features lie `group` features apart (head_dim / 2; the
    intermediate size), or None where it should run as the GEMM and a separate kernel.

    Only from EPILOGUE_MIN_ROWS rows, and only where the device's tuned table has the shape,
    with the best config the sweep found for the kernel, even where the table chose cuBLAS for
    the plain product: the separate kernel it saves costs more than the table's margin. Below
    that many rows the separate kernels cost no more than the epilogues (under PDL the step was
    no faster with them at 1 and 8 rows, faster at 64: benchmarks/README.md, history), hence the
    floor on rows. block_n narrows until its halves divide
    `group`; it must stay 16 or more (tl.dot's minimum)."""
    if (not supports(x, weight) or x.shape[0] < EPILOGUE_MIN_ROWS
            or name not in _epilogues):
        return None
    entry = tuned_entry(x, weight)
    if entry is None:
        return None
    block_n = entry["config"]["block_n"]
    while block_n >= 16 and group % (block_n // 2):
        block_n //= 2
    return {**entry["config"], "block_n": block_n} if block_n >= 16 else None
