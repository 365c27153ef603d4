"""CopyTimer's accounting over marks that finish when a test says: the copy / exposed split, the
lazy reads (an interval counted once, by the first read after both its marks are done), and the
split HostKVCache's waits give on CPU."""

from __future__ import annotations

import pytest

from raypaged.core.outputs import KVCopyTimes
from raypaged.worker.copy_timing import CopyTimer, Mark, WallMark


class FakeMark:
    """A mark at time `at` (seconds), done once the test finishes it."""

    def __init__(self, at: float, done: bool = True) -> None:
        self.at = at
        self._done = done

    def finish(self) -> None:
        self._done = True

    def done(self) -> bool:
        return self._done

    def seconds_to(self, later: Mark) -> float:
        assert isinstance(later, FakeMark)
        assert self._done and later._done, "read before both marks were done"
        return later.at - self.at


def test_a_stall_counts_what_the_compute_stream_waited_and_never_less_than_zero():
    timer = CopyTimer()
    # The side stream copies 1.0 .. 4.0 s. The forward reaches its wait at 1.5 (the gather done
    # at 2.0: 0.5 s exposed), the next step's forward its wait at 5.0 (the loads done at 4.0: 0).
    start, gathered, end = FakeMark(1.0), FakeMark(2.0), FakeMark(4.0)
    timer.copied(start, end)
    timer.stalled(FakeMark(1.5), gathered)
    timer.stalled(FakeMark(5.0), end)
    times = timer.totals()
    assert times == KVCopyTimes(copy_s=3.0, exposed_s=0.5)
    assert times.hidden_s == 2.5


def test_intervals_are_read_once_both_marks_are_done_and_counted_once():
    timer = CopyTimer()
    start, end = FakeMark(0.0), FakeMark(2.0, done=False)
    reached = FakeMark(1.0)
    timer.copied(start, end)
    timer.stalled(reached, end)
    # Not done yet: nothing read (a read would need a sync), nothing lost either.
    assert timer.totals() == KVCopyTimes() and timer.num_unread == 2
    end.finish()
    assert timer.totals() == KVCopyTimes(2.0, 1.0) and timer.num_unread == 0
    assert timer.totals() == KVCopyTimes(2.0, 1.0)  # read again: the same, not twice as much
    # A later step's copies add to the totals, whichever of its marks finishes last.
    later_start, later_end = FakeMark(10.0, done=False), FakeMark(10.5)
    timer.copied(later_start, later_end)
    timer.stalled(FakeMark(10.25), later_end)
    assert timer.totals() == KVCopyTimes(2.0, 1.25) and timer.num_unread == 1
    later_start.finish()
    assert timer.totals() == KVCopyTimes(2.5, 1.25)


def test_steps_finishing_out_of_order_are_each_counted_when_done():
    timer = CopyTimer()
    marks = [(FakeMark(step * 10.0, done=False), FakeMark(step * 10.0 + step + 1, done=False))
             for step in range(3)]
    for start, end in marks:
        timer.copied(start, end)
    for start, end in reversed(marks):  # the last step's marks finish first
        start.finish()
        end.finish()
    assert timer.totals().copy_s == pytest.approx(1 + 2 + 3) and timer.num_unread == 0


def test_the_slowest_rank_is_each_totals_max_and_sums_add_up():
    ranks = [KVCopyTimes(2.0, 0.5), KVCopyTimes(1.5, 0.75)]
    assert KVCopyTimes.slowest(ranks) == KVCopyTimes(2.0, 0.75)
    assert KVCopyTimes.slowest([]) == KVCopyTimes()
    assert ranks[0] + ranks[1] == KVCopyTimes(3.5, 1.25)
    assert KVCopyTimes(1.0, 1.5).hidden_s == 0.0  # never below 0


def test_wall_marks_time_on_the_host_clock():
    before, after = WallMark(3.0), WallMark(3.25)
    assert before.done() and before.seconds_to(after) == 0.25
    assert WallMark().seconds_to(WallMark()) >= 0.0
