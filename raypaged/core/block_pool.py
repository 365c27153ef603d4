"""The physical KV blocks: ids, reference counts, the free queue and the prefix-cache map.

Block ids are 0..num_blocks-1; each names one block of `block_size` token slots in every layer's
K and V pool on every rank. A block is *held* while its reference count is > 0 (one reference per
request whose block table contains it) and *free* otherwise. Free blocks wait in a queue and are
handed out oldest first. A full block may also carry a BlockHash (its contents, chained over the
whole prefix): it then stays findable in the prefix cache after its holders free it, until the
queue reaches it and it is reused for other tokens (evicted), which drops its hash.

Eviction order: a free block without a hash holds nothing worth keeping, so it goes to the FRONT
of the queue (reused first); a freed cached block goes to the BACK, so cached blocks are evicted
least-recently-freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

from raypaged.core.block_hashing import ROOT_HASH, BlockHasher, builtin_block_hash
from raypaged.core.block_pool_base import BlockPoolBase
from raypaged.core.errors import NoFreeBlocksError


class BlockHash(NamedTuple):
    """A full block's identity in the prefix cache.

    hash_value chains the parent block's hash_value, this block's token ids and its extra keys, so
    it stands for the whole prefix up to and including the block. The cache is keyed by
    hash_value, but a hit also compares the whole tuple (this block's token ids and extra keys)
    exactly, so a hash collision can never make a block with other tokens (or another tenant's
    salt) match.
    """

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple[Hashable, ...] | None

    def __hash__(self) -> int:
        # The chained hash already mixes everything: re-hashing the token tuple on every dict
        # operation would cost more than the rest of a lookup. Equality still compares it all.
        return self.hash_value


_new_tuple = tuple.__new__


def hash_block_tokens(parent: BlockHash | None, token_ids: tuple[int, ...],
                      extra_keys: tuple[Hashable, ...] | None = None,
                      hasher: BlockHasher = builtin_block_hash) -> BlockHash:
    """hasher: core/block_hashing.py's chain function (the manager's prefix_caching_hash_algo)."""
    parent_value = ROOT_HASH if parent is None else parent.hash_value
    # tuple.__new__ directly: BlockHash(...) would run NamedTuple's Python-level __new__ (a block
    # fills, and is hashed, somewhere every step).
    return _new_tuple(BlockHash, (hasher(parent_value, token_ids, extra_keys), token_ids, extra_keys))


class CacheEvent(NamedTuple):
    """One entry of a pool's cache event stream, decoded (read_event)."""

    hash_value: int
    stored: bool  # True: the value entered the tier's cache; False: it left it
    host: bool  # the host tier's (core/host_block_pool.py), else the GPU pool's


def stored_event(hash_value: int, host: bool = False) -> int:
    """A cache event: this hash value entered the prefix cache of the GPU pool (or, host, of the
    host tier). One int: the value shifted past a tier bit and a stored bit."""
    return (hash_value << 2) | (2 if host else 0) | 1


def removed_event(hash_value: int, host: bool = False) -> int:
    """A cache event: this hash value left the GPU pool's prefix cache (or, host, the host tier)."""
    return (hash_value << 2) | (2 if host else 0)


def read_event(event: int) -> CacheEvent:
    """A cache event decoded (an arithmetic shift: negative values decode too)."""
    return CacheEvent(event >> 2, bool(event & 1), bool(event & 2))


class CacheEventLog:
    """The cache events a pool keeps while record_events() is on, in order: what a data-parallel
    router learns the pool's contents from (frontend/prefix_router.py)."""

    events: list[int] | None = None

    def record_events(self) -> None:
        """Start keeping cache events (idempotent). Whoever turns them on takes them every step."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[int]:
        """The cache events since the last call (empty while not recording)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events


class BlockPool(BlockPoolBase, CacheEventLog):
    """The GPU tier: reference-counted blocks, the free queue, the prefix cache's events."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 reports: Callable[[BlockHash], bool] | None = None) -> None:
        """reports: which cached blocks' events the pool keeps (None: every block's); a manager
        whose pool holds several chains reports only the one a router can compute."""
        super().__init__(num_blocks)
        self.enable_caching = enable_caching
        self._reports = reports
        # Read directly by the KV cache manager on its hot path; only this class writes it.
        self.ref_cnt: list[int] = [0] * num_blocks
        # An ordered set: O(1) append, pop-oldest and removal from the middle (a prefix hit on a
        # free cached block takes it out of the queue).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Cache events since the last take_events (stored_event / removed_event, in order), while
        # record_events() is on: what a data-parallel router learns this pool's contents from.
        self.events: list[int] | None = None

    # ---- queries (the rest: BlockPoolBase) -------------------------------------------------------
    def free_block_ids(self) -> list[int]:
        """The free queue, next to be reused first."""
        return list(self._free)

    # ---- allocation ------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the front of the free queue, each with one reference.
        A cached block taken this way is evicted: its hash leaves the prefix cache."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        popitem = self._free.popitem
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        blocks = []
        for _ in range(num_blocks):
            block_id = popitem(False)[0]  # the oldest (positional: a keyword costs a parse per call)
            cached = block_hash[block_id]
            if cached is not None:
                del self._cached[cached.hash_value]
                block_hash[block_id] = None
                if self.events is not None and (self._reports is None or self._reports(cached)):
                    self.events.append(removed_event(cached.hash_value))
            ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit, or a fork sharing them). A free
        cached block leaves the free queue and is no longer evictable."""
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        ref_cnt, free = self.ref_cnt, self._free
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in order. A block whose count reaches 0 joins the
        free queue: at the back if it is cached (reusable until evicted), else at the front."""
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        ref_cnt = self.ref_cnt
        drops: dict[int, int] = {}
        for block_id in block_ids:
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, count in drops.items():
            if ref_cnt[block_id] < count:
                raise ValueError(f"block {block_id} freed {count} time(s) but holds "
                                 f"{ref_cnt[block_id]} reference(s)")
        free, block_hash = self._free, self.block_hash
        for block_id in block_ids:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free[block_id] = None
                if block_hash[block_id] is None:
                    free.move_to_end(block_id, last=False)

    # ---- prefix cache ----------------------------------------------------------------------------
    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held block that just became full. Returns False (and changes nothing) when
        another block already caches the same contents (two requests computed the same prefix at
        once): the first one stays the cached copy and this block frees as uncached."""
        if not self.enable_caching:
            return False
        if not (type(block_id) is int and 0 <= block_id < self.num_blocks) or self.ref_cnt[block_id] == 0:
            raise ValueError(f"block {block_id!r} is not a held block: only those can be cached")
        current = self.block_hash[block_id]
        if current is not None:
            if current == block_hash:
                return True
            raise ValueError(f"block {block_id} is already cached under other contents")
        if self._cached.setdefault(block_hash.hash_value, block_id) != block_id:
            return False  # another block caches these contents already (or collides with them)
        self.block_hash[block_id] = block_hash
        if self.events is not None and (self._reports is None or self._reports(block_hash)):
            self.events.append(stored_event(block_hash.hash_value))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update). Refused (False, nothing
        changed) while any block is held: running requests may still register their blocks."""
        if len(self._free) != self.num_blocks:
            return False
        if self.events is not None:
            reports, block_hash = self._reports, self.block_hash
            self.events += [removed_event(value) for value, block_id in self._cached.items()
                            if reports is None or reports(block_hash[block_id])]  # type: ignore[arg-type]
        self._forget_cached()
        return True

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_ids(self, block_ids: Iterable[int]) -> None:
        n = self.num_blocks
        for block_id in block_ids:
            if not (type(block_id) is int and 0 <= block_id < n):
                raise ValueError(f"block id {block_id!r} out of range [0, {n})")
