"""When a request group's stream is complete: the one rule every consumer of engine records uses.

The engine's contract (core/parallel_sampling.py, `end_records`): every sample index 0..n-1 of
an n-sample group gets exactly one finishing record, whatever the moment the group ends —
waiting, mid-prefill, with its forking step in flight, or after the fork. A group is complete
once each index has ended; a consumer may also end a sample early itself (a stop string found in
its text), after which the engine's own late finish for it changes nothing.
"""

from __future__ import annotations


class GroupProgress:
    """Which samples of one group are still open."""

    __slots__ = ("_open",)

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a group has at least one sample, not {n}")
        self._open = set(range(n))

    def end(self, sample_index: int) -> bool:
        """Mark the sample over. True when this call ended it; False when it was over already
        (a duplicate or late finish must not count twice)."""
        if sample_index in self._open:
            self._open.discard(sample_index)
            return True
        return False

    def is_open(self, sample_index: int) -> bool:
        return sample_index in self._open

    @property
    def open_indices(self) -> list[int]:
        return sorted(self._open)

    @property
    def complete(self) -> bool:
        return not self._open
