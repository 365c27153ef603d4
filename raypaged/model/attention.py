"""Paged attention layer and the per-step metadata every layer shares.

A step's tokens arrive flattened: decode requests first (one token each), then prefill/extend
requests (a chunk of new tokens each, attending to their cached prefix). Each layer writes the
step's K/V into the paged pool by slot, then runs the decode kernel on the first part and the
prefill kernel on the rest, both writing into one output tensor.

A sliding-window layer (Mistral, Gemma's local layers) reads only its window: its decode work
list is planned with the window, once a step per distinct window, on the first layer that needs
it (`window_decode_work`), so every layer of that window shares it.

KV-cache groups (models whose layers differ: core/kv_cache_groups.py): each group has its own
block tables and slot mapping; the metadata carries them all ([G, S, W], [G, T]) with each
layer's group, and `for_layer(i)` is layer i's view (its group's tables, the rest shared).
An FP8 pool (--kv-cache-dtype fp8, kernels/kv_quant.py) holds K/V quantized with the layer's
`k_scale` / `v_scale` (buffers: the checkpoint's, model/kv_scales.py, else 1.0); the layer hands
them to every op when its pool is FP8, which the pool's dtype says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from raypaged.kernels import ops
from raypaged.kernels.kv_quant import is_fp8


@dataclass
class AttentionMetadata:
    """Built once per step by the ModelRunner; read by every attention layer."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; -1 = do not write
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context incl. this step's tokens
    query_start_loc: torch.Tensor  # [S+1] int32: cu_seqlens of this step's tokens
    num_decodes: int  # requests 0..num_decodes-1 have exactly one new token
    num_decode_tokens: int  # == num_decodes; kept separate for the kernels' sake
    max_query_len: int  # host int: the longest request's new tokens
    # The decode part's work list (ops.plan_decode), once a step; None: every layer plans its own.
    decode_work: torch.Tensor | None = None
    # The decode part's work lists of the sliding-window layers, by window (window_decode_work).
    window_decode_works: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)
    # KV-cache groups: every group's block tables [G, S, max_blocks] and slot mappings [G, T]
    # (block_tables and slot_mapping above are group 0's), and layer i's group. () : one group.
    group_block_tables: torch.Tensor | None = field(default=None, repr=False)
    group_slot_mappings: torch.Tensor | None = field(default=None, repr=False)
    layer_groups: tuple[int, ...] = ()

    # The prefill part's views, computed once here rather than in every layer.
    prefill_block_tables: torch.Tensor = field(init=False, repr=False)
    prefill_seq_lens: torch.Tensor = field(init=False, repr=False)
    prefill_query_start_loc: torch.Tensor = field(init=False, repr=False)
    _group_views: dict[int, AttentionMetadata] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_seqs = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.shape[0]} entries for {num_seqs} "
                "sequences; expected num_seqs + 1"
            )
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"block_tables has {self.block_tables.shape[0]} rows for {num_seqs} sequences"
            )
        if not 0 <= self.num_decodes <= num_seqs or self.num_decode_tokens != self.num_decodes:
            raise ValueError(
                f"num_decodes {self.num_decodes} / num_decode_tokens {self.num_decode_tokens} "
                f"invalid for {num_seqs} sequences (decodes carry exactly one token each)"
            )
        if self.layer_groups and (self.group_block_tables is None or self.group_slot_mappings is None):
            raise ValueError("layer_groups needs every group's block tables and slot mappings")
        self._group_views = {}
        d = self.num_decodes
        self.prefill_block_tables = self.block_tables[d:]
        self.prefill_seq_lens = self.seq_lens[d:]
        self.prefill_query_start_loc = self.query_start_loc[d:] - self.num_decode_tokens

    def plan_decode(self, num_kv_heads: int, out: torch.Tensor | None = None) -> None:
        """Compute the decode part's work list for the step (`decode_work`), into `out` if given."""
        if self.num_decodes:
            self.decode_work = ops.plan_decode(self.seq_lens[: self.num_decodes], num_kv_heads,
                                               out=out)
        self._group_views.clear()  # they copied the old decode_work

    def for_layer(self, layer: int) -> AttentionMetadata:
        """What layer `layer` reads: this metadata with one KV-cache group, else its group's
        view (that group's tables and slots; lengths and work lists shared), made once a step."""
        if not self.layer_groups:
            return self
        group = self.layer_groups[layer]
        view = self._group_views.get(group)
        if view is None:
            assert self.group_block_tables is not None and self.group_slot_mappings is not None
            view = self._group_views[group] = dataclasses.replace(
                self, slot_mapping=self.group_slot_mappings[group],
                block_tables=self.group_block_tables[group], group_block_tables=None,
                group_slot_mappings=None, layer_groups=())
        return view

    def window_decode_work(self, window: int, num_kv_heads: int) -> torch.Tensor | None:
        """The decode part's work list for layers of sliding window `window`: planned on the
        first call of the step (the plan is a device launch on the step's seq_lens, so inside a
        CUDA graph it is captured and re-plans on replay), the same list after."""
        if window not in self.window_decode_works:
            self.window_decode_works[window] = ops.plan_decode(
                self.seq_lens[: self.num_decodes], num_kv_heads, sliding_window=window)
        return self.window_decode_works[window]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


class PagedAttention(nn.Module):
    """softmax(q kᵀ · scale) v over this rank's heads, reading K/V from the paged pool; within a
    sliding window (keys (p - W, p]) and with the scores soft-capped (c · tanh(s / c)) if given."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # Device tensors, so no step reads them on the host (and graphs capture their address).
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D], written into `out` if given
        (the piecewise CUDA graphs' static buffer)."""
        k_cache, v_cache = kv_cache
        if k_cache.shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KV cache holds {tuple(k_cache.shape[2:])} (heads, head_dim) per slot; this rank's "
                f"attention needs ({self.num_kv_heads}, {self.head_dim})"
            )
        k_scale, v_scale = ((self.k_scale, self.v_scale) if is_fp8(k_cache.dtype)
                            else (None, None))
        ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale,
                     v_scale=v_scale)

        if out is None:
            out = torch.empty_like(query)
        num_decode_tokens = meta.num_decode_tokens
        window, softcap = self.sliding_window, self.softcap
        if meta.num_decodes:
            work = meta.decode_work if window is None else meta.window_decode_work(
                window, self.num_kv_heads)
            ops.paged_decode(
                query[:num_decode_tokens],
                k_cache,
                v_cache,
                meta.block_tables[: meta.num_decodes],
                meta.seq_lens[: meta.num_decodes],
                self.scale,
                out=out[:num_decode_tokens],
                work=work,
                sliding_window=window,
                softcap=softcap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if meta.num_prefills:
            ops.paged_prefill(
                query[num_decode_tokens:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
                self.scale,
                out=out[num_decode_tokens:],
                # The kernel may read the new tokens' K/V from here rather than the pool.
                k_new=key[num_decode_tokens:],
                v_new=value[num_decode_tokens:],
                sliding_window=window,
                softcap=softcap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out
