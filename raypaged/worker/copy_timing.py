"""CopyTimer: how long this rank's host-tier copies took, and how much of that the forward waited.

Two kinds of interval, each between two marks (a CUDA event with timing, or on CPU a reading of
time.perf_counter):

* a copy: from the side stream starting a step's transfers to its last copy done. Their sum is
  the copy time.
* a stall: from the compute stream reaching a wait on the copies (a mark recorded on it just
  before wait_event) to the copy it waits for being done; max(0, awaited - reached), 0 when the
  copy was done first. Their sum is the exposed time. A stream runs its waits in order, so its
  stalls never overlap and none is counted twice. On CPU every copy is a stall of its own length.

Reading is lazy: an interval is added to the totals by the first `totals()` after both its marks
are done (CUDA: Event.query(), which never blocks; in practice a later step's), and dropped then,
so each is counted once. Nothing here synchronizes the host with the device.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from raypaged.core.outputs import KVCopyTimes


class Mark(Protocol):
    """A point in a stream's work (or, on CPU, in time)."""

    def done(self) -> bool:
        """Whether the stream has passed it (never blocks)."""
        ...

    def seconds_to(self, later: Mark) -> float:
        """Seconds from this mark to `later` (negative if `later` came first); both done."""
        ...


class CudaMark:
    """A timing CUDA event recorded on a stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def done(self) -> bool:
        return bool(self.event.query())

    def seconds_to(self, later: Mark) -> float:
        assert isinstance(later, CudaMark)
        return self.event.elapsed_time(later.event) / 1e3


class WallMark:
    """Now, on the host's clock: what a synchronous (CPU) copy is timed with."""

    def __init__(self, at: float | None = None) -> None:
        self.at = time.perf_counter() if at is None else at

    def done(self) -> bool:
        return True

    def seconds_to(self, later: Mark) -> float:
        assert isinstance(later, WallMark)
        return later.at - self.at


class CopyTimer:
    """Running totals of one rank's copy and exposed seconds (see the module docstring)."""

    def __init__(self) -> None:
        self._copy_s = 0.0
        self._exposed_s = 0.0
        self._copies: list[tuple[Mark, Mark]] = []  # (start, end), not yet read
        self._stalls: list[tuple[Mark, Mark]] = []  # (reached, awaited), not yet read

    def copied(self, start: Mark, end: Mark) -> None:
        """The side stream spent start..end on copies."""
        self._copies.append((start, end))

    def stalled(self, reached: Mark, awaited: Mark) -> None:
        """The compute stream, at `reached`, waits until `awaited` (a mark on the side stream)."""
        self._stalls.append((reached, awaited))

    @property
    def num_unread(self) -> int:
        """Intervals whose marks are not all done yet."""
        return len(self._copies) + len(self._stalls)

    def totals(self) -> KVCopyTimes:
        """Every interval done so far, each counted once: cheap enough for every step."""
        if self._copies:
            self._copies, seconds = _read(self._copies)
            self._copy_s += seconds
        if self._stalls:
            self._stalls, seconds = _read(self._stalls)
            self._exposed_s += seconds
        return KVCopyTimes(self._copy_s, self._exposed_s)


def _read(intervals: list[tuple[Mark, Mark]]) -> tuple[list[tuple[Mark, Mark]], float]:
    """(the intervals not done yet, the seconds of those done, each clamped at 0)."""
    unread: list[tuple[Mark, Mark]] = []
    seconds = 0.0
    for first, second in intervals:
        # Both marks: a stall's two sit on different streams, either may finish first.
        if first.done() and second.done():
            seconds += max(0.0, first.seconds_to(second))
        else:
            unread.append((first, second))
    return unread, seconds
