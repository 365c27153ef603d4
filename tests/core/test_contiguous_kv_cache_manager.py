"""ContiguousKVCacheManager: one contiguous max-length reservation per request."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from raypaged.core.errors import InvalidRequestError, NoFreeBlocksError, UnknownRequestError
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int = 5, max_tokens: int = 3) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def snapshot(m: ContiguousKVCacheManager) -> dict:
    return copy.deepcopy({k: v for k, v in vars(m).items() if k != "_reservations"}) | {
        "tables": {rid: m.get_block_ids(rid) for rid in m._reservations}}


def test_both_managers_conform_to_the_interface():
    assert isinstance(ContiguousKVCacheManager(8, 4, 16), KVCacheManagerInterface)
    assert isinstance(KVCacheManager(8, 4), KVCacheManagerInterface)


def test_first_allocation_reserves_max_model_len_in_consecutive_ids():
    m = ContiguousKVCacheManager(num_blocks=20, block_size=4, max_model_len=18)  # 5 blocks each
    a, b = make_request("a"), make_request("b")
    assert m.allocate_slots(a, 5) == [0, 1, 2, 3, 4]
    assert m.allocate_slots(b, 1) == [5, 6, 7, 8, 9]
    a.num_computed_tokens = 5
    a.append_output_token(9)
    assert m.allocate_slots(a, 1) == []  # the region already covers the next token
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4]
    assert m.num_free_blocks == 10 and m.usage == pytest.approx(0.5)


def test_stats_count_the_whole_reservation_as_allocated():
    m = ContiguousKVCacheManager(num_blocks=20, block_size=4, max_model_len=18)
    a = make_request("a")
    m.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    s = m.stats()
    assert (s.allocated_slots, s.filled_slots, s.logical_slots, s.shared_saved_slots) == (20, 5, 5, 0)
    assert (s.num_blocks, s.num_free_blocks, s.block_size) == (20, 15, 4)


def test_first_fit_takes_the_leftmost_hole_that_is_long_enough():
    m = ContiguousKVCacheManager(num_blocks=30, block_size=1, max_model_len=10, reservation="oracle")
    small = [make_request(f"s{i}", 2, 1) for i in range(3)]  # 3 blocks each
    big = make_request("big", 3, 2)  # 5 blocks
    for r in small:
        m.allocate_slots(r, 1)
    assert [m.get_block_ids(r.request_id)[0] for r in small] == [0, 3, 6]
    m.free(small[0])  # hole of 3 at 0: too short for 5, first fit skips it
    assert m.allocate_slots(big, 1) == [9, 10, 11, 12, 13]
    tiny = make_request("tiny", 1, 1)  # 2 blocks: fits the first hole
    assert m.allocate_slots(tiny, 1) == [0, 1]


def test_free_coalesces_with_both_neighbours():
    m = ContiguousKVCacheManager(num_blocks=12, block_size=2, max_model_len=8)  # 4 blocks each
    rs = [make_request(x) for x in "abc"]
    for r in rs:
        m.allocate_slots(r, 1)
    assert m.free_runs() == []
    m.free(rs[0])
    m.free(rs[2])
    assert m.free_runs() == [(0, 4), (8, 4)]
    m.free(rs[1])  # bridges the two holes into one
    assert m.free_runs() == [(0, 12)]


def test_external_fragmentation_blocks_a_request_the_free_count_would_admit():
    m = ContiguousKVCacheManager(num_blocks=10, block_size=1, max_model_len=6, reservation="oracle")
    a, b, c = make_request("a", 2, 1), make_request("b", 3, 1), make_request("c", 2, 1)
    m.allocate_slots(a, 1)  # 0-2
    m.allocate_slots(b, 1)  # 3-6
    m.allocate_slots(c, 1)  # 7-9
    m.free(a)
    m.free(c)
    assert m.num_free_blocks == 6 and m.largest_free_run == 3
    wants_four = make_request("d", 3, 1)
    assert m.allocate_slots(wants_four, 1) is None  # 6 free blocks, but no run of 4
    assert m.unusable_free_blocks(4) == 6
    assert m.unusable_free_blocks(3) == 0
    assert m.get_block_ids("d") == []


def test_max_model_len_pool_remainder_is_external_fragmentation():
    m = ContiguousKVCacheManager(num_blocks=10, block_size=4, max_model_len=12)  # 3 blocks each
    rs = [make_request(str(i)) for i in range(4)]
    assert [m.allocate_slots(r, 1) is not None for r in rs] == [True, True, True, False]
    assert m.num_free_blocks == 1 and m.unusable_free_blocks() == 1


def test_pow2_and_oracle_reservation_sizes():
    r = make_request("r", prompt_len=20, max_tokens=13)  # 33 tokens
    sizes = {p: ContiguousKVCacheManager(100, 4, 50, reservation=p).reservation_tokens(r)
             for p in ("max_model_len", "pow2", "oracle")}
    assert sizes == {"max_model_len": 50, "pow2": 50, "oracle": 33}  # pow2 64 capped at 50
    assert ContiguousKVCacheManager(100, 4, 100, reservation="pow2").reservation_blocks(r) == 16


def test_fork_copies_filled_blocks_into_a_separate_region():
    m = ContiguousKVCacheManager(num_blocks=12, block_size=2, max_model_len=8)
    parent = make_request("p", prompt_len=3)
    m.allocate_slots(parent, 3)
    parent.num_computed_tokens = 3
    parent.append_output_token(7)
    child = make_request("p#1", prompt_len=3)
    m.fork(parent, child)
    assert m.get_block_ids("p#1") == [4, 5, 6, 7]
    assert m.take_block_copies() == [(0, 4), (1, 5)]  # 4 tokens fill 2 blocks of 2
    assert m.take_block_copies() == []
    assert not set(m.get_block_ids("p")) & set(m.get_block_ids("p#1"))


def test_bad_input_raises_and_changes_nothing():
    m = ContiguousKVCacheManager(num_blocks=8, block_size=2, max_model_len=8)
    a = make_request("a")
    m.allocate_slots(a, 5)
    filler = make_request("f")
    m.allocate_slots(filler, 1)  # pool now full
    before = snapshot(m)
    with pytest.raises(InvalidRequestError):
        m.allocate_slots(make_request("b"), -1)
    with pytest.raises(InvalidRequestError):
        m.allocate_slots(make_request("b"), 1, new_computed_blocks=[3])
    with pytest.raises(InvalidRequestError, match="past its last token"):
        m.allocate_slots(a, 6)
    with pytest.raises(UnknownRequestError):
        m.fork(make_request("ghost"), make_request("g#1"))
    with pytest.raises(InvalidRequestError):
        m.fork(a, filler)
    with pytest.raises(NoFreeBlocksError):
        m.fork(a, make_request("a#1"))
    assert m.allocate_slots(make_request("c"), 1) is None
    m.free(make_request("never-allocated"))  # a no-op, like the paged manager's free
    assert snapshot(m) == before


def test_growing_past_the_reservation_raises_and_changes_nothing():
    m = ContiguousKVCacheManager(num_blocks=8, block_size=2, max_model_len=8, reservation="oracle")
    r = make_request("r", prompt_len=5, max_tokens=1)  # reserves 6 slots
    assert m.allocate_slots(r, 5) == [0, 1, 2]
    r.num_computed_tokens = 5
    for t in (7, 8, 9):  # more tokens than max_tokens allowed: a caller bug
        r.append_output_token(t)
    before = snapshot(m)
    with pytest.raises(InvalidRequestError, match="reservation holds 6"):
        m.allocate_slots(r, 3)
    assert snapshot(m) == before


def test_constructor_rejects_a_pool_no_reservation_fits():
    with pytest.raises(ValueError, match="no request could run"):
        ContiguousKVCacheManager(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError):
        ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=16, reservation="buddy")
    m = ContiguousKVCacheManager(num_blocks=4, block_size=4, max_model_len=16)
    assert m.can_fit(16) and not m.can_fit(17)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 12)), max_size=60))
def test_random_allocate_free_sequences_keep_the_pool_consistent(ops):
    """Reservations are consecutive and disjoint, free ranges are sorted and fully coalesced,
    reserved + free covers the pool exactly, and it is whole once everything is freed."""
    num_blocks = 40
    m = ContiguousKVCacheManager(num_blocks, block_size=2, max_model_len=24, reservation="oracle")
    live: dict[str, Request] = {}
    for is_alloc, slot, length in ops:
        rid = f"r{slot}"
        if is_alloc and rid not in live:
            r = make_request(rid, prompt_len=length, max_tokens=length)
            if m.allocate_slots(r, length) is not None:
                live[rid] = r
        elif not is_alloc and rid in live:
            m.free(live.pop(rid))
        held = [b for rid in live for b in m.get_block_ids(rid)]
        for rid in live:
            ids = m.get_block_ids(rid)
            assert ids == list(range(ids[0], ids[0] + len(ids)))
        runs = m.free_runs()
        free = [b for start, n in runs for b in range(start, start + n)]
        assert sorted(held + free) == list(range(num_blocks))
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(runs, runs[1:]))  # no touching runs
        assert m.num_free_blocks == len(free)
    for r in live.values():
        m.free(r)
    assert m.free_runs() == [(0, num_blocks)] and m.num_free_blocks == num_blocks


def _drive(num_blocks: int):
    """Run a scheduler on a contiguous manager: an n=2 request and two single ones, each
    reserving 4 blocks. Returns the manager and every SchedulerOutput, in order."""
    from raypaged.core.outputs import ModelRunnerOutput
    from raypaged.core.scheduler import Scheduler, SchedulerConfig

    m = ContiguousKVCacheManager(num_blocks=num_blocks, block_size=4, max_model_len=16)
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=16,
                                      enable_prefix_caching=False), kv_cache_manager=m)
    sched.add_request(Request("g", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=2, ignore_eos=True)))
    for i in range(2):
        sched.add_request(make_request(f"solo{i}", prompt_len=3, max_tokens=2))
    outputs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outputs.append(out)
        sampled = [[7, 8] if rid == "g" and len(outputs) == 1 else [9] for rid in out.num_scheduled_tokens]
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
        assert len(outputs) < 20
    return m, outputs


def test_the_real_scheduler_forks_by_copying_into_a_region_of_its_own():
    m, outputs = _drive(num_blocks=16)  # room for 4 reservations
    assert [(r.req_id, r.block_ids) for r in outputs[0].scheduled_new_reqs] == [
        ("g", [0, 1, 2, 3]), ("solo0", [4, 5, 6, 7]), ("solo1", [8, 9, 10, 11])]
    child = outputs[1].scheduled_new_reqs[0]
    assert (child.req_id, child.block_ids, child.num_computed_tokens) == ("g#1", [12, 13, 14, 15], 6)
    assert outputs[1].block_copies == [(0, 12), (1, 13)]  # the parent's 6 computed tokens
    assert m.free_runs() == [(0, 16)]


def test_the_real_scheduler_defers_a_fork_the_pool_cannot_hold():
    m, outputs = _drive(num_blocks=12)  # the three first reservations fill the pool
    assert all(o.block_copies == [] for o in outputs)
    assert "g#1" not in outputs[1].num_scheduled_tokens  # no sharing to fall back on: it waits
    later = [r for o in outputs[2:] for r in o.scheduled_new_reqs if r.req_id == "g#1"]
    assert len(later) == 1 and later[0].num_computed_tokens == 0  # recomputes once there is room
    assert m.free_runs() == [(0, 12)]
