"""KVCacheManager: on-demand blocks, prefix caching, fork with copy-on-write, exact accounting."""

import pytest

from raypaged.core.errors import UnknownRequestError
from raypaged.core.kv_cache_manager import KVCacheManager, KVCacheStats
from tests.support.core_fakes import make_request

B = 4


def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (list(pool.ref_cnt), list(pool.block_hash), pool.free_block_ids(), dict(pool._cached),
            {rid: (list(s.block_ids), list(s.block_hashes), s.num_cached_blocks, s.shared_tail)
             for rid, s in kv._requests.items()},
            kv._num_saved_slots, list(kv._copies), set(kv.rewritten_req_ids), kv.stats())


def compute(kv: KVCacheManager, request, n: int, hits=None) -> list[int]:
    """What the scheduler does for one step of n tokens (prefix hits on the first)."""
    blocks = kv.allocate_slots(request, n, hits)
    assert blocks is not None
    request.num_computed_tokens += len(hits or []) * B + n
    kv.cache_blocks(request, request.num_computed_tokens)
    return blocks


def test_blocks_are_allocated_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    r = make_request("a", list(range(1, 7)))  # 6 tokens
    assert compute(kv, r, 6) == [0, 1]
    assert kv.get_block_ids("a") == [0, 1] and kv.num_free_blocks == 6
    r.append_output_token(50)  # token 7 fits the second block
    assert compute(kv, r, 1) == []
    r.append_output_token(51)
    assert compute(kv, r, 1) == []
    r.append_output_token(52)  # token 9 needs a third block
    assert compute(kv, r, 1) == [2]
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []


def test_no_room_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=B)
    a = make_request("a", list(range(1, 9)))
    compute(kv, a, 8)  # two blocks
    b = make_request("b", list(range(20, 30)))  # needs three
    before = snapshot(kv)
    assert kv.allocate_slots(b, 10) is None
    assert snapshot(kv) == before
    a.append_output_token(1)
    a.append_output_token(2)
    compute(kv, a, 1)  # takes the last block
    c = make_request("c", [1])
    before = snapshot(kv)
    assert kv.allocate_slots(c, 1) is None
    assert snapshot(kv) == before


@pytest.mark.parametrize("call", [
    lambda kv, r: kv.allocate_slots(r, -1),
    lambda kv, r: kv.allocate_slots(r, 1.5),
    lambda kv, r: kv.allocate_slots(r, 100),  # past its last token
    lambda kv, r: kv.allocate_slots(r, 1, [0]),  # prefix hits after the first allocation
    lambda kv, r: kv.cache_blocks(r, 99),
])
def test_bad_calls_change_nothing(call):
    kv = KVCacheManager(num_blocks=8, block_size=B)
    r = make_request("a", list(range(1, 7)))
    compute(kv, r, 3)
    before = snapshot(kv)
    with pytest.raises(ValueError):
        call(kv, r)
    assert snapshot(kv) == before


def test_prefix_hits_reuse_full_blocks_but_leave_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    a = make_request("a", list(range(1, 11)))  # 10 tokens: blocks [1-4][5-8][9,10]
    compute(kv, a, 10)
    b = make_request("b", list(range(1, 9)) + [77, 78, 79])  # shares 8 tokens = 2 blocks
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert hits == kv.get_block_ids("a")[:2] and num_hit_tokens == 8
    table = compute(kv, b, 3, hits)
    assert table[:2] == hits and len(table) == 3
    assert kv.block_pool.ref_cnt[hits[0]] == 2
    # A prompt that is exactly its cached blocks still computes its last block.
    c = make_request("c", list(range(1, 9)))
    hits_c, n_c = kv.get_computed_blocks(c)
    assert len(hits_c) == 1 and n_c == 4
    stats = kv.stats()
    assert stats.prefix_cache_queries == 10 + 11 and stats.prefix_cache_hits == 8


def test_prefix_cache_survives_free_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    a = make_request("a", list(range(1, 10)))  # 9 tokens, 3 blocks, 2 full
    compute(kv, a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", list(range(1, 10)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    compute(kv, b, 1, hits)  # revives both cached blocks from the free queue
    assert kv.num_free_blocks == 1 and kv.stats().filled_slots == 9
    kv.free(b)
    # Pressure: a 4-block request evicts everything, so the prefix is gone.
    c = make_request("c", list(range(100, 116)))
    compute(kv, c, 16)
    kv.free(c)
    assert kv.get_computed_blocks(make_request("d", list(range(1, 10)))) == ([], 0)


def test_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    prompt = list(range(1, 10))
    compute(kv, make_request("a", prompt, salt="tenant-1"), 9)
    assert kv.get_computed_blocks(make_request("b", prompt, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, salt="tenant-1"))[1] == 8


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=16, block_size=B, enable_prefix_caching=False)
    compute(kv, make_request("a", list(range(1, 10))), 9)
    assert kv.get_computed_blocks(make_request("b", list(range(1, 10)))) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0
    stats = kv.stats()
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0


def test_stale_prefix_hits_are_refused():
    kv = KVCacheManager(num_blocks=3, block_size=B)
    a = make_request("a", list(range(1, 10)))
    compute(kv, a, 9)
    kv.free(a)
    b = make_request("b", list(range(1, 10)))
    hits, _ = kv.get_computed_blocks(b)
    compute(kv, make_request("x", list(range(50, 62))), 12)  # evicts them
    before = snapshot(kv)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, hits)
    with pytest.raises(ValueError):
        kv.allocate_slots(make_request("y", [1, 2, 3, 4, 5]), 1, [0])  # never looked up
    assert snapshot(kv) == before


def test_fork_shares_everything_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(num_blocks=16, block_size=B)
    parent = make_request("g", list(range(1, 7)), n=3)  # 6 tokens: one full block, one partial
    compute(kv, parent, 6)
    table = kv.get_block_ids("g")
    children = []
    for i in (1, 2):
        child = make_request(f"g#{i}", list(range(1, 7)))
        child.num_computed_tokens = 6
        kv.fork(parent, child)
        children.append(child)
        assert kv.get_block_ids(child.request_id) == table
    assert [kv.block_pool.ref_cnt[b] for b in table] == [3, 3]
    stats = kv.stats()
    assert stats.logical_slots == 18 and stats.filled_slots == 6 and stats.shared_saved_slots == 12

    # Each sample appends its own token at position 6, inside the shared partial block.
    for k, r in enumerate([*children, parent]):
        r.append_output_token(100 + k)
    assert compute(kv, children[0], 1) == []
    copies = kv.take_block_copies()
    private = kv.get_block_ids("g#1")[1]
    assert copies == [(table[1], private)] and private not in table
    assert kv.get_block_ids("g#1")[0] == table[0]
    assert "g#1" in kv.rewritten_req_ids
    compute(kv, children[1], 1)
    assert len(kv.take_block_copies()) == 1
    # The parent is the last holder of the partial block: it writes in place.
    compute(kv, parent, 1)
    assert kv.take_block_copies() == [] and kv.get_block_ids("g") == table
    assert "g" not in kv.rewritten_req_ids
    stats = kv.stats()
    assert stats.logical_slots == 21
    assert stats.filled_slots == 4 + 3 * 3  # shared full block once + three private partial blocks
    for r in [parent, *children]:
        kv.free(r)
    assert kv.num_free_blocks == 16 and kv.stats().filled_slots == 0


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    parent = make_request("g", list(range(1, 9)))
    compute(kv, parent, 8)
    child = make_request("g#1", list(range(1, 9)))
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    child.append_output_token(5)
    parent.append_output_token(6)
    assert len(compute(kv, child, 1)) == 1 and len(compute(kv, parent, 1)) == 1
    assert kv.take_block_copies() == []


def test_bad_fork_changes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    parent = make_request("p", list(range(1, 7)))
    compute(kv, parent, 6)
    other = make_request("o", [1, 2])
    compute(kv, other, 2)
    before = snapshot(kv)
    child = make_request("c", list(range(1, 7)))
    with pytest.raises(UnknownRequestError):
        kv.fork(make_request("nobody", [1]), child)
    with pytest.raises(ValueError):
        kv.fork(parent, child)  # child.num_computed_tokens (0) != parent's (6)
    other.num_computed_tokens = 6
    with pytest.raises(ValueError):
        kv.fork(parent, other)  # already holds blocks
    other.num_computed_tokens = 2
    for t in (9, 10, 11):
        parent.append_output_token(t)
    kv.allocate_slots(parent, 3)  # a step in flight that needed a new block
    before = snapshot(kv)
    child.num_computed_tokens = 6
    with pytest.raises(ValueError):
        kv.fork(parent, child)  # parent holds slots for a step not yet computed
    assert snapshot(kv) == before


def test_freeing_a_request_drops_its_pending_copy():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    parent = make_request("g", [1, 2, 3])
    compute(kv, parent, 3)
    child = make_request("g#1", [1, 2, 3])
    child.num_computed_tokens = 3
    kv.fork(parent, child)
    child.append_output_token(7)
    kv.allocate_slots(child, 1)  # queues a copy into its private block
    kv.free(child)  # e.g. preempted in the same step
    assert kv.take_block_copies() == [] and not kv.rewritten_req_ids


def test_stats_count_each_shared_block_once():
    kv = KVCacheManager(num_blocks=10, block_size=B)
    a = make_request("a", list(range(1, 11)))
    compute(kv, a, 10)  # 3 blocks, 10 slots filled
    b = make_request("b", list(range(1, 9)) + [9])
    hits, _ = kv.get_computed_blocks(b)
    compute(kv, b, 1, hits)  # shares 2 blocks, 1 slot of its own
    s = kv.stats()
    assert s == KVCacheStats(num_blocks=10, num_free_blocks=6, block_size=B, allocated_slots=16,
                             filled_slots=11, logical_slots=19, shared_saved_slots=8,
                             prefix_cache_queries=19, prefix_cache_hits=8)
    assert s.usage == pytest.approx(0.4) and s.utilization == pytest.approx(11 / 16)
    assert s.unfilled_slots == 5 and s.prefix_cache_hit_rate == pytest.approx(8 / 19)


def test_can_fit_and_reset():
    kv = KVCacheManager(num_blocks=4, block_size=B)
    assert kv.can_fit(16) and not kv.can_fit(17)
    a = make_request("a", list(range(1, 10)))
    compute(kv, a, 9)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(1, 10)))) == ([], 0)
