"""The skinny GEMM over an FP8 (e4m3) weight: the weight-only product of a decode step's rows.

A decode step's linears are bound by reading their weights; an e4m3 weight halves those bytes.
The rows stay in the model's dtype: each [BLOCK_N, BLOCK_K] weight tile is widened in registers
(e4m3 is exact in bf16, fp16 and fp32) and multiplied as gemv_triton multiplies bf16 tiles, the
fp32 sums scaled by each output feature's scale (model/quantization's per-channel or per-tensor
scales). Quantizing the rows as well (W8A8) would cost a kernel launch per linear for nothing the
memory-bound product needs; the larger steps that are compute-bound take the W8A8 GEMM
(model/quantization/fp8.py, torch._scaled_mm).

`gemv_w8a16_rope` and `gemv_w8a16_silu_mul` are the same product with the decoder's next step in
the epilogue, as gemv_rope / gemv_silu_mul for bf16 weights (gemv_epilogues.py): the fp32 sums
are scaled per feature first, then rounded to the rows' dtype and rotated or activated, so each
equals gemv_w8a16 followed by the separate kernel.
"""

from __future__ import annotations

import torch
import triton

from .gemv import DEFAULT_ROWS, MAX_ROWS, _launch, default_config, epilogue_allowed, launch_rope, launch_silu_mul
from .triton_common import device_properties

FP8_WEIGHT = torch.float8_e4m3fn
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports_w8a16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M <= MAX_ROWS, K] in a float dtype and an e4m3 weight [N, K], both contiguous along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype in ROW_DTYPES and weight.dtype == FP8_WEIGHT)


def w8a16_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The launch config for up to DEFAULT_ROWS rows (the weight's one-byte tiles), else None."""
    if not supports_w8a16(x, weight) or x.shape[0] > DEFAULT_ROWS:
        return None
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    return default_config(weight.shape[0], weight.shape[1], 1, shared_memory, x.shape[0])


def w8a16_epilogue_config(x: torch.Tensor, weight: torch.Tensor, group: int, name: str) -> dict | None:
    """The config to run this weight-only product with the fused epilogue `name` ("rope":
    gemv_w8a16_rope, "silu": gemv_w8a16_silu_mul) whose pairs of output features lie `group`
    apart (head_dim / 2; the intermediate size), or None: then gemv_w8a16 (or the W8A8 GEMM) and
    the separate kernel.

    For every step the weight-only kernel takes (w8a16_config: up to DEFAULT_ROWS rows) where the
    epilogue is allowed (gemv.set_epilogues, RAYPAGED_GEMM_EPILOGUES). bf16's epilogues start at
    EPILOGUE_MIN_ROWS rows, where this kernel no longer runs; under 17 rows the bf16 step measured
    the same with or without them, and an FP8 weight's GEMM is shorter, so the launch and the
    round trip the epilogue saves weigh more. block_n narrows until its halves divide `group`
    (at least 16: tl.dot's minimum)."""
    if not epilogue_allowed(name):
        return None
    config = w8a16_config(x, weight)
    if config is None:
        return None
    block_n = config["block_n"]
    while block_n >= 16 and group % (block_n // 2):
        block_n //= 2
    return {**config, "block_n": block_n} if block_n >= 16 else None


def _checked(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The weight scales as the kernel reads them ([N] fp32, contiguous), after checking the
    operands."""
    if not supports_w8a16(x, weight):
        raise ValueError(f"gemv_w8a16 takes x [M <= {MAX_ROWS}, K] (bf16/fp16/fp32) and an e4m3 weight "
                         f"[N, K], contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if w_scale.numel() != weight.shape[0]:
        raise ValueError(f"{w_scale.numel()} weight scales for {weight.shape[0]} output features")
    return w_scale.float().contiguous().view(-1)


def gemv_w8a16(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """(x · weightᵀ) · w_scale (+ bias) -> [M, N] in x's dtype, fp32 sums; weight e4m3 [N, K],
    w_scale [N] fp32. `config` from `w8a16_config` (or default_config's fields)."""
    scale = _checked(x, weight, w_scale)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, triton.cdiv(weight.shape[0], config["block_n"]),
            weight_scale=scale)
    return out


def gemv_w8a16_rope(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotated_features: int,
                    config: dict) -> torch.Tensor:
    """gemv_w8a16's qkv product with its first `rotated_features` features (the q and k heads)
    rotated by rope, by the step's tables cos, sin [M, head_dim / 2] (fp32, contiguous).
    `config` from `w8a16_epilogue_config(x, weight, head_dim // 2, "rope")`."""
    scale = _checked(x, weight, w_scale)
    return launch_rope(x, weight, bias, cos, sin, head_dim, rotated_features, config, weight_scale=scale)


def gemv_w8a16_silu_mul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """silu(gate) * up of gemv_w8a16's product with a [gate | up] e4m3 weight [2I, K] -> [M, I].
    `config` from `w8a16_epilogue_config(x, weight, I, "silu")`."""
    return launch_silu_mul(x, weight, bias, config, weight_scale=_checked(x, weight, w_scale))
