"""The allocator PagedAttention argues against: one contiguous reservation per request.

Before paging, serving systems (FasterTransformer, Orca) gave each request one contiguous KV
region sized for the longest sequence it *might* reach, reserved when the request starts. The
waste comes in three kinds, all visible here:
- reservation: slots held for tokens not generated yet;
- internal fragmentation: slots reserved beyond the length the request actually reaches;
- external fragmentation: free blocks scattered in runs too short for the next reservation.

This manager speaks the KVCacheManager interface, so the real Scheduler drives it unchanged
(the memory simulator compares both; the engine's reservation mode reuses it). Block ids of a
reservation are consecutive; free ranges are found first-fit and coalesced on free. No prefix
sharing; fork copies the parent's blocks into a reservation of the child's own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from raypaged.core.errors import (
    InvalidRequestError,
    NoFreeBlocksError,
    UnknownRequestError,
)
from raypaged.core.kv_cache_interface import KVCacheManagerInterface, KVCacheStats
from raypaged.core.kv_cache_manager import cdiv
from raypaged.core.request import Request

# How big a reservation is. "max_model_len": every request reserves the model's maximum length
# (Orca "Max" in the vLLM paper). "pow2": the request's own prompt + max_tokens rounded up to a
# power of two ("Pow2"). "oracle": exactly prompt + max_tokens ("Oracle": the output length known
# in advance). All three are capped at max_model_len.
RESERVATION_POLICIES = ("max_model_len", "pow2", "oracle")


@dataclass
class _Reservation:
    request: Request
    start: int  # first block id; the reservation is blocks start .. start + num_blocks - 1
    num_blocks: int


class ContiguousKVCacheManager(KVCacheManagerInterface):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 reservation: str = "max_model_len") -> None:
        if not (isinstance(num_blocks, int) and num_blocks >= 1):
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not (isinstance(max_model_len, int) and max_model_len >= 1):
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if reservation not in RESERVATION_POLICIES:
            raise ValueError(f"reservation must be one of {RESERVATION_POLICIES}, got {reservation!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reservation = reservation
        self.max_reservation_blocks = cdiv(max_model_len, block_size)
        # Every reservation is at most max_model_len, so this pool can always serve every request
        # once the others leave (and can_fit needs no knowledge of the request's max_tokens).
        if self.max_reservation_blocks > num_blocks:
            raise ValueError(f"a max_model_len reservation needs {self.max_reservation_blocks} "
                             f"blocks but the pool has only {num_blocks}: no request could run")
        # Free id ranges as two parallel lists sorted by start: first-fit is a scan from the
        # left, coalescing a bisect. The number of ranges is at most (holders + 1).
        self._free_starts: list[int] = [0]
        self._free_lengths: list[int] = [num_blocks]
        self._num_free = num_blocks
        self._reservations: dict[str, _Reservation] = {}
        self._pending_copies: list[tuple[int, int]] = []

    # ---- sizing ----------------------------------------------------------------------------

    def reservation_tokens(self, request: Request) -> int:
        """How many token slots `request` reserves on its first allocation."""
        if self.reservation == "max_model_len":
            return self.max_model_len
        wanted = request.num_prompt_tokens + request.sampling_params.max_tokens
        if self.reservation == "pow2":
            wanted = 1 << (wanted - 1).bit_length()
        return min(wanted, self.max_model_len)

    def reservation_blocks(self, request: Request) -> int:
        return cdiv(self.reservation_tokens(request), self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Could an empty pool ever hold a request of `num_tokens` tokens? Any reservation up to
        max_model_len fits the pool (checked at construction)."""
        return num_tokens <= self.max_model_len

    # ---- the KVCacheManager interface ------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return [], 0  # no prefix cache: every request computes its whole prompt

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        pass  # no prefix cache to register in

    def pop_rewritten(self, request_id: str) -> bool:
        return False  # a reservation is never rewritten: a fork copies into the child's own

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve the request's whole region on its first call and return all of its block ids;
        later calls return [] (the region already covers them). None, changing nothing, when no
        free run is long enough."""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise InvalidRequestError(f"num_new_tokens must be a non-negative integer, got {num_new_tokens!r}")
        if new_computed_blocks:
            raise InvalidRequestError("the contiguous manager has no prefix cache: it never hands "
                                      "out computed blocks, so none can be passed back")
        needed_tokens = request.num_computed_tokens + num_new_tokens
        if needed_tokens > request.num_tokens:
            raise InvalidRequestError(f"request {request.request_id!r}: asked for slots past its last token")
        held = self._reservations.get(request.request_id)
        if held is not None:
            self._check_within(held.num_blocks, needed_tokens, request)
            return []
        num_blocks = self.reservation_blocks(request)
        self._check_within(num_blocks, needed_tokens, request)
        start = self._take_run(num_blocks)
        if start is None:
            return None
        self._reservations[request.request_id] = _Reservation(request, start, num_blocks)
        return list(range(start, start + num_blocks))

    def free(self, request: Request) -> None:
        """Give the request's region back (a no-op for a request that holds none)."""
        held = self._reservations.pop(request.request_id, None)
        if held is not None:
            self._give_run(held.start, held.num_blocks)

    def fork(self, parent: Request, child: Request) -> None:
        """The child gets a reservation of its own and a copy of every block the parent has
        filled (queued for the workers, see take_block_copies). Nothing is shared."""
        src = self._reservations.get(parent.request_id)
        if src is None:
            raise UnknownRequestError(f"fork: parent {parent.request_id!r} holds no blocks")
        if child.request_id in self._reservations:
            raise InvalidRequestError(f"fork: child {child.request_id!r} already holds blocks")
        start = self._take_run(src.num_blocks)
        if start is None:
            raise NoFreeBlocksError(f"fork: no free run of {src.num_blocks} contiguous blocks "
                                    f"for {child.request_id!r}")
        self._reservations[child.request_id] = _Reservation(child, start, src.num_blocks)
        # Copy every block that may hold parent K/V: the computed tokens plus the one sampled
        # in the step that forks (its K/V are written the next step, but copying it is cheap).
        num_filled = min(src.num_blocks, cdiv(parent.num_tokens, self.block_size))
        self._pending_copies.extend((src.start + i, start + i) for i in range(num_filled))

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        held = self._reservations.get(request_id)
        return [] if held is None else list(range(held.start, held.start + held.num_blocks))

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached, so there is never anything to reset

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / self.num_blocks

    def stats(self) -> KVCacheStats:
        allocated = sum(r.num_blocks for r in self._reservations.values()) * self.block_size
        filled = sum(r.request.num_computed_tokens for r in self._reservations.values())
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=self._num_free, block_size=self.block_size,
            allocated_slots=allocated, filled_slots=filled, logical_slots=filled,
            shared_saved_slots=0, prefix_cache_queries=0, prefix_cache_hits=0,
        )

    # ---- fragmentation ---------------------------------------------------------------------

    def free_runs(self) -> list[tuple[int, int]]:
        """Free id ranges as (start, length), left to right."""
        return list(zip(self._free_starts, self._free_lengths))

    @property
    def largest_free_run(self) -> int:
        return max(self._free_lengths, default=0)

    def unusable_free_blocks(self, num_blocks_needed: int | None = None) -> int:
        """External fragmentation: free blocks lying in runs too short for a reservation of
        `num_blocks_needed` blocks (default: a max_model_len reservation)."""
        need = self.max_reservation_blocks if num_blocks_needed is None else num_blocks_needed
        return sum(length for length in self._free_lengths if length < need)

    # ---- free-range bookkeeping ------------------------------------------------------------

    def _check_within(self, num_blocks: int, needed_tokens: int, request: Request) -> None:
        if needed_tokens > num_blocks * self.block_size:
            raise InvalidRequestError(
                f"request {request.request_id!r} needs {needed_tokens} slots but its contiguous "
                f"reservation holds {num_blocks * self.block_size}")

    def _take_run(self, num_blocks: int) -> int | None:
        """First fit: the leftmost free range long enough; its head is taken."""
        for i, length in enumerate(self._free_lengths):
            if length >= num_blocks:
                start = self._free_starts[i]
                if length == num_blocks:
                    del self._free_starts[i], self._free_lengths[i]
                else:
                    self._free_starts[i] += num_blocks
                    self._free_lengths[i] -= num_blocks
                self._num_free -= num_blocks
                return start
        return None

    def _give_run(self, start: int, num_blocks: int) -> None:
        """Return a range, merging it with the free ranges that touch it on either side."""
        i = bisect.bisect_left(self._free_starts, start)
        merges_left = i > 0 and self._free_starts[i - 1] + self._free_lengths[i - 1] == start
        merges_right = i < len(self._free_starts) and start + num_blocks == self._free_starts[i]
        if merges_left and merges_right:
            self._free_lengths[i - 1] += num_blocks + self._free_lengths[i]
            del self._free_starts[i], self._free_lengths[i]
        elif merges_left:
            self._free_lengths[i - 1] += num_blocks
        elif merges_right:
            self._free_starts[i] = start
            self._free_lengths[i] += num_blocks
        else:
            self._free_starts.insert(i, start)
            self._free_lengths.insert(i, num_blocks)
        self._num_free += num_blocks
