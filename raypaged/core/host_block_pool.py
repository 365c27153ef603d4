"""HostBlockPool: the second tier of KV blocks, in host memory, behind the GPU BlockPool.

Ids are 0..num_blocks-1 and name one block of every layer's K and V in each rank's host pool
(worker/kv_offload.py). A host block is free or caches exactly one BlockHash; a hash is cached by
at most one host block. Cached blocks are evicted least recently used first (a store or a hit
makes a block the most recent), except pinned ones: a block is pinned while a copy that reads or
writes it is still to be executed (until the step's transfers are taken) and while a request
swapped out to it waits to resume. A pinned block is never evicted, so a copy never races with
the block's next contents.

Cache events (record_events / take_events, the host flag set): every hash value that enters or
leaves the tier, for a data-parallel router's view of it (frontend/prefix_router.py).

Pure bookkeeping over integers: nothing here moves bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from raypaged.core.block_pool import BlockHash, CacheEventLog, removed_event, stored_event
from raypaged.core.block_pool_base import BlockPoolBase


class HostBlockPool(BlockPoolBase, CacheEventLog):
    """The host tier: pinned or least-recently-used cached blocks, and a stack of free ones."""

    def __init__(self, num_blocks: int, reports: Callable[[BlockHash], bool] | None = None) -> None:
        """reports: which cached blocks' events the pool keeps (None: every block's), as
        BlockPool's: a pool holding several KV-cache groups' chains reports the routed one."""
        super().__init__(num_blocks)
        self._reports = reports
        self.pin_cnt: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 first
        # Cached, unpinned blocks, least recently used first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()

    # ---- storing ---------------------------------------------------------------------------------
    def store(self, block_hash: BlockHash) -> tuple[int, bool] | None:
        """A host block for these contents, pinned once (the caller's copy; unpin it when the
        copy is taken): (block, True) when the contents must be copied into it, (block, False)
        when it caches them already. A new block is a free one, else the least recently used
        unpinned one (evicted: its hash leaves the tier). None, changing nothing, when every
        block is pinned, or a colliding hash value is cached under other contents."""
        host_id = self._cached.get(block_hash.hash_value)
        if host_id is not None:
            if self.block_hash[host_id] != block_hash:
                return None
            self.pin(host_id)
            return host_id, False
        if self._free:
            host_id = self._free.pop()
        elif self._lru:
            host_id = self._lru.popitem(last=False)[0]
            evicted = self.block_hash[host_id]
            assert evicted is not None
            del self._cached[evicted.hash_value]
            if self.events is not None and (self._reports is None or self._reports(evicted)):
                self.events.append(removed_event(evicted.hash_value, host=True))
        else:
            return None
        self.block_hash[host_id] = block_hash
        self._cached[block_hash.hash_value] = host_id
        self.pin_cnt[host_id] = 1
        if self.events is not None and (self._reports is None or self._reports(block_hash)):
            self.events.append(stored_event(block_hash.hash_value, host=True))
        return host_id, True

    # ---- pins ------------------------------------------------------------------------------------
    def pin(self, host_id: int) -> None:
        """One more pin on a cached block: it leaves the eviction order until unpinned."""
        if self.block_hash[host_id] is None:
            raise ValueError(f"host block {host_id} caches nothing: only cached blocks are pinned")
        if self.pin_cnt[host_id] == 0:
            del self._lru[host_id]
        self.pin_cnt[host_id] += 1

    def unpin(self, host_ids: Iterable[int]) -> None:
        """Drop one pin on each block; one left unpinned becomes the most recently used."""
        for host_id in host_ids:
            if self.pin_cnt[host_id] <= 0:
                raise ValueError(f"host block {host_id} is not pinned")
            self.pin_cnt[host_id] -= 1
            if self.pin_cnt[host_id] == 0:
                self._lru[host_id] = None

    def touch(self, host_id: int) -> None:
        """A hit: the block becomes the most recently used."""
        if host_id in self._lru:
            self._lru.move_to_end(host_id)

    def reset(self) -> None:
        """Forget every block (the workers' host pools were replaced): all free, none pinned."""
        if self.events is not None:
            reports, block_hash = self._reports, self.block_hash
            self.events += [removed_event(value, host=True) for value, host_id in self._cached.items()
                            if reports is None or reports(block_hash[host_id])]  # type: ignore[arg-type]
        self._forget_cached()
        self.pin_cnt[:] = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._lru.clear()

    # ---- checks (tests) --------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the pool's invariants: every block free or cached (exactly one of the two),
        each hash in one block, the eviction order exactly the unpinned cached blocks."""
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is free twice"
        for host_id in range(self.num_blocks):
            cached = self.block_hash[host_id]
            assert (host_id in free) == (cached is None), f"host block {host_id}: free and cached"
            if cached is None:
                assert self.pin_cnt[host_id] == 0
                continue
            assert self._cached.get(cached.hash_value) == host_id
            assert (host_id in self._lru) == (self.pin_cnt[host_id] == 0)
        assert len(self._cached) == self.num_blocks - len(free)
