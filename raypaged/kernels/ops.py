"""The kernel-backed ops the model calls (attention, the linears of small decode steps, and the
decoder's elementwise steps: RMSNorm, SiLU·mul, rope): one signature, two backends, one switch.

"triton" runs the kernels in this package (on CUDA, or on CPU under TRITON_INTERPRET=1);
"torch" runs the references (the CPU serving path). Choice, first match wins:
  1. set_backend("torch" | "triton")   (set_backend("auto") clears it)
  2. env RAYPAGED_ATTENTION_BACKEND (read once, raypaged/envs.py)
  3. "triton" for CUDA tensors, "torch" otherwise
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raypaged import envs

from . import reference
from .activation import gelu_tanh_and_mul_triton, silu_and_mul_triton
from .norm import add_rms_norm_triton, rms_norm_triton
from .rope import rope_in_place_triton, rope_tables_triton
from .validation import output_for

BACKENDS = ("torch", "triton")
ENV_VAR = "RAYPAGED_ATTENTION_BACKEND"
_override: str | None = None


def set_backend(name: str) -> None:
    """Force a backend for every later call in this process; "auto" restores the default."""
    global _override
    if name == "auto":
        _override = None
        return
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS} or 'auto'")
    _override = name


def backend_for(tensor: torch.Tensor) -> str:
    """The backend a call on `tensor` would use now."""
    if _override is not None:
        return _override
    env = envs.RAYPAGED_ATTENTION_BACKEND
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={env!r}; expected one of {BACKENDS}")
        return env
    return "triton" if tensor.is_cuda else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ (+ b). A small decode batch on the Triton backend takes the skinny GEMM where it
    reads the weights closer to the bandwidth than cuBLAS (gemv_config.launch_config: up to 16
    rows, or up to 64 where the device's tuned table says so; benchmarks/bench_gemv.py); anything
    else is F.linear."""
    if _skinny_gemm_may_take(x):
        from .gemv import gemv_triton
        from .gemv_config import launch_config

        config = launch_config(x, weight)
        if config is not None:
            return gemv_triton(x, weight, bias, config=config)
    return F.linear(x, weight, bias)


def quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation rows x [M, K] -> (e4m3 [M, K], scales [M, 1] fp32): one scale per row from
    its amax, or `static_scale` (1 element) for every row (kernels/fp8_quant.py)."""
    from .fp8_quant import quantize_fp8_triton, quantize_rows_ref

    if backend_for(x) == "triton":
        return quantize_fp8_triton(x, static_scale)
    return quantize_rows_ref(x, static_scale)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor | None:
    """The weight-only product of rows x [T, K] and an e4m3 weight [N, K] (scales [N]) in x's
    dtype, (x · weightᵀ) · w_scale, through the skinny GEMM where it takes a step of this many
    rows (decode; it reads the weight at one byte an element, gemv_fp8.py), else None: then the
    caller's W8A8 GEMM (model/quantization/fp8.py) takes it."""
    if not _skinny_gemm_may_take(x):
        return None
    from .gemv_fp8 import gemv_w8a16, w8a16_config

    config = w8a16_config(x, weight)
    return None if config is None else gemv_w8a16(x, weight, w_scale, bias, config)


def linear_fp8_w8a8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """The W8A8 product of rows x [T, K] and an e4m3 weight [N, K] (scales [N]) in x's dtype,
    x quantized per (row, K group) inside the GEMM (kernels/gemm_w8a8.py), where the device's
    tuned table chose that kernel for this shape and row count (gemm_w8a8.w8a8_config), else
    None: then the caller's other paths (linear_fp8, the separate quantization and _scaled_mm)."""
    if backend_for(x) != "triton":
        return None
    from .gemm_w8a8 import gemm_w8a8, w8a8_config

    config = w8a8_config(x, weight)
    return None if config is None else gemm_w8a8(x, weight, w_scale, bias, config)


def fp8_w8a8_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_fp8_w8a8 would take this product."""
    if backend_for(x) != "triton":
        return False
    from .gemm_w8a8 import w8a8_config

    return w8a8_config(x, weight) is not None


def linear_fp8_rope(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    rotated_features: int) -> torch.Tensor | None:
    """linear_fp8's product with rope in the epilogue (as linear_rope), or None where the skinny
    GEMM does not take it (gemv_fp8.w8a16_epilogue_config)."""
    if not _skinny_gemm_may_take(x):
        return None
    from .gemv_fp8 import gemv_w8a16_rope, w8a16_epilogue_config

    config = w8a16_epilogue_config(x, weight, head_dim // 2, "rope")
    return None if config is None else gemv_w8a16_rope(x, weight, w_scale, bias, cos, sin, head_dim,
                                                       rotated_features, config)


def linear_fp8_silu_mul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of linear_fp8's product with a [gate | up] e4m3 weight, in the skinny
    GEMM's epilogue, or None where it does not take the product."""
    if not _skinny_gemm_may_take(x):
        return None
    from .gemv_fp8 import gemv_w8a16_silu_mul, w8a16_epilogue_config

    config = w8a16_epilogue_config(x, weight, weight.shape[0] // 2, "silu")
    return None if config is None else gemv_w8a16_silu_mul(x, weight, w_scale, bias, config)


def linear_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                rotated_features: int) -> torch.Tensor | None:
    """The qkv product with its first `rotated_features` features (q and k heads) rotated by
    rope (the step's cos/sin tables [T, head_dim / 2] fp32) in the skinny GEMM's epilogue
    (gemv_epilogues.py), or None where that kernel does not take the product: then the caller
    runs `linear` and its rope."""
    if not _skinny_gemm_may_take(x):
        return None
    from .gemv import gemv_rope
    from .gemv_config import epilogue_config

    config = epilogue_config(x, weight, head_dim // 2, "rope")
    return None if config is None else gemv_rope(x, weight, bias, cos, sin, head_dim,
                                                 rotated_features, config)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of the product with a [gate | up] weight, in the skinny GEMM's epilogue,
    or None where that kernel does not take the product (then: `linear` and the activation)."""
    if not _skinny_gemm_may_take(x):
        return None
    from .gemv import gemv_silu_mul
    from .gemv_config import epilogue_config

    config = epilogue_config(x, weight, weight.shape[0] // 2, "silu")
    return None if config is None else gemv_silu_mul(x, weight, bias, config)


def _skinny_gemm_may_take(x: torch.Tensor) -> bool:
    # fp32 on a GPU stays with cuBLAS: an 8B fp32 decode step through the kernel took 61 ms where
    # reading its 32 GB of weights takes ~8 (an IEEE fp32 tl.dot has no tensor-core path). The
    # interpreter takes fp32, so the CPU tests still run the kernel in the model.
    return backend_for(x) == "triton" and not (x.is_cuda and x.dtype == torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             unit_offset: bool = False) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; x [T, H]. unit_offset: Gemma's (1 + weight), in
    fp32, rounded once to x's dtype."""
    if backend_for(x) == "triton":
        return rms_norm_triton(x, weight, eps, unit_offset)
    if unit_offset:
        return reference.gemma_rms_norm_ref(x, weight, eps)
    return reference.rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [T, H]."""
    if backend_for(x) == "triton":
        return add_rms_norm_triton(x, residual, weight, eps, unit_offset)
    if unit_offset:
        return reference.add_gemma_rms_norm_ref(x, residual, weight, eps)
    return reference.add_rms_norm_ref(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if backend_for(gate_up) == "triton":
        return silu_and_mul_triton(gate_up)
    return reference.silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU)."""
    if backend_for(gate_up) == "triton":
        return gelu_tanh_and_mul_triton(gate_up)
    return reference.gelu_tanh_and_mul_ref(gate_up)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's rope tables: cos and sin of position · inv_freq, fp32 [T, D/2], read by every
    layer's `rope_in_place` (or the qkv GEMM's epilogue, `linear_rope`)."""
    if backend_for(positions) == "triton":
        return rope_tables_triton(positions, inv_freq)
    return reference.rope_tables_ref(positions, inv_freq)


def rope_in_place(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] (views, last dim contiguous) in place by the
    tables of `rope_tables`."""
    if backend_for(query) == "triton":
        rope_in_place_triton(query, key, cos, sin)
        return
    reference.rope_in_place_ref(query, key, cos, sin)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at slot_mapping [T] (block_id*B + offset; -1 = skip).
    An FP8 pool (kernels/kv_quant.py) needs its layer's k_scale / v_scale (one fp32 element
    each, on the device) and stores the values quantized with them; a float pool takes none."""
    if backend_for(key) == "torch":
        reference.write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from .write_kv import write_kv_triton

    write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    work: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over its paged context. q [S, Hq, D] -> [S, Hq, D]. The launches
    depend on shapes only (CUDA-graph capturable for any mix of lengths).

    work: the step's work list from `plan_decode` (None: planned in this call), planned with
    the same sliding_window: the window's keys (p - W, p] are all a query reads, the blocks
    before it are not touched. softcap: scores = softcap · tanh(scores / softcap).
    k_scale / v_scale: an FP8 pool's scales, as `write_kv`'s (its values are dequantized as
    they are read)."""
    if backend_for(q) == "torch":
        result = reference.paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                            sliding_window=sliding_window, softcap=softcap,
                                            k_scale=k_scale, v_scale=v_scale)
        return _into(out, result)
    from .paged_decode import paged_decode_triton

    return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
                               work=work, sliding_window=sliding_window, softcap=softcap,
                               k_scale=k_scale, v_scale=v_scale)


def plan_decode(seq_lens: torch.Tensor, num_kv_heads: int,
                out: torch.Tensor | None = None, *,
                sliding_window: int | None = None) -> torch.Tensor | None:
    """The decode work list of a step's seq_lens [S] for a pool of num_kv_heads: how the batch's
    KV is cut into equal items (kernels/decode_work.py). Computed once a step, read by every
    layer's `paged_decode`; into `out` (a CUDA graph's buffer, this call's earlier result) if
    given. With a sliding window the items cover only each sequence's last `sliding_window`
    keys (the layers of that window read this list). None on the torch backend, which needs none."""
    if backend_for(seq_lens) == "torch":
        return None
    from .paged_decode import plan_work

    return plan_work(seq_lens, num_kv_heads, out=out, sliding_window=sliding_window)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of new tokens q [T, Hq, D] over cached prefix + themselves.

    k_new / v_new [T, Hkv, D]: the step's keys/values just written for q's tokens, in q's
    dtype. Optional; the Triton kernel reads the new tokens from them instead of through the
    block table (quantized in the kernel as an FP8 pool holds them; the reference reads the
    cache either way). sliding_window, softcap, k_scale, v_scale: as `paged_decode`'s (the
    kernel skips every tile wholly before its queries' windows).
    """
    if backend_for(q) == "torch":
        result = reference.paged_prefill_ref(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )
        return _into(out, result)
    from .paged_prefill import paged_prefill_triton

    return paged_prefill_triton(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=out,
        k_new=k_new, v_new=v_new, sliding_window=sliding_window, softcap=softcap,
        k_scale=k_scale, v_scale=v_scale,
    )


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_copies: torch.Tensor
) -> None:
    """Copy-on-write of whole blocks, rows (src, dst) of block_copies [N, 2] int64, every layer.

    One gather + scatter per pool on either backend: it runs once per fork, not per token.
    """
    reference.copy_blocks_ref(k_caches, v_caches, block_copies)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    target = output_for(result, out)
    target.copy_(result)
    return target
