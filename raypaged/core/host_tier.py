"""HostTier: what both tiered managers keep beside their GPU pool (TieredKVCacheManager for one
table per request, TieredHybridKVCacheManager for one per KV-cache group).

The host tier is a HostBlockPool plus the step's copies between the tiers and the pins that keep
their host blocks in place:

* offloads (GPU block, host block): a cached GPU block the pool is about to hand out (evicting
  it) is first copied to a host block keeping its hash (`evicting`, called by the
  OffloadingBlockPool before its blocks change hands), and so is a block swapped out;
* loads (host block, GPU block): a host hit copied into a fresh GPU block (`load`);
* step pins: every host block a queued copy reads or writes, dropped when the step's transfers
  are taken (take_transfers), so nothing overwrites a host block before its copy ran;
* swap pins: the host blocks a request swapped out to, until it resumes or ends (`release`).

A host block and a GPU block are the same size whatever the group (core/kv_cache_groups.py), so
one host pool serves every group; groups never share a hash, so a hash is in one host block at
most whichever group it belongs to. Pure bookkeeping: the workers move the bytes
(worker/kv_offload.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from raypaged.core.block_pool import BlockHash, BlockPool
from raypaged.core.host_block_pool import HostBlockPool
from raypaged.core.kv_cache_interface import KVCacheManagerInterface, KVCacheStats
from raypaged.core.outputs import KVCopyTimes, KVTransfers

__all__ = ["HostTier", "HostTierManager", "OffloadingBlockPool"]


class OffloadingBlockPool(BlockPool):
    """A BlockPool that tells `on_reuse` which blocks get_new_blocks is about to hand out, while
    their hashes (the ones it evicts) are still readable."""

    def __init__(self, num_blocks: int, enable_caching: bool, on_reuse: Callable[[list[int]], None],
                 reports: Callable[[BlockHash], bool] | None = None) -> None:
        super().__init__(num_blocks, enable_caching, reports)
        self._on_reuse = on_reuse

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if 0 < num_blocks <= self.num_free_blocks:
            self._on_reuse(list(islice(self._free, num_blocks)))
        return super().get_new_blocks(num_blocks)


class HostTier:
    def __init__(self, num_host_blocks: int, block_bytes: int = 0,
                 reports: Callable[[BlockHash], bool] | None = None) -> None:
        """block_bytes: the bytes one block holds over every rank (what a transfer moves).
        reports: which host blocks' cache events are kept (HostBlockPool)."""
        self.pool = HostBlockPool(num_host_blocks, reports)
        self.block_bytes = block_bytes
        self.offloads: list[tuple[int, int]] = []  # (GPU block, host block), this step
        self.loads: list[tuple[int, int]] = []  # (host block, GPU block), this step
        self.step_pins: list[int] = []  # host pins that last until take_transfers
        # The workers' copy times as last reported (they keep them: a reset leaves them be).
        self.copy_times = KVCopyTimes()
        # Preempted by swap -> the host blocks pinned for it until it resumes or ends.
        self.swapped: dict[str, list[int]] = {}
        self.prefetched: set[str] = set()  # waited one step for a prefetch (until allocated)
        self.loads_read_now = False  # a load this step is read by this step's forward
        self.num_prefetches = 0
        self.host_hit_tokens = 0
        self.num_offloaded = 0
        self.num_loaded = 0

    # ---- copies ----------------------------------------------------------------------------------
    def evicting(self, block_ids: list[int], block_hash: list[BlockHash | None]) -> None:
        """The GPU pool is about to hand these blocks out (block_hash: its hashes): a cached one
        is offloaded first (its host copy kept if there is one), and a load queued into one this
        step is dropped (the block's holder left in this same step; its contents stay in the
        host tier, which a step pin keeps them in)."""
        host = self.pool
        for block_id in block_ids:
            cached = block_hash[block_id]
            if cached is None:
                continue
            stored = host.store(cached)
            if stored is None:
                continue  # every host block is pinned: this one is just evicted
            host_id, needs_copy = stored
            self.step_pins.append(host_id)
            if needs_copy:
                self.offloads.append((block_id, host_id))
        if self.loads:
            reused = set(block_ids)
            self.loads = [load for load in self.loads if load[1] not in reused]

    def swap_out(self, block_id: int, block_hash: BlockHash) -> int | None:
        """Store a block of a request being swapped out, pinned for it (the caller records the
        pin in `swapped`): its host block, or None when every host block is pinned."""
        stored = self.pool.store(block_hash)
        if stored is None:
            return None
        host_id, needs_copy = stored
        self.step_pins.append(host_id)
        self.pool.pin(host_id)
        if needs_copy:
            self.offloads.append((block_id, host_id))
        return host_id

    def pin_for_step(self, host_ids: Iterable[int]) -> None:
        """Host blocks this step's loads will read: pinned until take_transfers."""
        for host_id in host_ids:
            self.pool.pin(host_id)
            self.step_pins.append(host_id)

    def load(self, host_id: int, block_id: int, read_now: bool) -> None:
        """Queue a copy of a (step-pinned) host block into a GPU block; read_now: this step's
        forward reads it, so the forward waits for it."""
        self.loads.append((host_id, block_id))
        self.loads_read_now = self.loads_read_now or read_now

    def take_transfers(self) -> KVTransfers | None:
        """The step's copies (None: none); the step's pins go."""
        if self.step_pins:
            self.pool.unpin(self.step_pins)
            self.step_pins = []
        if not self.offloads and not self.loads:
            return None
        transfers = KVTransfers(self.offloads, self.loads, loads_read_now=self.loads_read_now)
        self.offloads, self.loads, self.loads_read_now = [], [], False
        self.num_offloaded += len(transfers.offloads)
        self.num_loaded += len(transfers.loads)
        return transfers

    # ---- requests --------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """It has blocks again (or ended): its swap pins go, and it may be prefetched again."""
        self.prefetched.discard(request_id)
        swapped = self.swapped.pop(request_id, None)
        if swapped:
            self.pool.unpin(swapped)

    def reset(self) -> None:
        """Forget everything (the workers and their host pools were replaced)."""
        self.pool.reset()
        self.offloads, self.loads, self.step_pins = [], [], []
        self.swapped.clear()
        self.prefetched.clear()
        self.loads_read_now = False

    # ---- reporting -------------------------------------------------------------------------------
    def stats(self, gpu: KVCacheStats) -> KVCacheStats:
        """The GPU pool's stats with the host tier's fields filled."""
        return dataclasses.replace(
            gpu, host_cache_hits=self.host_hit_tokens, num_host_blocks=self.pool.num_blocks,
            num_host_free_blocks=self.pool.num_free_blocks,
            offloaded_bytes=self.num_offloaded * self.block_bytes,
            loaded_bytes=self.num_loaded * self.block_bytes,
            host_copy_s=self.copy_times.copy_s, host_copy_exposed_s=self.copy_times.exposed_s)

    def check_pins(self) -> None:
        """Assert (tests) the pool's invariants, no copy left untaken, and that every pin is a
        swapped request's."""
        self.pool.check()
        assert not self.step_pins and not self.offloads and not self.loads
        pins = [0] * self.pool.num_blocks
        for host_ids in self.swapped.values():
            for host_id in host_ids:
                pins[host_id] += 1
        assert self.pool.pin_cnt == pins, "host pins other than the swapped requests'"


class HostTierManager(KVCacheManagerInterface):
    """What a tiered manager answers from its HostTier alone (put before its paged base, which
    answers the super() calls): the step's transfers, both tiers' cache events and reset, the
    tier's counts and stats."""

    tier: HostTier
    _host_hits: dict[str, Any]  # request -> its last lookup's host hits (the manager's own form)

    @property
    def host_pool(self) -> HostBlockPool:
        return self.tier.pool

    def take_transfers(self) -> KVTransfers | None:
        self._host_hits.clear()  # lookups of requests the step did not admit: looked up again
        return self.tier.take_transfers()

    def record_cache_events(self) -> None:
        super().record_cache_events()
        self.tier.pool.record_events()

    def take_cache_events(self) -> list[int]:
        """The GPU pool's events, then the host tier's (each tier's in order; the router keeps
        the tiers apart, so their relative order does not matter)."""
        events = super().take_cache_events()
        host = self.tier.pool.take_events()
        return events + host if host else events

    def reset_prefix_cache(self) -> bool:
        """Both tiers forget everything (e.g. the workers and their host pools were replaced)."""
        # super() is the concrete paged manager this class is mixed before, never the interface.
        if not super().reset_prefix_cache():  # type: ignore[safe-super]
            return False
        self.tier.reset()
        self._host_hits.clear()
        return True

    def stats(self) -> KVCacheStats:
        return self.tier.stats(super().stats())  # type: ignore[safe-super]

    def record_copy_times(self, times: KVCopyTimes) -> None:
        self.tier.copy_times = times

    @property
    def num_swapped_requests(self) -> int:
        return len(self.tier.swapped)

    @property
    def num_prefetches(self) -> int:
        """Admissions that waited one step for their host hits to load."""
        return self.tier.num_prefetches
