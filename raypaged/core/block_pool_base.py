"""What both tiers' pools of KV blocks share: the blocks, their free set and the cache map.

A pool holds blocks 0..num_blocks-1. Each is free or not (how the free ones are ordered and
reused is the pool's own: BlockPool's free queue, HostBlockPool's stack behind its LRU), and may
cache one BlockHash; a hash value is cached by at most one block. A lookup compares the whole
BlockHash (token ids and extra keys too), so a collision of hash values never matches.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # block_pool.py defines it, and builds its pool on this base
    from raypaged.core.block_pool import BlockHash

__all__ = ["BlockPoolBase"]


class BlockPoolBase:
    """The queries both pools answer the same way. A subclass sets _free (its free blocks, in
    its reuse order) and keeps block_hash and _cached in step as blocks are cached and evicted."""

    _free: Collection[int]

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Block id -> the contents it caches (None: nothing). Read directly by the KV cache
        # managers on their hot paths; only the pool writes it.
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # hash_value -> the block caching it. Keyed by the int, not the BlockHash: a dict
        # operation then calls no Python-level __hash__ (a block fills every step somewhere).
        self._cached: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block caching exactly these contents, or None."""
        block_id = self._cached.get(block_hash.hash_value)
        if block_id is None or self.block_hash[block_id] != block_hash:
            return None  # not cached, or only a block whose contents collide in hash_value
        return block_id

    def _forget_cached(self) -> None:
        """Every block caches nothing now (in place: the managers hold block_hash)."""
        self._cached.clear()
        self.block_hash[:] = [None] * self.num_blocks
