"""What the skinny GEMM (gemv.py) does with a block of finished outputs: store it, or first apply
the elementwise step that follows that product in the decoder.

A decode step's rope and SwiGLU are each a kernel of a few microseconds between two weight-bound
GEMMs; done in the GEMM's epilogue they cost no launch and no round trip through memory. Both
pair output features: rope rotates feature i of a head with feature i + D/2, SwiGLU multiplies
gate feature i with up feature i. So with an epilogue a program's BLOCK_N outputs are not
consecutive: they are PAIRS = BLOCK_N / 2 first members of pairs followed by their PAIRS
partners (`output_columns`), which the epilogue splits apart. Each output feature is still the
same dot product over K, accumulated in the same order, so the result equals the GEMM followed
by the separate kernel bit for bit (the product is rounded to the output dtype before the
epilogue, as the separate kernel would read it).

  PLAIN     out[m, n] = x·w_n (+ b_n)
  ROPE      out = the qkv product with q and k heads rotated by their token's position
            (Hugging Face's "rotate half" layout; cos and sin from the step's tables, as the
            rope kernel in rope.py reads them)
  SILU_MUL  out[m, i] = silu(gate_i) · up_i over a [gate | up] weight, [M, N / 2]
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN = tl.constexpr(0)
ROPE = tl.constexpr(1)
SILU_MUL = tl.constexpr(2)


@triton.jit
def _rope_block(tile, HALF: tl.constexpr, PAIRS: tl.constexpr):
    """ROPE: the first feature of program `tile`'s head and the first of its PAIRS frequencies
    (a head's HALF pairs take HALF / PAIRS programs)."""
    return (tile // (HALF // PAIRS)) * (2 * HALF), (tile % (HALF // PAIRS)) * PAIRS


@triton.jit
def output_columns(tile, N, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr, HALF: tl.constexpr):
    """The BLOCK_N output features program `tile` computes. ROPE: HALF = head_dim / 2."""
    lane = tl.arange(0, BLOCK_N)
    if EPILOGUE == PLAIN:
        return tile * BLOCK_N + lane
    PAIRS: tl.constexpr = BLOCK_N // 2
    partner = lane // PAIRS  # 0: first members of the pairs, 1: their partners
    index = lane % PAIRS
    if EPILOGUE == ROPE:
        head_start, freq_start = _rope_block(tile, HALF, PAIRS)
        return head_start + partner * HALF + freq_start + index
    else:
        return partner * (N // 2) + tile * PAIRS + index


@triton.jit
def rotation(cos_ptr, sin_ptr, tile, rows, row_ok, EPILOGUE: tl.constexpr, HALF: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """ROPE: the cos and sin [PAIRS, M_PAD] of the block's pairs from the step's tables
    ([M, HALF] fp32, rope.rope_tables_triton); loaded before the K loop, so their latency hides
    behind it. Other epilogues: placeholders."""
    if EPILOGUE == ROPE:
        PAIRS: tl.constexpr = BLOCK_N // 2
        _, freq_start = _rope_block(tile, HALF, PAIRS)
        offsets = rows[None, :].to(tl.int64) * HALF + (freq_start + tl.arange(0, PAIRS))[:, None]
        return (tl.load(cos_ptr + offsets, mask=row_ok[None, :], other=1.0),
                tl.load(sin_ptr + offsets, mask=row_ok[None, :], other=0.0))
    else:
        return 1.0, 0.0


@triton.jit
def finish(acc, bias_ptr, out_ptr, cos, sin, tile, cols, rows, col_ok, row_ok,
           stride_om, rotated_features, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
           HALF: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr):
    """Store the fp32 block acc [BLOCK_N, M_PAD] of output features `cols` for `rows`; cos, sin
    from `rotation`."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == PLAIN:
        out_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
        tl.store(out_ptrs, acc.to(dtype), mask=col_ok[:, None] & row_ok[None, :])
    else:
        PAIRS: tl.constexpr = BLOCK_N // 2
        value = acc.to(dtype).to(tl.float32)
        first, second = tl.split(tl.permute(tl.reshape(value, [2, PAIRS, M_PAD]), (1, 2, 0)))
        index = tl.arange(0, PAIRS)
        mask = row_ok[None, :]
        if EPILOGUE == ROPE:
            head_start, freq_start = _rope_block(tile, HALF, PAIRS)
            first_cols = head_start + freq_start + index
            # v heads (past the rotated features) pass through unrotated
            rotate = head_start < rotated_features
            new_first = tl.where(rotate, first * cos - second * sin, first)
            new_second = tl.where(rotate, second * cos + first * sin, second)
            out_ptrs = out_ptr + rows[None, :] * stride_om + first_cols[:, None]
            tl.store(out_ptrs, new_first.to(dtype), mask=mask)
            tl.store(out_ptrs + HALF, new_second.to(dtype), mask=mask)
        else:
            activated = (first * tl.sigmoid(first)).to(dtype).to(tl.float32)
            out_ptrs = out_ptr + rows[None, :] * stride_om + (tile * PAIRS + index)[:, None]
            tl.store(out_ptrs, (activated * second).to(dtype), mask=mask)
