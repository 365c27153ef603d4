"""The process-wide set of engine replicas no new call goes to (serve/replica_quarantine.py):
held on the first sign of a dead engine, released when Serve's set drops the replica or fresh
routing stats report its engine alive — and not by a stale snapshot."""

from __future__ import annotations

from raypaged.serve.replica_quarantine import FRESH_SNAPSHOTS, ReplicaQuarantine


def test_a_held_replica_is_released_by_the_third_live_snapshot_not_the_first():
    quarantine = ReplicaQuarantine()
    assert quarantine.hold("a", "its engine is gone") and not quarantine.hold("a", "again")
    assert "a" in quarantine and quarantine.held() == {"a"} and quarantine.num_held == 1
    for _ in range(FRESH_SNAPSHOTS - 1):  # the first may have been answered before the death
        quarantine.note_stats("a", engine_alive=True)
        assert "a" in quarantine
    quarantine.note_stats("a", engine_alive=False)  # dead again: the count starts over
    for _ in range(FRESH_SNAPSHOTS - 1):
        quarantine.note_stats("a", engine_alive=True)
    assert "a" in quarantine
    quarantine.note_stats("a", engine_alive=True)
    assert "a" not in quarantine and quarantine.held() == frozenset()


def test_stats_reporting_a_dead_engine_hold_and_live_ones_of_a_free_replica_do_nothing():
    quarantine = ReplicaQuarantine()
    quarantine.note_stats("b", engine_alive=True)
    assert quarantine.held() == frozenset()
    quarantine.note_stats("b", engine_alive=False)
    assert quarantine.held() == {"b"}


def test_a_replica_gone_from_the_set_is_released_and_another_routers_are_left_alone():
    quarantine = ReplicaQuarantine()
    quarantine.hold("a", "lost")
    quarantine.hold("x", "lost by another deployment's stream")
    quarantine.retain(known=["a", "b"], current=["b", "c"])  # a replaced by c
    assert quarantine.held() == {"x"}
    quarantine.release("x")
    quarantine.release("x")  # released twice: nothing
    assert quarantine.held() == frozenset()
