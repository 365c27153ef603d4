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
the workers apply offloads, then loads, then the step's copy-on-write and forward. The copies,
pins and counters are core/host_tier.py's HostTier, shared with TieredHybridKVCacheManager.
"""

from __future__ import annotations

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO
from raypaged.core.host_tier import HostTier, HostTierManager, OffloadingBlockPool
from raypaged.core.kv_cache_manager import KVCacheManager, _RequestBlocks
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request

__all__ = ["TieredKVCacheManager"]


class TieredKVCacheManager(HostTierManager, KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 num_host_blocks: int, swap_preemption: bool = False, block_bytes: int = 0,
                 hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """block_bytes: the bytes one block holds over every rank (what a transfer moves)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_algo)
        self.tier = HostTier(num_host_blocks, block_bytes)
        self.block_pool = OffloadingBlockPool(num_blocks, enable_prefix_caching, self._reusing)
        self._ref_cnt = self.block_pool.ref_cnt
        self.swap_preemption = swap_preemption
        # Request -> the host blocks its last lookup found after its GPU hits (for allocate_slots).
        self._host_hits: dict[str, list[int]] = {}

    def _reusing(self, block_ids: list[int]) -> None:
        self.tier.evicting(block_ids, self.block_pool.block_hash)

    # ---- prefix lookup over both tiers -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """GPU hits, then host hits after them: the tokens counted include both; the blocks
        returned are the GPU ones (allocate_slots adds the host hits' blocks)."""
        blocks, num_tokens = super().get_computed_blocks(request)
        request_id = request.request_id
        self._host_hits.pop(request_id, None)
        swapped = self.tier.swapped.get(request_id)
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
        tier = self.tier
        if not self.enable_prefix_caching or request.prompt_logprobs_pending or request_id in tier.prefetched:
            return True
        tier.prefetched.add(request_id)
        gpu_hits, _ = KVCacheManager.get_computed_blocks(self, request)
        hits = self._host_lookup(request, len(gpu_hits), None)
        pool = self.block_pool
        pool.touch(gpu_hits)  # not to be evicted for the loads' blocks
        if not hits or len(hits) > pool.num_free_blocks:
            pool.free_blocks(reversed(gpu_hits))
            return True
        tier.pin_for_step(hits)
        blocks = pool.get_new_blocks(len(hits))
        hashes = self._requests[request_id].block_hashes[len(gpu_hits):]
        for host_id, block_id, block_hash in zip(hits, blocks, hashes):
            if pool.cache_full_block(block_id, block_hash):
                tier.load(host_id, block_id, read_now=False)
                tier.host_hit_tokens += self.block_size
        pool.free_blocks(reversed(gpu_hits + blocks))  # its tail first: the prefix is evicted last
        tier.num_prefetches += 1
        return False

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """As KVCacheManager's; on a first allocation after a lookup with host hits, num_new_tokens
        counts from the end of the hits (as the scheduler computes it from the lookup's tokens),
        and the hits get fresh GPU blocks with their loads queued."""
        hits = self._host_hits.pop(request.request_id, None) if self._host_hits else None
        if not hits:
            new_blocks = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
            if new_blocks is not None and (self.tier.swapped or self.tier.prefetched):
                self.tier.release(request.request_id)  # resumed from the GPU tier alone
            return new_blocks
        state = self._requests[request.request_id]
        first = len(new_computed_blocks or ())
        tier, host = self.tier, self.host_pool
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
        tier.step_pins += hits
        cache = self.block_pool.cache_full_block
        for k, host_id in enumerate(hits):
            block_id = state.block_ids[first + k]
            tier.load(host_id, block_id, read_now=True)
            cache(block_id, state.block_hashes[first + k])  # loaded before any reader's forward
        state.num_cached_blocks = first + len(hits)
        num_hit_tokens = len(hits) * self.block_size
        tier.host_hit_tokens += num_hit_tokens
        if self.enable_prefix_caching:
            self._prefix_cache_hits += num_hit_tokens
        tier.release(request.request_id)
        return new_blocks

    # ---- release ---------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        request_id = request.request_id
        self._host_hits.pop(request_id, None)
        self.tier.release(request_id)
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
            host_id = self.tier.swap_out(block_id, block_hash)
            if host_id is None:
                break
            pins.append(host_id)
        super().free_preempted(request)  # (its hash chain kept)
        if pins:
            self.tier.swapped[request.request_id] = pins
