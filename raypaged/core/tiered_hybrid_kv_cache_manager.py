"""TieredHybridKVCacheManager: the HybridKVCacheManager (one table per KV-cache group over one
pool) with the host tier of TieredKVCacheManager behind its GPU pool.

What the tier holds. A host block is the size of a GPU block and, like it, holds one group's
layers; groups hash their own chains, so a host block caches one group's block and the one
HostBlockPool serves every group. Any cached GPU block the pool evicts is offloaded first,
whichever its group: a full group's, and a sliding group's block that fell out of its window
(HybridKVCacheManager registers those before dropping them, so they stay findable until evicted:
here evicted means moved to the host, then evicted from the host in turn).

Prefix hits over both tiers. The hit is what HybridKVCacheManager decides, with a block found in
either tier: the longest L whose blocks every full group finds at positions 0 .. L-1 and every
sliding group finds for the window its queries read at L (L*B - W + 1 .. L*B - 1; what lies
before is NULL_BLOCK_ID in the hit, neither loaded nor kept). Each (group, position) comes from
the GPU when the GPU pool caches it, else from the host: so a position may be a GPU hit in one
group and a host hit in another. allocate_slots gives each host hit a fresh GPU block,
registered in the GPU prefix cache under the hit's hash, and queues its load (read by this
step's forward). Prefetch (may_admit) is TieredKVCacheManager's: the first time a request heads
the waiting queue with host hits, they are loaded into cached free GPU blocks and the request
waits that step. host_cache_hits counts the hit's tokens of the positions some group loaded.

Swap preemption. free_preempted stores the blocks the request needs to resume at L, L the most
full computed blocks (none reaching a token in flight) for which every group still holds what
it reads: a full group its blocks 0 .. L-1, a sliding group the window's blocks before L*B.
They go to the host position by position (every group's block of a position, then the next),
pinned for it, until the host has no unpinned block left. A sliding group may already have
dropped a block its window at L needs: its last step began at c in block L, past L*B, and
c - W + 1 crossed a block boundary that L*B - W + 1 had not (possible unless W - 1 is a multiple
of B; e.g. W = 4, B = 2, c = 9: positions 4, 5 dropped, resuming at 8 reads 5). No smaller L is
served either (an earlier L reads earlier blocks), so nothing is swapped and the request
recomputes, as under recompute preemption; with prefix caching on, its lookup may still find the
dropped blocks in either tier. On resumption its lookup finds its
blocks (with prefix caching off: only its own) and they are loaded back.

The copies, pins and counters are core/host_tier.py's HostTier, as TieredKVCacheManager's.
"""

from __future__ import annotations

from collections.abc import Sequence

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO
from raypaged.core.block_pool import BlockHash
from raypaged.core.host_tier import HostTier, HostTierManager, OffloadingBlockPool
from raypaged.core.hybrid_kv_cache_manager import (
    NULL_BLOCK_ID,
    HybridKVCacheManager,
    _GroupTable,
    _HybridRequest,
    is_routed_block,
)
from raypaged.core.kv_cache_groups import KVCacheGroupSpec
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request

__all__ = ["TieredHybridKVCacheManager"]

_Where = tuple[int, bool]  # (block id, on the host)
_HostHit = tuple[int, int, int]  # (group, position, host block)


class TieredHybridKVCacheManager(HostTierManager, HybridKVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroupSpec],
                 enable_prefix_caching: bool = True, max_tokens_per_step: int | None = None, *,
                 num_host_blocks: int, swap_preemption: bool = False, block_bytes: int = 0,
                 hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """block_bytes: the bytes one block holds over every rank (what a transfer moves)."""
        super().__init__(num_blocks, block_size, groups, enable_prefix_caching,
                         max_tokens_per_step, hash_algo)
        # Both tiers report the routed group's blocks only: the chain a router hashes.
        self.tier = HostTier(num_host_blocks, block_bytes, reports=is_routed_block)
        self.block_pool = OffloadingBlockPool(num_blocks, enable_prefix_caching, self._reusing,
                                              reports=is_routed_block)
        self.swap_preemption = swap_preemption
        # Request -> the host hits of its last lookup (for its first allocation, this step).
        self._host_hits: dict[str, list[_HostHit]] = {}

    def _reusing(self, block_ids: list[int]) -> None:
        self.tier.evicting(block_ids, self.block_pool.block_hash)

    # ---- prefix lookup over both tiers -----------------------------------------------------------
    def _lookup(self, request: Request, own: set[int] | None) -> tuple[int, list[list[int]], list[_HostHit]]:
        """The hit over both tiers (see the module docstring; with `own`, host blocks among those
        only): its length L in blocks, every group's hit table (GPU blocks; NULL_BLOCK_ID where
        a sliding group needs nothing and where the host serves), and the host hits."""
        max_hit = (len(request.all_token_ids) - 1) // self.block_size
        if max_hit <= 0:
            return 0, [[] for _ in self.groups], []
        state = self._state(request)
        gpu = self.block_pool.get_cached_block
        host = self.host_pool.get_cached_block

        def find(block_hash: BlockHash) -> _Where | None:
            block_id = gpu(block_hash)
            if block_id is not None:
                return block_id, False
            host_id = host(block_hash)
            if host_id is None or (own is not None and host_id not in own):
                return None
            return host_id, True

        limit, found = self._longest_hit(state, max_hit, find)
        tables: list[list[int]] = []
        host_hits: list[_HostHit] = []
        for g in range(len(self.groups)):
            start = self._first_needed(g, limit * self.block_size)
            table = [NULL_BLOCK_ID] * start
            for i in range(start, limit):
                where = found[g][i]
                assert where is not None
                if where[1]:
                    host_hits.append((g, i, where[0]))
                table.append(NULL_BLOCK_ID if where[1] else where[0])
            tables.append(table)
        return limit, tables, host_hits

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """As HybridKVCacheManager's, over both tiers: group 0's hit table holds NULL_BLOCK_ID
        at the positions the host serves too (allocate_slots gives them GPU blocks)."""
        request_id = request.request_id
        self._host_hits.pop(request_id, None)
        swapped = self.tier.swapped.get(request_id)
        if not self.enable_prefix_caching and not swapped:
            return [], 0
        # Without prefix caching nothing is shared: only the request's own swapped blocks count.
        limit, tables, host_hits = self._lookup(request, None if self.enable_prefix_caching
                                                else set(swapped or ()))
        if not host_hits and not self.enable_prefix_caching:
            return [], 0
        self._state(request).pending_hits = tables
        if host_hits:
            self._host_hits[request_id] = host_hits
        return list(tables[0]), limit * self.block_size

    def may_admit(self, request: Request) -> bool:
        """Prefetch, as TieredKVCacheManager's: the first time the request heads the waiting
        queue with host hits, they are loaded into fresh GPU blocks, registered in the GPU prefix
        cache and freed at once (cached), and the answer is no; it never waits twice. Prefix
        caching on only (the loaded blocks must be found again)."""
        request_id, tier = request.request_id, self.tier
        if not self.enable_prefix_caching or request.prompt_logprobs_pending or request_id in tier.prefetched:
            return True
        tier.prefetched.add(request_id)
        _, tables, host_hits = self._lookup(request, None)
        pool = self.block_pool
        gpu_hits = [(i, b) for table in tables for i, b in enumerate(table) if b != NULL_BLOCK_ID]
        pool.touch(b for _, b in gpu_hits)  # not to be evicted for the loads' blocks
        if not host_hits or len(host_hits) > pool.num_free_blocks:
            pool.free_blocks(b for _, b in gpu_hits)
            return True
        tier.pin_for_step(host_id for _, _, host_id in host_hits)
        blocks = pool.get_new_blocks(len(host_hits))
        groups = self._requests[request_id].groups
        loaded: set[int] = set()
        for (g, i, host_id), block_id in zip(host_hits, blocks):
            if pool.cache_full_block(block_id, groups[g].hashes[i]):
                tier.load(host_id, block_id, read_now=False)
                loaded.add(i)
        tier.host_hit_tokens += len(loaded) * self.block_size
        held = gpu_hits + [(i, b) for (_, i, _), b in zip(host_hits, blocks)]
        pool.free_blocks(b for _, b in sorted(held, reverse=True))  # tail first: evicted first
        tier.num_prefetches += 1
        return False

    # ---- allocation: the hooks of the first allocation -------------------------------------------
    def _host_loads(self, request: Request, hits: list[int]) -> list[_HostHit]:
        """The host hits of the lookup `hits` came from, still cached on the host."""
        host_hits = self._host_hits.pop(request.request_id, None) if self._host_hits else None
        if not hits or not host_hits:
            return []
        groups, host = self._requests[request.request_id].groups, self.host_pool
        for g, i, host_id in host_hits:
            if host.block_hash[host_id] != groups[g].hashes[i]:
                raise ValueError(f"request {request.request_id!r}: host block {host_id} no longer "
                                 f"caches group {g}'s block {i} (evicted since get_computed_blocks?)")
        return host_hits

    def _load_host_hits(self, state: _HybridRequest, group_hits: list[list[int]],
                        loads: list[_HostHit]) -> None:
        tier, pool = self.tier, self.block_pool
        tier.pin_for_step(host_id for _, _, host_id in loads)  # our own evictions must not take them
        blocks = pool.get_new_blocks(len(loads))
        for (g, i, host_id), block_id in zip(loads, blocks):
            group_hits[g][i] = block_id
            tier.load(host_id, block_id, read_now=True)
            # Found on the GPU from now on: loaded before any reader's forward.
            pool.cache_full_block(block_id, state.groups[g].hashes[i])
        tier.host_hit_tokens += len({i for _, i, _ in loads}) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """As HybridKVCacheManager's; a first allocation after a lookup with host hits loads
        them. Once the request holds blocks again, its swap pins go."""
        new_blocks = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        if new_blocks is not None and (self.tier.swapped or self.tier.prefetched):
            self.tier.release(request.request_id)
        return new_blocks

    # ---- release ---------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        self._host_hits.pop(request.request_id, None)
        self.tier.release(request.request_id)
        super().free(request)

    def free_preempted(self, request: Request) -> None:
        """Free the request's blocks, keeping its hash chains (its tokens up to any in flight)
        for its resumption; with swap_preemption, first swap out what it resumes from (see the
        module docstring)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        B, tokens = self.block_size, request.all_token_ids
        num_full = min(request.num_computed_tokens // B, len(state.groups[0].block_ids))
        if PLACEHOLDER_TOKEN_ID in tokens[:num_full * B]:  # a token still in flight
            num_full = tokens.index(PLACEHOLDER_TOKEN_ID) // B
        pins = self._swap_out(state, num_full) if self.swap_preemption and num_full else []
        self.free(request)
        if self.enable_prefix_caching or pins:
            self._requests[request.request_id] = _HybridRequest(
                request, [_GroupTable([], table.hashes[:num_full]) for table in state.groups])
        if pins:
            self.tier.swapped[request.request_id] = pins

    def _swap_out(self, state: _HybridRequest, num_full: int) -> list[int]:
        """Store the blocks the request resumes from in the host tier, pinned: their host blocks."""
        B = self.block_size
        resume = num_full
        while resume and any(self._first_needed(g, resume * B) < table.num_dropped
                             for g, table in enumerate(state.groups)):
            resume -= 1
        firsts = [self._first_needed(g, resume * B) for g in range(len(self.groups))]
        hashes = [self._hashes(state, g, resume) for g in range(len(self.groups))]
        pins: list[int] = []
        for i in range(resume):
            for g, table in enumerate(state.groups):
                if i < firsts[g]:
                    continue
                host_id = self.tier.swap_out(table.block_ids[i], hashes[g][i])
                if host_id is None:
                    return pins
                pins.append(host_id)
        return pins
