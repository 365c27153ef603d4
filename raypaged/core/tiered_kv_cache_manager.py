"""TieredKVCacheManager: the paged KVCacheManager with a host-memory tier behind its GPU pool.

Offload. A full cached block that the GPU pool evicts (it is handed out for other tokens) is
first copied to a host block, keeping its hash (HostBlockPool: LRU over unpinned blocks, each
hash in one host block at most). The copy goes out with the step that evicts it, before that
step's forward writes the block.

Host hits. get_computed_blocks finds the request's leading cached blocks on the GPU, then the
blocks that follow in the host tier (the whole hash compared: tokens and salt, never another
tenant's). The first time a request heads the waiting queue with host hits, may_admit prefetches
them (fresh GPU blocks in the GPU prefix cache, loads queued; see may_admit) and the request waits
one step, so the loads overlap that step's forward. Otherwise allocate_slots gives each host hit
a fresh GPU block, registers it in the GPU prefix cache under the hit's hash and queues the load
(host block, GPU block); the request's first chunk runs in the same step, after the load
(KVTransfers.loads_read_now). A host block being read stays cached too, pinned until the step's
transfers are taken, so nothing overwrites it before it is read.

Swap preemption (swap_preemption): free_preempted first stores the request's full computed
blocks in the host tier (copying those not there yet) and pins them for it; on resumption its
lookup finds them (with prefix caching off: only its own) and they are loaded back, so only the
partial last block is recomputed. If the host tier has no unpinned block left, the rest of the
request recomputes, as recompute preemption would.

Every transfer of a step is in take_transfers() (the scheduler puts it in its SchedulerOutput);
the workers apply offloads, then loads, then the step's copy-on-write and forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import islice

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO
from raypaged.core.block_pool import BlockPool
from raypaged.core.host_block_pool import HostBlockPool
from raypaged.core.kv_cache_interface import KVCacheStats
from raypaged.core.kv_cache_manager import KVCacheManager, _RequestBlocks
from raypaged.core.outputs import KVTransfers
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request

__all__ = ["TieredKVCacheManager"]


class _OffloadingBlockPool(BlockPool):
    """A BlockPool that tells `on_reuse` which blocks get_new_blocks is about to hand out, while
    their hashes (the ones it evicts) are still readable."""

    def __init__(self, num_blocks: int, enable_caching: bool, on_reuse: Callable[[list[int]], None]) -> None:
        super().__init__(num_blocks, enable_caching)
        self._on_reuse = on_reuse

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if 0 < num_blocks <= self.num_free_blocks:
            self._on_reuse(list(islice(self._free, num_blocks)))
        return super().get_new_blocks(num_blocks)


class TieredKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 num_host_blocks: int, swap_preemption: bool = False, block_bytes: int = 0,
                 hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """block_bytes: the bytes one block holds over every rank (what a transfer moves)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_algo)
        self.block_pool = _OffloadingBlockPool(num_blocks, enable_prefix_caching, self._reusing)
        self._ref_cnt = self.block_pool.ref_cnt
        self.host_pool = HostBlockPool(num_host_blocks)
        self.swap_preemption = swap_preemption
        self.block_bytes = block_bytes
        self._offloads: list[tuple[int, int]] = []  # (GPU block, host block), this step
        self._loads: list[tuple[int, int]] = []  # (host block, GPU block), this step
        self._step_pins: list[int] = []  # host pins that last until take_transfers
        # Request -> the host blocks its last lookup found after its GPU hits (for allocate_slots).
        self._host_hits: dict[str, list[int]] = {}
        # Preempted by swap -> the host blocks pinned for it until it resumes or ends.
        self._swapped: dict[str, list[int]] = {}
        self._prefetched: set[str] = set()  # waited one step for a prefetch (until allocated)
        self._loads_read_now = False  # a load this step is read by this step's forward
        self._num_prefetches = 0
        self._host_hit_tokens = 0
        self._num_offloaded = 0
        self._num_loaded = 0

    # ---- eviction into the host tier -------------------------------------------------------------
    def _reusing(self, block_ids: list[int]) -> None:
        """The GPU pool is about to hand these blocks out: a cached one is offloaded first (its
        host copy kept if there is one), and a load queued into one this step is dropped (the
        block's holder left in this same step; its contents stay in the host tier)."""
        block_hash, host = self.block_pool.block_hash, self.host_pool
        for block_id in block_ids:
            cached = block_hash[block_id]
            if cached is None:
                continue
            stored = host.store(cached)
            if stored is None:
                continue  # every host block is pinned: this one is just evicted
            host_id, needs_copy = stored
            self._step_pins.append(host_id)
            if needs_copy:
                self._offloads.append((block_id, host_id))
        if self._loads:
            reused = set(block_ids)
            self._loads = [load for load in self._loads if load[1] not in reused]

    # ---- prefix lookup over both tiers -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """GPU hits, then host hits after them: the tokens counted include both; the blocks
        returned are the GPU ones (allocate_slots adds the host hits' blocks)."""
        blocks, num_tokens = super().get_computed_blocks(request)
        request_id = request.request_id
        self._host_hits.pop(request_id, None)
        swapped = self._swapped.get(request_id)
        if not self.enable_prefix_caching and not swapped:
            return blocks, num_tokens
        # Without prefix caching nothing is shared: only the request's own swapped blocks count.
        hits = self._host_lookup(request, len(blocks), None if self.enable_prefix_caching else set(swapped or ()))
        if hits:
            self._host_hits[request_id] = hits
        return blocks, num_tokens + len(hits) * self.block_size

    def _host_lookup(self, request: Request, first: int, own: set[int] | None) -> list[int]:
        """The host blocks caching the request's blocks first, first + 1, ... (its last token
        always left to compute); with `own`, only those among them."""
        max_hit_blocks = (len(request.all_token_ids) - 1) // self.block_size
        if first >= max_hit_blocks:
            return []
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks(request)
        hashes, lookup = state.block_hashes, self.host_pool.get_cached_block
        hits: list[int] = []
        for i in range(first, max_hit_blocks):
            if i >= len(hashes):
                self._hash_blocks(state, i + 1)
            host_id = lookup(hashes[i])
            if host_id is None or (own is not None and host_id not in own):
                break
            hits.append(host_id)
        return hits

    def may_admit(self, request: Request) -> bool:
        """Prefetch. The first time the request heads the waiting queue with host hits after its
        GPU hits, they get fresh GPU blocks, registered in the GPU prefix cache and freed at once
        (cached, evicted last), and their loads are queued; the answer is no. Those loads overlap
        this step's forward (nothing reads the blocks in it: no other waiting request is admitted
        behind this one), and next step the request finds them on the GPU. It never waits twice:
        were the blocks evicted meanwhile, its host hits load with its first chunk. Prefix caching
        on only (the loaded blocks must be found again)."""
        request_id = request.request_id
        if not self.enable_prefix_caching or request.prompt_logprobs_pending or request_id in self._prefetched:
            return True
        self._prefetched.add(request_id)
        gpu_hits, _ = KVCacheManager.get_computed_blocks(self, request)
        hits = self._host_lookup(request, len(gpu_hits), None)
        pool, host = self.block_pool, self.host_pool
        pool.touch(gpu_hits)  # not to be evicted for the loads' blocks
        if not hits or len(hits) > pool.num_free_blocks:
            pool.free_blocks(reversed(gpu_hits))
            return True
        for host_id in hits:
            host.pin(host_id)
        self._step_pins += hits
        blocks = pool.get_new_blocks(len(hits))
        hashes = self._requests[request_id].block_hashes[len(gpu_hits):]
        for host_id, block_id, block_hash in zip(hits, blocks, hashes):
            if pool.cache_full_block(block_id, block_hash):
                self._loads.append((host_id, block_id))
                self._host_hit_tokens += self.block_size
        pool.free_blocks(reversed(gpu_hits + blocks))  # its tail first: the prefix is evicted last
        self._num_prefetches += 1
        return False

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """As KVCacheManager's; on a first allocation after a lookup with host hits, num_new_tokens
        counts from the end of the hits (as the scheduler computes it from the lookup's tokens),
        and the hits get fresh GPU blocks with their loads queued."""
        hits = self._host_hits.pop(request.request_id, None) if self._host_hits else None
        if not hits:
            new_blocks = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
            if new_blocks is not None and (self._swapped or self._prefetched):
                self._release_swapped(request.request_id)  # resumed from the GPU tier alone
            return new_blocks
        state = self._requests[request.request_id]
        first = len(new_computed_blocks or ())
        host = self.host_pool
        if state.block_ids or any(host.block_hash[host_id] != state.block_hashes[first + k]
                                  for k, host_id in enumerate(hits)):
            raise ValueError(f"request {request.request_id!r}: host hits must come from the "
                             "get_computed_blocks call just before its first allocation")
        for host_id in hits:  # our own evictions below must not take them
            host.pin(host_id)
        new_blocks = super().allocate_slots(request, num_new_tokens + len(hits) * self.block_size,
                                            new_computed_blocks)
        if new_blocks is None:
            host.unpin(hits)
            return None
        self._step_pins += hits
        self._loads_read_now = True
        cache = self.block_pool.cache_full_block
        for k, host_id in enumerate(hits):
            block_id = state.block_ids[first + k]
            self._loads.append((host_id, block_id))
            cache(block_id, state.block_hashes[first + k])  # loaded before any reader's forward
        state.num_cached_blocks = first + len(hits)
        num_hit_tokens = len(hits) * self.block_size
        self._host_hit_tokens += num_hit_tokens
        if self.enable_prefix_caching:
            self._prefix_cache_hits += num_hit_tokens
        self._release_swapped(request.request_id)
        return new_blocks

    def _release_swapped(self, request_id: str) -> None:
        """It has blocks again (or ended): its swap pins go, and it may be prefetched again."""
        self._prefetched.discard(request_id)
        swapped = self._swapped.pop(request_id, None)
        if swapped:
            self.host_pool.unpin(swapped)

    # ---- release ---------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        request_id = request.request_id
        self._host_hits.pop(request_id, None)
        self._release_swapped(request_id)
        super().free(request)

    def free_preempted(self, request: Request) -> None:
        """With swap_preemption, store the request's full computed blocks in the host tier
        (leading ones first, as far as unpinned host blocks last) and pin them for it."""
        state = self._requests.get(request.request_id)
        if not self.swap_preemption or state is None or not state.block_ids:
            super().free_preempted(request)
            return
        tokens, block_size = request.all_token_ids, self.block_size
        num_full = min(request.num_computed_tokens // block_size, len(state.block_ids))
        if PLACEHOLDER_TOKEN_ID in tokens[:num_full * block_size]:  # a token still in flight
            num_full = tokens.index(PLACEHOLDER_TOKEN_ID) // block_size
        if len(state.block_hashes) < num_full:
            self._hash_blocks(state, num_full)
        pins: list[int] = []
        for block_id, block_hash in zip(state.block_ids[:num_full], state.block_hashes):
            stored = self.host_pool.store(block_hash)
            if stored is None:
                break
            host_id, needs_copy = stored
            self._step_pins.append(host_id)
            self.host_pool.pin(host_id)
            pins.append(host_id)
            if needs_copy:
                self._offloads.append((block_id, host_id))
        super().free_preempted(request)  # (its hash chain kept)
        if pins:
            self._swapped[request.request_id] = pins

    def reset_prefix_cache(self) -> bool:
        """Both tiers forget everything (e.g. the workers and their host pools were replaced)."""
        if not super().reset_prefix_cache():
            return False
        self.host_pool.reset()
        self._offloads, self._loads, self._step_pins = [], [], []
        self._host_hits.clear()
        self._swapped.clear()
        self._prefetched.clear()
        self._loads_read_now = False
        return True

    # ---- cache events: both tiers' ---------------------------------------------------------------
    def record_cache_events(self) -> None:
        super().record_cache_events()
        self.host_pool.record_events()

    def take_cache_events(self) -> list[int]:
        """The GPU pool's events, then the host tier's (each tier's in order; the router keeps
        the tiers apart, so their relative order does not matter)."""
        events = super().take_cache_events()
        host = self.host_pool.take_events()
        return events + host if host else events

    # ---- the step's transfers --------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers | None:
        if self._step_pins:
            self.host_pool.unpin(self._step_pins)
            self._step_pins = []
        self._host_hits.clear()  # lookups of requests the step did not admit: looked up again
        if not self._offloads and not self._loads:
            return None
        transfers = KVTransfers(self._offloads, self._loads, loads_read_now=self._loads_read_now)
        self._offloads, self._loads, self._loads_read_now = [], [], False
        self._num_offloaded += len(transfers.offloads)
        self._num_loaded += len(transfers.loads)
        return transfers

    @property
    def num_swapped_requests(self) -> int:
        return len(self._swapped)

    @property
    def num_prefetches(self) -> int:
        """Admissions that waited one step for their host hits to load."""
        return self._num_prefetches

    def stats(self) -> KVCacheStats:
        return dataclasses.replace(
            super().stats(), host_cache_hits=self._host_hit_tokens,
            num_host_blocks=self.host_pool.num_blocks, num_host_free_blocks=self.host_pool.num_free_blocks,
            offloaded_bytes=self._num_offloaded * self.block_bytes,
            loaded_bytes=self._num_loaded * self.block_bytes)
