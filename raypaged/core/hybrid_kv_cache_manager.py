"""HybridKVCacheManager: one block table per KV-cache group per request, over one BlockPool whose
blocks any group can take (see kv_cache_groups for what a group and a block are).

Every group's table has the same length, cdiv(num_computed_tokens, B) after each step, so the
scheduler's slot accounting reads group 0's table (get_block_ids); the workers need every
group's (get_group_block_ids). A full group's table holds every block, as KVCacheManager's does.

Sliding window W. A query at p reads keys (p - W, p], so once a step starts at c, the blocks
wholly before c - W + 1 are never read again: allocate_slots drops them (after registering them
in the prefix cache) and the table keeps NULL_BLOCK_ID in their positions. A decode step thus
holds at most ceil((W - 1) / B) + 1 <= ceil(W / B) + 1 blocks per sliding group, a prefill chunk
of n tokens cdiv(W - 1 + n, B) + 1. Dropping is not a rewrite: the workers' stale ids sit where a
sliding layer never reads.

Prefix caching. Each group hashes its own chain, so two groups never claim one block: the
routed group (the first full-attention group, else group 0) hashes the plain chain, as
KVCacheManager does (its keys only the salt: core/block_hashing.py prefix_hash_values gives a
data-parallel router the same values), every other group's keys start with its index. The
pool's cache events report the routed group's blocks only: the router hashes one chain.

A full group hits on its leading cached blocks. A sliding group can resume at L blocks if the
blocks its window needs there, L*B - W + 1 .. L*B - 1, are cached (what fell out of the window
is NULL in the hit). The hit is the longest L that every group can serve (as vLLM's coordinator
does); a dropped sliding block stays findable until the pool evicts it, like any freed cached
block.

Fork shares every live block of every group; copy-on-write is per group (each group's partial
tail is its own block). Stats count each held block once, O(live blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO, block_hasher, request_extra_keys
from raypaged.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from raypaged.core.errors import UnknownRequestError
from raypaged.core.kv_cache_groups import KVCacheGroupSpec
from raypaged.core.kv_cache_interface import KVCacheStats, PagedKVCacheManagerBase
from raypaged.core.request import Request

NULL_BLOCK_ID = -1  # a table position whose block fell out of the window (never read)
_T = TypeVar("_T")


def is_routed_block(block_hash: BlockHash) -> bool:
    """A block of the routed group's chain: its keys carry no group index (only a salt, a str)."""
    keys = block_hash.extra_keys
    return not keys or type(keys[0]) is not int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _GroupTable:
    block_ids: list[int]
    hashes: list[BlockHash]
    num_cached: int = 0  # leading positions registered in the prefix cache (or hit)
    num_dropped: int = 0  # leading positions that are NULL_BLOCK_ID
    shared_tail: bool = False  # its partial last block was shared by a fork


@dataclass(slots=True)
class _HybridRequest:
    request: Request
    groups: list[_GroupTable]
    pending_hits: list[list[int]] | None = None  # get_computed_blocks' answer, per group


class HybridKVCacheManager(PagedKVCacheManagerBase):
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroupSpec],
                 enable_prefix_caching: bool = True, max_tokens_per_step: int | None = None,
                 hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.groups = tuple(groups)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_tokens_per_step = max_tokens_per_step
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
                                    reports=is_routed_block)
        # The group whose chain is the plain one (see the module docstring).
        self.routed_group = next((g for g, spec in enumerate(self.groups) if not spec.is_sliding), 0)
        self._requests: dict[str, _HybridRequest] = {}
        self._copies: list[tuple[int, int]] = []
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self.rewritten_req_ids: set[str] = set()
        self._hasher = block_hasher(hash_algo)

    def _state(self, request: Request) -> _HybridRequest:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _HybridRequest(
                request, [_GroupTable([], []) for _ in self.groups])
        state.request = request
        return state

    def _first_needed(self, g: int, num_computed: int) -> int:
        """Group g's first block a step starting at num_computed still reads."""
        window = self.groups[g].sliding_window
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    # ---- prefix cache ----------------------------------------------------------------------------
    def _hashes(self, state: _HybridRequest, g: int, num_blocks: int) -> list[BlockHash]:
        hashes, B = state.groups[g].hashes, self.block_size
        tokens, salt = state.request.all_token_ids, state.request.cache_salt
        keys: tuple[Hashable, ...] | None
        if g == self.routed_group:
            keys = request_extra_keys(salt)
        else:
            keys = (g, salt) if salt else (g,)
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * B, num_blocks * B, B):
            parent = hash_block_tokens(parent, tuple(tokens[start:start + B]), keys, self._hasher)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest prefix of whole blocks every group can serve (see the module docstring),
        never the whole request. Returns group 0's hit table (NULL_BLOCK_ID where a sliding
        group needs nothing); the other groups' hits wait in the request's state for
        allocate_slots. Takes no reference."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit = (len(request.all_token_ids) - 1) // self.block_size
        if max_hit <= 0:
            return [], 0
        state = self._state(request)
        limit, found = self._longest_hit(state, max_hit, self.block_pool.get_cached_block)
        hits = []
        for g in range(len(self.groups)):
            start = self._first_needed(g, limit * self.block_size)
            hits.append([NULL_BLOCK_ID] * start + [b for b in found[g][start:limit] if b is not None])
        state.pending_hits = hits
        return list(hits[0]), limit * self.block_size

    def _longest_hit(self, state: _HybridRequest, max_hit: int, find: Callable[[BlockHash], _T | None]
                     ) -> tuple[int, list[list[_T | None]]]:
        """The most leading blocks L <= max_hit every group can serve, where find(hash) is where a
        block is cached (None: nowhere): a full group needs positions 0 .. L-1 found, a sliding
        group those its window reads at L. Returns L and, per group, what find answered for
        (at least) the positions L needs, from 0."""
        found: list[list[_T | None]] = [[] for _ in self.groups]
        limit = max_hit
        for g, spec in enumerate(self.groups):  # full groups first: their hits bound the rest
            if not spec.is_sliding:
                for h in self._hashes(state, g, max_hit)[:limit]:
                    where = find(h)
                    if where is None:
                        break
                    found[g].append(where)
                limit = len(found[g])
        for g, spec in enumerate(self.groups):
            if spec.is_sliding:
                found[g] = [find(h) for h in self._hashes(state, g, limit)[:limit]]
        changed = True
        while changed:  # shrink to an L every sliding group can serve at once
            changed = False
            for g, spec in enumerate(self.groups):
                while spec.is_sliding and limit > 0 and any(
                        b is None for b in found[g][self._first_needed(g, limit * self.block_size):limit]):
                    limit -= 1
                    changed = True
        return limit, found

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            raise UnknownRequestError(f"request {request.request_id!r} holds no blocks")
        num_full = num_computed_tokens // self.block_size
        if not 0 <= num_computed_tokens <= len(state.groups[0].block_ids) * self.block_size:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} computed tokens "
                             "do not fit its blocks")
        if not self.enable_prefix_caching:
            return
        for g, table in enumerate(state.groups):
            if num_full <= table.num_cached:
                continue
            hashes = self._hashes(state, g, num_full)
            for index in range(table.num_cached, num_full):
                if table.block_ids[index] != NULL_BLOCK_ID:
                    self.block_pool.cache_full_block(table.block_ids[index], hashes[index])
            table.num_cached = num_full

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """As KVCacheManagerInterface, for every group: returns group 0's appended entries (on
        the first allocation its whole table); get_group_block_ids has every group's."""
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        state = self._requests.get(request.request_id)
        if state is None or not state.groups[0].block_ids:
            return self._allocate_first(request, num_new_tokens, new_computed_blocks or [])
        if new_computed_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks: prefix hits "
                             "are taken only on its first allocation")
        return self._grow(request, state, num_new_tokens)

    def _allocate_first(self, request: Request, num_new_tokens: int, hits: list[int]) -> list[int] | None:
        B = self.block_size
        if request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} has computed tokens but no blocks")
        state = self._requests.get(request.request_id)
        group_hits = self._check_hits(request, state, hits)
        num_hit_tokens = len(hits) * B
        if num_hit_tokens + num_new_tokens > len(request.all_token_ids):
            raise ValueError(f"request {request.request_id!r}: asked for slots past its last token")
        num_new = _cdiv(num_hit_tokens + num_new_tokens, B) - len(hits)
        ref_cnt = self.block_pool.ref_cnt
        revived = sum(1 for blocks in group_hits for b in blocks if b >= 0 and ref_cnt[b] == 0)
        loads = self._host_loads(request, hits)
        if num_new * len(self.groups) + revived + len(loads) > self.block_pool.num_free_blocks:
            return None
        state = self._state(request)
        for blocks in group_hits:  # the hits first: fresh blocks may otherwise evict them
            self.block_pool.touch(b for b in blocks if b >= 0)
        if loads:
            self._load_host_hits(state, group_hits, loads)
        for g, table in enumerate(state.groups):
            table.block_ids = group_hits[g] + self.block_pool.get_new_blocks(num_new)
            table.num_cached = len(hits)
            table.num_dropped = self._first_needed(g, num_hit_tokens) if hits else 0
            table.shared_tail = False
        state.pending_hits = None
        if self.enable_prefix_caching:
            self._prefix_cache_queries += len(request.all_token_ids)
            self._prefix_cache_hits += num_hit_tokens
        return list(state.groups[0].block_ids)

    def _host_loads(self, request: Request, hits: list[int]) -> list[tuple[int, int, int]]:
        """Hook of a manager with a host tier: the (group, position, host block) hits of the
        request's lookup `hits` that are on the host, each needing a fresh GPU block (here none)."""
        return []

    def _load_host_hits(self, state: _HybridRequest, group_hits: list[list[int]],
                        loads: list[tuple[int, int, int]]) -> None:
        """Hook of a manager with a host tier: fill group_hits' host positions with fresh GPU
        blocks and queue their loads (never called without _host_loads' answer)."""
        raise NotImplementedError

    def _check_hits(self, request: Request, state: _HybridRequest | None,
                    hits: list[int]) -> list[list[int]]:
        """Every group's hits for group 0's hits `hits`, which must be get_computed_blocks'
        latest answer, still cached."""
        if not hits:
            return [[] for _ in self.groups]
        pending = state.pending_hits if state is not None else None
        if pending is None or pending[0] != hits:  # (never set without a prefix cache or host tier)
            raise ValueError(f"request {request.request_id!r}: prefix hits must come from "
                             "get_computed_blocks")
        block_hash = self.block_pool.block_hash
        for g, blocks in enumerate(pending):
            hashes = state.groups[g].hashes if state is not None else []
            for i, block_id in enumerate(blocks):
                if block_id >= 0 and block_hash[block_id] != hashes[i]:
                    raise ValueError(f"request {request.request_id!r}: block {block_id} no longer "
                                     f"caches group {g}'s block {i} (evicted since get_computed_blocks?)")
        return [list(blocks) for blocks in pending]

    def _grow(self, request: Request, state: _HybridRequest, num_new_tokens: int) -> list[int] | None:
        B, pool = self.block_size, self.block_pool
        num_computed = request.num_computed_tokens
        length = len(state.groups[0].block_ids)
        total = num_computed + num_new_tokens
        if num_computed > length * B or total > len(request.all_token_ids):
            raise ValueError(f"request {request.request_id!r}: {num_computed} computed + "
                             f"{num_new_tokens} new tokens do not match its {length} blocks and "
                             f"{len(request.all_token_ids)} tokens")
        write_index = num_computed // B
        num_new = max(0, _cdiv(total, B) - length)
        cows = [table.shared_tail and num_new_tokens > 0 and num_computed % B != 0
                and pool.ref_cnt[table.block_ids[write_index]] > 1 for table in state.groups]
        # Blocks out of every window come back first, so this very step may reuse them.
        drops = [[b for b in table.block_ids[table.num_dropped:self._first_needed(g, num_computed)]
                  if pool.ref_cnt[b] == 1] for g, table in enumerate(state.groups)]
        if num_new * len(self.groups) + sum(cows) > pool.num_free_blocks + sum(map(len, drops)):
            return None
        if self.enable_prefix_caching:
            self.cache_blocks(request, write_index * B)  # before a dropped block's hash is lost
        for g, table in enumerate(state.groups):
            first = self._first_needed(g, num_computed)
            if first > table.num_dropped:
                pool.free_blocks(reversed(table.block_ids[table.num_dropped:first]))
                table.block_ids[table.num_dropped:first] = [NULL_BLOCK_ID] * (first - table.num_dropped)
                table.num_dropped = first
        for g, table in enumerate(state.groups):
            if cows[g]:
                shared = table.block_ids[write_index]
                table.block_ids[write_index] = pool.get_new_blocks(1)[0]
                pool.free_blocks((shared,))  # others still hold it
                self._copies.append((shared, table.block_ids[write_index]))
                self.rewritten_req_ids.add(request.request_id)
            if num_new_tokens:
                table.shared_tail = False
            table.block_ids.extend(pool.get_new_blocks(num_new))
        return state.groups[0].block_ids[length:]

    # ---- release and sharing ---------------------------------------------------------------------
    def free(self, request: Request) -> None:
        state = self._requests.pop(request.request_id, None)
        self.rewritten_req_ids.discard(request.request_id)
        if state is None:
            return
        dropped: set[int] = set()
        for table in reversed(state.groups):
            live = [b for b in table.block_ids if b != NULL_BLOCK_ID]
            self.block_pool.free_blocks(reversed(live))  # tail first: evicted before the prefix
            dropped.update(live)
        if self._copies:  # a copy into a block it no longer holds would race with its next owner
            self._copies = [c for c in self._copies if c[1] not in dropped]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every live block of every group of the parent, between steps."""
        state = self._requests.get(parent.request_id)
        if state is None or not state.groups[0].block_ids:
            raise UnknownRequestError(f"fork: parent {parent.request_id!r} holds no blocks")
        num_computed = parent.num_computed_tokens
        child_state = self._requests.get(child.request_id)
        if child.request_id == parent.request_id or (child_state is not None
                                                     and child_state.groups[0].block_ids):
            raise ValueError(f"fork: child {child.request_id!r} already holds blocks")
        if child.num_computed_tokens != num_computed:
            raise ValueError(f"fork: child has {child.num_computed_tokens} computed tokens, "
                             f"parent {num_computed}")
        if len(state.groups[0].block_ids) != _cdiv(num_computed, self.block_size):
            raise ValueError(f"fork: parent {parent.request_id!r} has slots allocated past its "
                             "computed tokens (fork only between steps)")
        shared_tail = num_computed % self.block_size != 0
        tables = []
        for table in state.groups:
            self.block_pool.touch(b for b in table.block_ids if b != NULL_BLOCK_ID)
            tables.append(_GroupTable(list(table.block_ids), list(table.hashes), table.num_cached,
                                      table.num_dropped, shared_tail))
            table.shared_tail = table.shared_tail or shared_tail
        self._requests[child.request_id] = _HybridRequest(child, tables)

    # ---- queries ---------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (NULL_BLOCK_ID where a sliding group 0 dropped a block)."""
        state = self._requests.get(request_id)
        return list(state.groups[0].block_ids) if state is not None else []

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def get_group_block_ids(self, request_id: str, last: int | None = None) -> list[list[int]]:
        """Every group's table, in group order ([] per group if it holds none); only the last
        `last` entries of each if given (what a step appended: every table grows alike)."""
        state = self._requests.get(request_id)
        if state is None:
            return [[] for _ in self.groups]
        if last is None:
            return [list(table.block_ids) for table in state.groups]
        return [table.block_ids[len(table.block_ids) - last:] for table in state.groups]

    def can_fit(self, num_tokens: int) -> bool:
        step = self.max_tokens_per_step or num_tokens
        return sum(g.max_live_blocks(self.block_size, num_tokens, step)
                   for g in self.groups) <= self.num_blocks

    def stats(self) -> KVCacheStats:
        """Slots are (token, group) positions: a block holds B tokens of one group. logical
        counts each request's filled live slots; filled counts each held block's once."""
        B = self.block_size
        fills: dict[int, int] = {}
        group_blocks = [0] * len(self.groups)
        logical = 0
        for state in self._requests.values():
            computed = state.request.num_computed_tokens
            for g, table in enumerate(state.groups):
                for index in range(table.num_dropped, len(table.block_ids)):
                    block_id = table.block_ids[index]
                    fill = min(B, max(0, computed - index * B))
                    logical += fill
                    if block_id not in fills:
                        group_blocks[g] += 1
                    fills[block_id] = max(fill, fills.get(block_id, 0))
        filled = sum(fills.values())
        num_free = self.block_pool.num_free_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=num_free, block_size=B,
            allocated_slots=(self.num_blocks - num_free) * B, filled_slots=filled,
            logical_slots=logical, shared_saved_slots=logical - filled,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits, group_blocks=tuple(group_blocks),
            group_windows=tuple(g.sliding_window for g in self.groups))
