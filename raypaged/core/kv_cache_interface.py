"""What the Scheduler needs from a KV cache manager.

Two managers implement it: the paged KVCacheManager (blocks on demand, prefix sharing) and the
ContiguousKVCacheManager (one max-length reservation per request, as before PagedAttention).
The Scheduler takes either, so the memory simulator and the engine's reservation mode compare
allocators under the very same scheduling decisions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from raypaged.core.kv_cache_manager import KVCacheStats
    from raypaged.core.request import Request


@runtime_checkable
class KVCacheManagerInterface(Protocol):
    block_size: int
    num_blocks: int

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hit: cached full blocks and the number of tokens they hold."""
        ...

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Block ids newly appended to the request's table, or None (and no change) when the
        pool cannot supply them now."""
        ...

    def free(self, request: Request) -> None: ...

    def fork(self, parent: Request, child: Request) -> None: ...

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies queued since the last call, for the workers to apply."""
        ...

    def get_block_ids(self, request_id: str) -> list[int]: ...

    def can_fit(self, num_tokens: int) -> bool:
        """Could an empty pool ever hold a request of this many tokens?"""
        ...

    def reset_prefix_cache(self) -> bool: ...

    def stats(self) -> KVCacheStats: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...
