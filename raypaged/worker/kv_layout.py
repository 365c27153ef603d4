"""Where each layer's K/V lives in the paged pool when its layers are cut into KV-cache groups.

core/kv_cache_groups.py groups a model's layers by attention kind into groups of equal layer
count; a physical block holds block_size tokens of K and V for every layer of ONE group, and
any group may take any block. The pool is therefore `layers_per_block` pairs of K/V tensors
[num_blocks, block_size, kv_heads, head_dim], and a layer's K/V is the pair at its position
within its group: the layers at one position of different groups share a pair and never a
block (each block belongs to one group at a time). The kernels index a layer's pair through its
group's block table, so they are unchanged. One full group of every layer is the old pool: one
pair per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raypaged.core.kv_cache_groups import KVCacheGroupSpec, group_size

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVLayout:
    """The pool's shape for these groups over num_layers layers (every layer in one group)."""

    groups: tuple[KVCacheGroupSpec, ...]
    num_layers: int

    def __post_init__(self) -> None:
        layers = sorted(i for g in self.groups for i in g.layer_ids)
        if layers != list(range(self.num_layers)):
            raise ValueError(f"KV-cache groups {self.groups} do not cover layers 0..{self.num_layers - 1} "
                             "once each")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_block(self) -> int:
        """K/V tensor pairs in the pool: the layers one block holds (the largest group's)."""
        return group_size(self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Layer i's group index."""
        group_of = {layer: g for g, spec in enumerate(self.groups) for layer in spec.layer_ids}
        return tuple(group_of[i] for i in range(self.num_layers))

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """Layer i's tensor pair: its position within its group."""
        slot_of = {layer: k for spec in self.groups for k, layer in enumerate(spec.layer_ids)}
        return tuple(slot_of[i] for i in range(self.num_layers))

    def per_layer(self, pool: Sequence[KVCache]) -> list[KVCache]:
        """The model's per-layer caches over the pool's layers_per_block pairs."""
        if len(pool) != self.layers_per_block:
            raise ValueError(f"{len(pool)} K/V pairs for a pool of {self.layers_per_block}")
        return [pool[slot] for slot in self.layer_slots]


def unique_caches(kv_caches: Sequence[KVCache]) -> list[KVCache]:
    """The distinct K/V pairs of a per-layer list (layers of different groups share pairs), in
    first-use order: what a block copy must touch once each. Pairs are told apart by their
    memory, not their tensor objects: two views of one storage are one pair."""
    seen: dict[tuple[int, int], KVCache] = {}
    for pair in kv_caches:
        seen.setdefault((pair[0].data_ptr(), pair[1].data_ptr()), pair)
    return list(seen.values())
