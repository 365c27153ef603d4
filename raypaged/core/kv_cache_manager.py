"""KVCacheManager: per-request block tables over one BlockPool, the prefix cache, fork and
copy-on-write, and exact accounting of what the pool's slots hold.

A request's block table maps logical block i (tokens i*B .. i*B+B-1) to a physical block id.
Blocks are allocated on demand as the scheduler asks for slots for the tokens a step computes,
so a request holds cdiv(num_computed_tokens, B) blocks after each step: the only waste is the
unused tail of its last block.

Sharing. Two requests hold the same block in two ways only:
  * prefix caching: a new request takes the cached FULL blocks that hold its prompt's leading
    tokens (same tokens, same salt, same whole prefix before them);
  * fork (parallel sampling, n > 1): the samples share all of the parent's blocks.
Full blocks are never written again, so sharing them is free. A fork may also share the parent's
PARTIAL last block; the first sample to write into it while others still hold it gets a fresh
copy (copy-on-write: the (src, dst) pair is queued for the workers, see take_block_copies) and
the last one left writes in place. Nobody ever writes into a shared block, so every holder of a
block sees the same number of filled slots in it — which keeps the accounting exact and cheap.

Progress. How far a request has computed is request.num_computed_tokens (the scheduler advances
it after each step); the manager reads it and keeps no per-step state, so a decode step costs it
nothing unless a block fills. cache_blocks() puts blocks that became full into the prefix cache
(the scheduler calls it when a step completes a block; allocate_slots also does it lazily).

Accounting. Since all holders of a block see the same fill, filled slots = logical slots (the sum
of computed tokens over requests) - saved slots, where saved = sum over blocks of
fill * (holders - 1) changes only when a block gains or loses a holder: at a prefix hit, a fork,
a free and a copy-on-write. So nothing is counted per step; stats() sums computed tokens once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO, block_hasher, request_extra_keys
from raypaged.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from raypaged.core.errors import UnknownRequestError
from raypaged.core.kv_cache_interface import KVCacheStats, PagedKVCacheManagerBase
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request

__all__ = ["KVCacheManager", "KVCacheStats", "cdiv"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _RequestBlocks:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    # Hashes of the request's full blocks, leading ones first; extended lazily and kept so a
    # waiting request's repeated prefix lookups and the later registration hash each block once.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already in the prefix cache (registered or hit)
    # Its block at index num_computed // B is partial and was shared by a fork: check for
    # copy-on-write on its next write.
    shared_tail: bool = False
    # Hashed into every block with its tokens (block_hashing.request_extra_keys).
    extra_keys: tuple[str, ...] | None = field(init=False)

    def __post_init__(self) -> None:
        self.extra_keys = request_extra_keys(self.request.cache_salt)


class KVCacheManager(PagedKVCacheManagerBase):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """hash_algo: the prefix-cache chain (core/block_hashing.py): sha256 is the same in every
        process, builtin only within this one."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self._hasher = block_hasher(hash_algo)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._ref_cnt = self.block_pool.ref_cnt
        self._requests: dict[str, _RequestBlocks] = {}
        self._num_saved_slots = 0  # sum over blocks of fill * (holders - 1)
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._copies: list[tuple[int, int]] = []
        # Requests whose table changed other than by appending (copy-on-write replaced a block)
        # since pop_rewritten last answered for them: the workers must get their whole table again.
        self.rewritten_req_ids: set[str] = set()

    # ---- prefix cache ----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached full blocks holding the request's leading tokens, and how many tokens they
        hold. Never the whole request: its last token is always left to compute (its logits give
        the next token). Takes no reference: pass the blocks to allocate_slots right away."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (len(request.all_token_ids) - 1) // self.block_size
        if max_hit_blocks <= 0:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks(request)
        hashes = state.block_hashes
        lookup = self.block_pool.get_cached_block
        blocks: list[int] = []
        for i in range(max_hit_blocks):
            if i == len(hashes):
                self._hash_blocks(state, i + 1)
            block_id = lookup(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Put the request's blocks that its first num_computed_tokens tokens fill into the
        prefix cache (idempotent; a no-op with prefix caching off)."""
        state = self._requests.get(request.request_id)
        if state is None:
            raise UnknownRequestError(f"request {request.request_id!r} holds no blocks")
        table = state.block_ids
        if not 0 <= num_computed_tokens <= len(table) * self.block_size:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} computed tokens "
                             f"do not fit its {len(table)} blocks")
        num_full = num_computed_tokens // self.block_size
        if num_full <= state.num_cached_blocks or not self.enable_prefix_caching:
            return
        hashes = state.block_hashes
        if num_full == len(hashes) + 1 == state.num_cached_blocks + 1:
            # The one block a decode step just filled (the scheduler's call, every step for some
            # request): hashed and registered inline.
            block_size = self.block_size
            token_ids = tuple(request.all_token_ids[num_full * block_size - block_size:num_full * block_size])
            if len(token_ids) != block_size:
                raise ValueError(f"request {request.request_id!r}: block {num_full - 1} is not full")
            block_hash = hash_block_tokens(hashes[-1] if hashes else None, token_ids, state.extra_keys,
                                           self._hasher)
            hashes.append(block_hash)
            self.block_pool.cache_full_block(table[num_full - 1], block_hash)
            state.num_cached_blocks = num_full
            return
        if len(hashes) < num_full:
            self._hash_blocks(state, num_full)
        cache = self.block_pool.cache_full_block
        for index in range(state.num_cached_blocks, num_full):
            cache(table[index], hashes[index])
        state.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for the request's next num_new_tokens tokens, after its
        request.num_computed_tokens computed ones and, on its first allocation, after the
        prefix-hit blocks new_computed_blocks (from get_computed_blocks; the caller then adds
        their tokens to request.num_computed_tokens).

        Returns the block ids appended to the request's table (on the first allocation: the
        whole table, prefix hits first), or None when the pool cannot supply them now — and then
        nothing has changed. If its first new token lands in a partial block it shares (after a
        fork), that block is replaced by a private copy: see pop_rewritten and
        take_block_copies.
        """
        state = self._requests.get(request.request_id)
        # The common decode step: the last block still has room. Reads only, changes nothing.
        if state is not None and state.block_ids and not new_computed_blocks and not state.shared_tail \
                and 0 <= num_new_tokens \
                and request.num_computed_tokens + num_new_tokens <= len(state.block_ids) * self.block_size:
            return []
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        if state is None or not state.block_ids:
            return self._allocate_first(request, num_new_tokens, new_computed_blocks or [], state)
        if new_computed_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks: prefix hits "
                             "are taken only on its first allocation")
        return self._grow(request, state, num_new_tokens)

    def _allocate_first(self, request: Request, num_new_tokens: int, hits: list[int],
                        state: _RequestBlocks | None) -> list[int] | None:
        block_size = self.block_size
        if request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} has computed tokens but no blocks")
        if hits:
            self._check_hits(request, hits, state)
        num_hit_tokens = len(hits) * block_size
        if num_hit_tokens + num_new_tokens > len(request.all_token_ids):
            raise ValueError(f"request {request.request_id!r}: asked for slots past its last token")
        num_new_blocks = cdiv(num_hit_tokens + num_new_tokens, block_size) - len(hits)
        ref_cnt = self._ref_cnt
        num_revived = sum(1 for b in hits if ref_cnt[b] == 0)  # hits still in the free queue
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None
        # Take the hits first: fresh blocks may otherwise be found by evicting them. A hit on a
        # block others hold saves its slots once more.
        self._num_saved_slots += block_size * (len(hits) - num_revived)
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks(request)
        state.request = request
        state.block_ids = hits + new_blocks
        state.num_cached_blocks = len(hits)
        if self.enable_prefix_caching:
            self._prefix_cache_queries += len(request.all_token_ids)
            self._prefix_cache_hits += num_hit_tokens
        return list(state.block_ids)

    def _grow(self, request: Request, state: _RequestBlocks, num_new_tokens: int) -> list[int] | None:
        block_size = self.block_size
        table = state.block_ids
        num_computed = request.num_computed_tokens
        total = num_computed + num_new_tokens
        if num_computed > len(table) * block_size or total > len(request.all_token_ids):
            raise ValueError(f"request {request.request_id!r}: {num_computed} computed + "
                             f"{num_new_tokens} new tokens do not match its {len(table)} blocks and "
                             f"{len(request.all_token_ids)} tokens")
        write_index = num_computed // block_size
        copy_on_write = (state.shared_tail and num_new_tokens > 0 and num_computed % block_size != 0
                         and self._ref_cnt[table[write_index]] > 1)
        num_new_blocks = -(-total // block_size) - len(table)
        if num_new_blocks < 0:  # noqa: PLR1730 - an if, not a max() call, on the decode path
            num_new_blocks = 0
        pool = self.block_pool
        if num_new_blocks + copy_on_write > pool.num_free_blocks:
            return None
        if write_index > state.num_cached_blocks and self.enable_prefix_caching:
            self.cache_blocks(request, write_index * block_size)  # in case nobody called it
        if copy_on_write:
            shared = table[write_index]
            private = pool.get_new_blocks(1)[0]
            table[write_index] = private
            pool.free_blocks((shared,))  # others still hold it: it stays allocated
            self._num_saved_slots -= num_computed % block_size
            self._copies.append((shared, private))
            self.rewritten_req_ids.add(request.request_id)
        if num_new_tokens:
            state.shared_tail = False  # it writes into a block of its own from now on
        new_blocks = pool.get_new_blocks(num_new_blocks)
        table.extend(new_blocks)
        return new_blocks

    def _check_hits(self, request: Request, hits: list[int], state: _RequestBlocks | None) -> None:
        """Prefix hits must be what get_computed_blocks just returned for this request, still
        cached: anything else would hand it blocks holding other tokens."""
        hashes = state.block_hashes if state is not None else []
        if not self.enable_prefix_caching or len(hits) > len(hashes) \
                or len(hits) * self.block_size >= len(request.all_token_ids):
            raise ValueError(f"request {request.request_id!r}: prefix hits must come from "
                             "get_computed_blocks")
        block_hash = self.block_pool.block_hash
        for i, block_id in enumerate(hits):
            if not (type(block_id) is int and 0 <= block_id < self.num_blocks) \
                    or block_hash[block_id] != hashes[i]:
                raise ValueError(f"request {request.request_id!r}: block {block_id!r} no longer "
                                 f"caches its block {i} (evicted since get_computed_blocks?)")

    # ---- prefix cache registration ---------------------------------------------------------------
    def _hash_blocks(self, state: _RequestBlocks, num_blocks: int) -> None:
        """Extend the request's block hashes to its first num_blocks blocks."""
        request, hashes, block_size = state.request, state.block_hashes, self.block_size
        tokens = request.all_token_ids
        if num_blocks * block_size > len(tokens):
            raise ValueError(f"request {request.request_id!r}: block {num_blocks - 1} is not full")
        parent, hasher = (hashes[-1] if hashes else None), self._hasher
        for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
            parent = hash_block_tokens(parent, tuple(tokens[start:start + block_size]), state.extra_keys,
                                       hasher)
            hashes.append(parent)

    # ---- release and sharing ---------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it holds none). Blocks nobody else holds join
        the free queue; cached ones stay findable by prefix until evicted."""
        request_id = request.request_id
        state = self._requests.get(request_id)
        if state is None:
            return
        table = state.block_ids
        if table:
            self.block_pool.free_blocks(reversed(table))  # tail first: evicted before the prefix
            # Blocks others still hold lose one holder; this request's fill of each is theirs.
            ref_cnt, block_size = self._ref_cnt, self.block_size
            num_computed = state.request.num_computed_tokens
            for index, block_id in enumerate(table):
                if ref_cnt[block_id]:
                    self._num_saved_slots -= min(block_size, max(0, num_computed - index * block_size))
            if self._copies:
                # A copy into a block it no longer holds would race with that block's next owner.
                dropped = set(table)
                self._copies = [c for c in self._copies if c[1] not in dropped]
        self.rewritten_req_ids.discard(request_id)
        del self._requests[request_id]

    def free_preempted(self, request: Request) -> None:
        """As free, but the hashes of the request's full blocks stay with it: it comes back with
        the same tokens, so on resumption only the blocks it fills anew are hashed (its lookup
        and registration reuse the chain). Blocks reaching a token still in flight (a
        placeholder, whose value is not known yet) are dropped from the chain."""
        state = self._requests.get(request.request_id)
        hashes = state.block_hashes if state is not None else None
        self.free(request)
        if not hashes or not self.enable_prefix_caching:
            return
        num_kept = len(hashes)
        tokens = request.all_token_ids
        if PLACEHOLDER_TOKEN_ID in tokens[:num_kept * self.block_size]:
            num_kept = tokens.index(PLACEHOLDER_TOKEN_ID) // self.block_size
        if num_kept:
            self._requests[request.request_id] = _RequestBlocks(request, block_hashes=hashes[:num_kept])

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent, whose scheduled tokens must all be
        computed (call it from the update, after the step). child.num_computed_tokens must
        equal the parent's; the child must hold nothing yet."""
        state = self._requests.get(parent.request_id)
        if state is None or not state.block_ids:
            raise UnknownRequestError(f"fork: parent {parent.request_id!r} holds no blocks")
        num_computed = parent.num_computed_tokens
        child_state = self._requests.get(child.request_id)
        if child.request_id == parent.request_id or (child_state is not None and child_state.block_ids):
            raise ValueError(f"fork: child {child.request_id!r} already holds blocks")
        if child.num_computed_tokens != num_computed:
            raise ValueError(f"fork: child has {child.num_computed_tokens} computed tokens, "
                             f"parent {num_computed}")
        if len(state.block_ids) != cdiv(num_computed, self.block_size):
            raise ValueError(f"fork: parent {parent.request_id!r} has slots allocated past its "
                             "computed tokens (fork only between steps)")
        table = state.block_ids
        self.block_pool.touch(table)
        shared_tail = num_computed % self.block_size != 0
        self._requests[child.request_id] = _RequestBlocks(
            child, block_ids=list(table), block_hashes=list(state.block_hashes),
            num_cached_blocks=state.num_cached_blocks, shared_tail=shared_tail)
        state.shared_tail = state.shared_tail or shared_tail
        self._num_saved_slots += num_computed  # every filled slot of the parent gains a holder

    # ---- queries ---------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    def can_fit(self, num_tokens: int) -> bool:
        """Could an empty pool ever hold a request of num_tokens tokens?"""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def stats(self) -> KVCacheStats:
        """O(requests holding blocks): one sum of their computed tokens."""
        num_free = self.block_pool.num_free_blocks
        logical = sum([state.request.num_computed_tokens for state in self._requests.values()])
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=num_free,
            block_size=self.block_size,
            allocated_slots=(self.num_blocks - num_free) * self.block_size,
            filled_slots=logical - self._num_saved_slots,
            logical_slots=logical,
            shared_saved_slots=self._num_saved_slots,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
        )
