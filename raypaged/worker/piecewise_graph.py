"""Piecewise CUDA graphs: a step that mixes decodes with prefill chunks replays captured graphs
for everything but attention, and runs attention eagerly between them.

An eager 8B step launches ~350 kernels and is bound by the host launching them (33 of a 38 ms
mixed step on the H200), while the full decode graphs (cuda_graph.py) cannot take a prefill:
its attention's launch sizes depend on the step's query lengths. So the forward is cut at each
attention call (LlamaModel.pre_attention / post_attention, the same code the eager forward runs):

    piece 0      embedding, the step's rope angles, layer 0's input norm, QKV, rope
    piece i      layer i-1's o_proj, add & norm, MLP; layer i's add & norm, QKV, rope
    piece L      layer L-1's o_proj, add & norm, MLP; final norm

and each piece is captured once per padded token count (bucket). Pieces hand their results to
the next through static buffers sized for the largest bucket: q/k/v and the residual stream out
of a piece (and the rope angles out of piece 0), the attention output into the next. Copying
into the buffers costs a few small kernels per piece; holding each graph's own outputs instead
would pin ~1 GB per bucket at 8B.

Attention runs on the step's real T rows only (the padded rows are neither written to the KV
pool nor attended); the padded rows of the attention buffer keep stale values, and every captured
op is row-wise (GEMMs, norms, all-reduce), so they never reach a real row. Padding does change
which GEMM kernel the BLAS picks for the real rows (M differs), so a padded step equals the eager
forward to rounding, not bit for bit — as the full decode graphs do already.

Without capture (`capture()` not called: CPU, tests) `run` executes the very same pieces eagerly
on the same buffers, which is how the split is checked against the ordinary forward.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from typing import TYPE_CHECKING, cast

import torch

from raypaged.model.attention import AttentionMetadata
from raypaged.model.rotary import StepRotary
from raypaged.worker.cuda_graph import capture_graph

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from raypaged.model.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_MIN_BUCKET = 8


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Buckets 8, 16, 32, 48, 64, 96, 128, 192, … (powers of two and 1.5× between them from
    32 up, so a step pads by at most a half), capped at and including max_tokens."""
    sizes: list[int] = []
    size = _MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        if size >= 32 and size * 3 // 2 < max_tokens:
            sizes.append(size * 3 // 2)
        size *= 2
    return sorted(set(sizes + [max_tokens]))


class PiecewiseGraphs:
    """The model's non-attention pieces, per token-count bucket, as CUDA graphs (or eagerly)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 sizes: list[int], device: torch.device) -> None:
        """sizes: the buckets (token counts), e.g. piecewise_sizes(max_tokens)."""
        self.decoder = model.model  # LlamaModel: embed_tokens, pre/post_attention, final_norm
        self.kv_caches = kv_caches
        self.num_layers = len(self.decoder.layers)
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]
        attn = cast("LlamaDecoderLayer", self.decoder.layers[0]).self_attn.attn  # ModuleList: items typed as Module
        embed = self.decoder.embed_tokens.weight
        dtype, hidden_size = embed.dtype, embed.shape[1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(largest, *shape, dtype=dtype, device=device)

        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.residual = buffer(hidden_size)
        self.query = buffer(attn.num_heads, attn.head_dim)
        self.key = buffer(attn.num_kv_heads, attn.head_dim)
        self.value = buffer(attn.num_kv_heads, attn.head_dim)
        self.attn_out = buffer(attn.num_heads, attn.head_dim)
        self.hidden_out = buffer(hidden_size)
        # The step's rope (cos/sin of each token's position), computed by piece 0 and read by
        # the others: shaped as the rotary embedding makes them on this device.
        probe = self.decoder.rotary_emb(self.positions[:1], dtype)
        self.rope_cos = torch.zeros((largest, *probe.cos.shape[1:]), dtype=probe.cos.dtype, device=device)
        self.rope_sin = torch.zeros_like(self.rope_cos)
        self.rope_on_kernels = probe.on_kernels
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    # ---- the pieces ----------------------------------------------------------------------------
    def _run_piece(self, piece: int, n: int) -> None:
        """Piece `piece` on the buffers' first n rows: reads the attention output of layer
        piece-1 (or the input ids), writes layer piece's q/k/v (or the final hidden states)."""
        decoder = self.decoder
        if piece == 0:
            hidden, residual = decoder.embed_tokens(self.input_ids[:n]), None
        else:
            hidden, residual = decoder.post_attention(
                piece - 1, self.attn_out[:n].reshape(n, -1), self.residual[:n])
            if piece == self.num_layers:  # (never piece 0: a model has layers)
                self.hidden_out[:n].copy_(decoder.final_norm(hidden, residual))
                return
        if piece == 0:
            rope = decoder.rotary_emb(self.positions[:n], hidden.dtype)
            self.rope_cos[:n].copy_(rope.cos)
            self.rope_sin[:n].copy_(rope.sin)
        else:
            rope = StepRotary(self.rope_cos[:n], self.rope_sin[:n], self.rope_on_kernels)
        q, k, v, residual = decoder.pre_attention(piece, rope, hidden, residual)
        self.query[:n].copy_(q)
        self.key[:n].copy_(k)
        self.value[:n].copy_(v)
        self.residual[:n].copy_(residual)

    def _attention(self, layer: int, metadata: AttentionMetadata, t: int) -> None:
        """Layer `layer`'s attention, eagerly, on the step's t real rows."""
        self.decoder.attention(layer, self.query[:t], self.key[:t], self.value[:t],
                               self.kv_caches[layer], metadata, out=self.attn_out[:t])

    # ---- capture and replay --------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE | None = None) -> _POOL_HANDLE | None:
        """Capture every piece of every bucket, largest bucket first, into one memory pool
        (`pool`, or a new one); returns the pool for other graphs to share."""
        free_before, _ = torch.cuda.mem_get_info()
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            graphs = []
            for piece in range(self.num_layers + 1):
                graph, _ = capture_graph(functools.partial(self._run_piece, piece, size), pool, stream)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        logger.info("captured piecewise CUDA graphs (%d pieces) for token counts %s in %.1f s, "
                    "%.0f MiB", self.num_layers + 1, self.sizes, time.perf_counter() - start,
                    (free_before - free_after) / 2**20)
        return pool

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """The forward of a step of t <= max_tokens tokens -> hidden states [t, hidden_size]
        (a view of a static buffer, valid until the next run)."""
        t = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, t)]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        graphs = self.graphs.get(size)
        for piece in range(self.num_layers + 1):
            if piece:
                self._attention(piece - 1, metadata, t)
            if graphs is not None:
                graphs[piece].replay()
            else:
                self._run_piece(piece, size)
        return self.hidden_out[:t]

