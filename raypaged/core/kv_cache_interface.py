"""What the Scheduler needs from a KV cache manager, and the snapshot it reports.

Two managers implement it: the paged KVCacheManager (blocks on demand, prefix sharing) and the
ContiguousKVCacheManager (one max-length reservation per request, as before PagedAttention).
The Scheduler takes either, so the memory simulator and the engine's reservation mode compare
allocators under the very same scheduling decisions. A manager without a prefix cache, or one
that never rewrites a table, implements those methods as no-ops; the scheduler calls them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from raypaged.core.block_pool import BlockPool
from raypaged.core.outputs import KVCopyTimes, KVTransfers
from raypaged.core.request import Request


@dataclass
class KVCacheStats:
    """A snapshot of the pool. Slots are token positions (block_size per block); every count
    takes a block held by several requests once, except logical_slots."""

    num_blocks: int
    num_free_blocks: int
    block_size: int
    allocated_slots: int  # slots in blocks held by some request
    filled_slots: int  # of those, slots that hold a computed token's K/V for some holder
    logical_slots: int  # sum over requests of their computed tokens (what they'd need unshared)
    shared_saved_slots: int  # logical - filled: slots saved by prefix sharing and fork
    prefix_cache_queries: int  # tokens looked up in the prefix cache (like vLLM)
    prefix_cache_hits: int  # of those, tokens found (in either tier)
    # Blocks held per KV-cache group (each block once; a block belongs to one group). Empty for
    # a single-group manager, whose groups' total is num_used_blocks.
    group_blocks: tuple[int, ...] = ()
    group_windows: tuple[int | None, ...] = ()  # each group's sliding window (None: full)
    # The host tier (core/tiered_kv_cache_manager.py); zeros without one.
    host_cache_hits: int = 0  # of prefix_cache_hits, tokens found in the host tier
    num_host_blocks: int = 0
    num_host_free_blocks: int = 0
    offloaded_bytes: int = 0  # copied GPU -> host since the start, over every rank
    loaded_bytes: int = 0  # copied host -> GPU
    # Seconds of those copies since the start (worker/copy_timing.py), on the slowest rank:
    # the copy stream's time on them, and of it what the forward waited for.
    host_copy_s: float = 0.0
    host_copy_exposed_s: float = 0.0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        """Filled / allocated slots: the share of held KV memory that holds token states."""
        return self.filled_slots / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def unfilled_slots(self) -> int:
        """Internal fragmentation: allocated slots that hold nothing (yet)."""
        return self.allocated_slots - self.filled_slots

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def host_copy_hidden_s(self) -> float:
        """Copy seconds the forward overlapped (never below 0)."""
        return max(0.0, self.host_copy_s - self.host_copy_exposed_s)


class KVCacheManagerInterface(ABC):
    """Block tables per request over one pool of num_blocks blocks of block_size slots. The
    scheduler advances request.num_computed_tokens; a manager reads it and never writes it."""

    block_size: int
    num_blocks: int

    # ---- prefix cache --------------------------------------------------------------------------
    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit: cached full blocks holding the request's leading tokens, and the
        number of tokens they hold (never all of its tokens). ([], 0) without a prefix cache."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks the request's first num_computed_tokens tokens fill in the prefix
        cache (idempotent; a no-op without one). Called after a step that filled a block."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds. False if some request still holds one."""

    # ---- allocation ----------------------------------------------------------------------------
    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Block ids newly appended to the request's table (on its first allocation: the whole
        table, prefix hits first), or None (and no change) when the pool cannot supply them now."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's blocks (a no-op if it holds none)."""

    def free_preempted(self, request: Request) -> None:
        """Release a preempted request's blocks (it will be scheduled again). A manager with a
        host tier may swap its K/V out first; the others just free them."""
        self.free(request)

    def may_admit(self, request: Request) -> bool:
        """Whether the waiting request may be scheduled this step. A manager with a host tier
        may say no once, while it loads the request's prefix for the next step."""
        return True

    def take_transfers(self) -> KVTransfers | None:
        """The host tier's copies queued since the last call (None: none, or no host tier)."""
        return None

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Give the child (a new sample of the parent's group, with the parent's computed
        tokens) the parent's K/V, shared or copied. NoFreeBlocksError, changing nothing, if a
        copying manager has no room for it."""

    @abstractmethod
    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies queued since the last call, for the workers to apply."""

    @abstractmethod
    def pop_rewritten(self, request_id: str) -> bool:
        """Whether the request's table changed other than by appending (copy-on-write replaced a
        block) since the last call for it: the workers must then get the whole table again.
        Clears the mark. A manager's free() drops the mark of the request it frees."""

    # ---- queries -------------------------------------------------------------------------------
    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds none)."""

    @property
    def num_groups(self) -> int:
        """KV-cache groups (core/kv_cache_groups.py): one table per group per request."""
        return 1

    def get_group_block_ids(self, request_id: str, last: int | None = None) -> list[list[int]]:
        """Every group's table, in group order (the last `last` entries of each if given)."""
        table = self.get_block_ids(request_id)
        return [table if last is None else table[len(table) - last:]]

    @abstractmethod
    def can_fit(self, num_tokens: int) -> bool:
        """Could an empty pool ever hold a request of this many tokens?"""

    @abstractmethod
    def stats(self) -> KVCacheStats: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""

    # ---- cache events (a data-parallel router's view of this pool) ------------------------------
    def record_cache_events(self) -> None:  # noqa: B027 - a manager without a prefix cache keeps none
        """Start keeping the hash values that enter and leave the prefix cache (a manager with no
        prefix cache has none to keep)."""

    def take_cache_events(self) -> list[int]:
        """The cache events since the last call (core/block_pool.py stored_event / removed_event)."""
        return []

    # ---- what the workers report ----------------------------------------------------------------
    def record_copy_times(self, times: KVCopyTimes) -> None:  # noqa: B027 - only a host tier copies
        """The host tier's copy times so far (running totals, the engine's over every worker
        group it ran), for stats(). A manager without a host tier gets none."""


class PagedKVCacheManagerBase(KVCacheManagerInterface):
    """What the paged managers (one table per request, or one per KV-cache group) share: their
    BlockPool, the copy-on-write queue and the rewritten marks."""

    block_pool: BlockPool
    rewritten_req_ids: set[str]
    _copies: list[tuple[int, int]]

    def pop_rewritten(self, request_id: str) -> bool:
        if request_id in self.rewritten_req_ids:
            self.rewritten_req_ids.discard(request_id)
            return True
        return False

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) copy-on-write pairs queued since the last call. No dst is a src in the same
        list, so the workers may apply them in one batched gather-scatter, before the forward."""
        copies, self._copies = self._copies, []
        return copies

    def record_cache_events(self) -> None:
        self.block_pool.record_events()

    def take_cache_events(self) -> list[int]:
        return self.block_pool.take_events()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.block_pool.num_free_blocks / self.num_blocks
