"""KV-cache groups: a model's layers grouped by attention kind, each group with its own block
table per request over ONE shared pool of physical blocks (vLLM v1's hybrid allocator).

A group is a set of layers of one kind: full attention, or a sliding window of W tokens (a query
at p reads keys (p - W, p]). A physical block handed to a group holds block_size tokens' K and V
for every layer of that group, so a block's bytes are

    block_bytes = group_size * block_size * 2 * num_kv_heads * head_dim * dtype_bytes

and every block must be the same size for any group to take any block. As vLLM does, the layers
are therefore cut into groups of EQUAL layer count (group_size = the count of the rarest kind;
a kind whose count is not a multiple of it leaves its last group short, and that group's blocks
carry unused room for the missing layers — counted as waste, never read). A Gemma-3-shaped model
(5 sliding : 1 full) thus has 6 groups of L / 6 layers: 1 full and 5 sliding, all alike in size;
one full group (every model before the sliding-window families) is exactly today's pool.

make_kv_cache_manager() is the seam: one full group gets the plain KVCacheManager (the same
block ids, the same outputs as before groups existed); anything else the HybridKVCacheManager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO
from raypaged.core.kv_cache_interface import KVCacheManagerInterface


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: its attention kind and the model layers whose K/V its blocks hold.
    sliding_window None: full attention (the group's table holds every block of the context)."""

    sliding_window: int | None
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (type(self.sliding_window) is not int
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got "
                             f"{self.sliding_window!r}")

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def max_live_blocks(self, block_size: int, num_tokens: int, max_tokens_per_step: int) -> int:
        """The most blocks one request of num_tokens tokens can hold in this group at once, when
        a step computes at most max_tokens_per_step of its tokens: a sliding group's table keeps
        the window of the step's first query plus the step's own tokens."""
        whole = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return whole
        span = self.sliding_window - 1 + min(max_tokens_per_step, num_tokens)
        return min(whole, -(-span // block_size) + 1)


FULL_ATTENTION = (KVCacheGroupSpec(None),)


def group_layers(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """Group a model's layers (layer i's sliding window or None) into equal-sized KV-cache
    groups, full-attention groups first. Layers of one kind are cut, in layer order, into groups
    of the rarest kind's count; see the module docstring for why sizes are equal."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    group_size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first, then by window
    groups = []
    for window in order:
        layers = kinds[window]
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(window, tuple(layers[start:start + group_size])))
    return tuple(groups)


def group_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layers per physical block: the largest group (shorter groups pad their blocks)."""
    return max(max(len(g.layer_ids), 1) for g in groups)


def make_kv_cache_manager(num_blocks: int, block_size: int,
                          groups: Sequence[KVCacheGroupSpec] = FULL_ATTENTION,
                          enable_prefix_caching: bool = True,
                          max_tokens_per_step: int | None = None,
                          hash_algo: str = DEFAULT_HASH_ALGO) -> KVCacheManagerInterface:
    """The paged manager for these groups. One full-attention group: the plain KVCacheManager,
    exactly as before groups existed. max_tokens_per_step (the scheduler's token budget) only
    bounds a sliding group's need in can_fit; None: a whole request in one step. hash_algo: the
    prefix-cache chain's (core/block_hashing.py)."""
    from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from raypaged.core.kv_cache_manager import KVCacheManager

    if not groups:
        raise ValueError("a KV cache needs at least one group")
    if len(groups) == 1 and not groups[0].is_sliding:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                              hash_algo=hash_algo)
    return HybridKVCacheManager(num_blocks, block_size, groups,
                                enable_prefix_caching=enable_prefix_caching,
                                max_tokens_per_step=max_tokens_per_step, hash_algo=hash_algo)
