"""The host tier over KV-cache groups: TieredHybridKVCacheManager step by step, and the real
scheduler over random mixes of full and sliding groups with a small host pool.

The random sequences are the grouped scheduler sequences (tests/support/group_sequences.py: n > 1
forks, aborts, preemption by recompute or swap, chunking, asynchronous scheduling) on this
manager, with the TierShadowWorker (tests/support/tier_shadow_worker.py) given the groups'
windows: a slot holds (group, prefix id), host blocks keep what was offloaded, and every read a
group's layers make is checked, so a host hit that brings back other tokens, or another group's
block, fails. After every step: reference counts equal the tables holding each block, the free
queue is exactly the unheld blocks, a sliding group holds no more than its window needs, each
hash is cached by one GPU block and one host block at most, and every host pin is a swapped
request's. At the end both pools are whole, and the outputs are those of the same groups without
a host tier.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.block_pool import read_event
from raypaged.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from raypaged.core.kv_cache_groups import KVCacheGroupSpec
from raypaged.core.request import RequestStatus
from raypaged.core.tiered_hybrid_kv_cache_manager import TieredHybridKVCacheManager
from tests.support.core_fakes import make_request
from tests.support.group_sequences import FAST, SLOW, run_scheduler_on_groups, windows_lists
from tests.support.scheduler_sequences import (
    VOCAB,
    operations,
    run_to_completion,
    scheduler_configs,
    token_at,
)
from tests.support.tier_shadow_worker import TierShadowWorker

FULL, SLIDING = KVCacheGroupSpec(None), KVCacheGroupSpec(4)


def _admit(kv: TieredHybridKVCacheManager, request) -> int:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(request.all_token_ids) - num_hit, hits) is not None
    request.num_computed_tokens = len(request.all_token_ids)
    kv.cache_blocks(request, request.num_computed_tokens)
    return num_hit


# ---- step by step --------------------------------------------------------------------------------

def test_an_evicted_prefix_comes_back_from_the_host_for_every_group():
    # Blocks of 2, a full group and a window of 4: a hit at L blocks needs the full group's L
    # blocks and the sliding group's blocks L-2 and L-1 (positions 2L-3 .. 2L-1).
    kv = TieredHybridKVCacheManager(12, 2, (FULL, SLIDING), num_host_blocks=16)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _admit(kv, first)
    kv.free(first)
    assert kv.take_transfers() is None
    other = make_request("b", [7] * 11)  # 6 blocks a group: evicts every block of a's
    _admit(kv, other)
    offloads = kv.take_transfers()
    assert offloads is not None and not offloads.loads and len(offloads.offloads) == 8
    kv.free(other)
    again = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert kv.get_computed_blocks(again) == ([NULL_BLOCK_ID] * 4, 8)  # all four from the host
    assert kv.get_computed_blocks(make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 10], salt="s")) == ([], 0)
    _admit(kv, again)
    transfers = kv.take_transfers()
    assert transfers is not None and transfers.loads_read_now
    full, sliding = kv.get_group_block_ids("c")
    # The full group's four blocks and the window's two (blocks 2 and 3), nothing before it.
    assert sorted(gpu for _, gpu in transfers.loads) == sorted(full[:4] + sliding[2:4])
    assert sliding[:2] == [NULL_BLOCK_ID] * 2
    stats = kv.stats()
    assert stats.host_cache_hits == 8 and stats.prefix_cache_hits == 8
    assert stats.loaded_bytes == 0  # block_bytes unset: counts only
    kv.free(again)
    kv.tier.check_pins()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_hit_mixes_tiers_per_group():
    kv = TieredHybridKVCacheManager(12, 2, (FULL, SLIDING), num_host_blocks=16)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _admit(kv, first)
    kv.free(first)
    # The free queue now: 4 uncached blocks (2 never used, 2 partial tails), then the sliding
    # group's cached blocks 3, 2, 1, 0, then the full group's: 6 new blocks evict exactly the
    # sliding group's blocks 3 and 2, the window a hit at 4 blocks reads.
    taker = make_request("t", [5] * 6)
    assert kv.allocate_slots(taker, 6) is not None
    offloaded = kv.take_transfers()
    assert offloaded is not None and len(offloaded.offloads) == 2
    kv.free(taker)  # uncached: reused before a's blocks left on the GPU
    again = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8 and NULL_BLOCK_ID not in hits  # the full group: all on the GPU
    assert kv.allocate_slots(again, 1, hits) is not None
    transfers = kv.take_transfers()
    assert transfers is not None
    full, sliding = kv.get_group_block_ids("c")
    assert full[:4] == hits and sorted(gpu for _, gpu in transfers.loads) == sorted(sliding[2:4])
    assert kv.stats().host_cache_hits == 4  # positions 2 and 3: a load in some group


def test_swap_preemption_brings_every_groups_blocks_back():
    kv = TieredHybridKVCacheManager(12, 2, (FULL, SLIDING), enable_prefix_caching=False,
                                    num_host_blocks=8, swap_preemption=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _admit(kv, request)
    kv.free_preempted(request)
    request.num_computed_tokens = 0
    transfers = kv.take_transfers()
    # 4 full blocks: the full group's 4 and the window's 2 of the sliding group.
    assert transfers is not None and len(transfers.offloads) == 6
    assert sum(kv.host_pool.pin_cnt) == 6 and kv.num_swapped_requests == 1
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], 0)
    assert kv.get_computed_blocks(request)[1] == 8
    _admit(kv, request)
    transfers = kv.take_transfers()
    assert transfers is not None and len(transfers.loads) == 6
    assert sum(kv.host_pool.pin_cnt) == 0 and kv.num_swapped_requests == 0
    kv.free(request)
    assert kv.num_free_blocks == 12


def test_swap_recomputes_when_the_window_lost_a_block_it_needs():
    # Window 4, blocks of 2: the step starting at 9 reads positions 6 .. 9 and drops blocks
    # 0 .. 2, but resuming at 8 (4 full blocks) reads positions 5 .. 8: block 2 is gone, and an
    # earlier resumption would read earlier blocks still. Nothing is swapped: it recomputes.
    kv = TieredHybridKVCacheManager(12, 2, (FULL, SLIDING), enable_prefix_caching=False,
                                    num_host_blocks=8, swap_preemption=True)
    request = make_request("a", list(range(1, 10)))
    assert kv.allocate_slots(request, 9) is not None
    request.num_computed_tokens = 9
    request.append_output_token(3)
    assert kv.allocate_slots(request, 1) is not None
    assert kv.get_group_block_ids("a")[1][:4] == [NULL_BLOCK_ID] * 3 + kv.get_group_block_ids("a")[1][3:4]
    kv.free_preempted(request)
    assert kv.take_transfers() is None and kv.num_swapped_requests == 0
    assert kv.num_free_blocks == 12
    # Preempted at 10 instead (its next step), the window at 10 (positions 7 .. 9) is held.
    request = make_request("b", list(range(1, 11)))
    assert kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 10
    request.append_output_token(3)
    assert kv.allocate_slots(request, 1) is not None
    kv.free_preempted(request)
    transfers = kv.take_transfers()
    assert transfers is not None and len(transfers.offloads) == 5 + 2 and kv.num_swapped_requests == 1


def test_the_host_tier_reports_the_routed_groups_blocks_only():
    kv = TieredHybridKVCacheManager(8, 2, (SLIDING, FULL), num_host_blocks=16)  # group 1 routed
    kv.record_cache_events()
    first = make_request("a", [1, 2, 3, 4, 5])
    _admit(kv, first)
    kv.free(first)
    routed = [read_event(e) for e in kv.take_cache_events()]
    assert len(routed) == 2 and all(e.stored and not e.host for e in routed)
    _admit(kv, make_request("b", [7] * 7))  # 8 blocks: every block of a's goes to the host
    assert len(kv.take_transfers().offloads) == 4
    host = [read_event(e) for e in kv.take_cache_events() if read_event(e).host]
    assert sorted(e.hash_value for e in host) == sorted(e.hash_value for e in routed)
    assert all(e.stored for e in host)


# ---- random sequences ----------------------------------------------------------------------------

def check_tiers(kv: TieredHybridKVCacheManager, scheduler) -> None:
    """Every host pin a swapped request's, each hash in one block of each tier at most."""
    kv.tier.check_pins()
    for request_id in kv.tier.swapped:
        assert scheduler.requests[request_id].status is RequestStatus.PREEMPTED
    pool = kv.block_pool
    cached = [b for b in range(kv.num_blocks) if pool.block_hash[b] is not None]
    assert len({pool.block_hash[b].hash_value for b in cached}) == len(cached) == pool.num_cached_blocks
    assert all(pool.get_cached_block(pool.block_hash[b]) == b for b in cached)


def run_tiered_groups(config, windows, ops, seed: int, num_host_blocks: int, swap: bool,
                      with_full: bool) -> None:
    def make_kv(*args, **kwargs) -> TieredHybridKVCacheManager:
        return TieredHybridKVCacheManager(*args, **kwargs, num_host_blocks=num_host_blocks,
                                          swap_preemption=swap)

    def make_worker(*args, **kwargs) -> TierShadowWorker:
        return TierShadowWorker(num_host_blocks, *args, **kwargs)

    kv = run_scheduler_on_groups(config, windows, ops, seed, with_full, make_kv, make_worker, check_tiers)
    assert not kv.tier.swapped and not kv.tier.prefetched and not any(kv.host_pool.pin_cnt)


tier_args = dict(config=scheduler_configs(), windows=windows_lists, ops=operations,
                 seed=st.integers(0, 2**32 - 1), num_host_blocks=st.integers(1, 16),
                 swap=st.booleans(), async_scheduling=st.booleans(), with_full=st.booleans())


@FAST
@given(**tier_args)
def test_tiered_groups_random_sequences(config, windows, ops, seed, num_host_blocks, swap,
                                        async_scheduling, with_full):
    run_tiered_groups(dataclasses.replace(config, async_scheduling=async_scheduling), windows, ops,
                      seed, num_host_blocks, swap, with_full)


@pytest.mark.slow
@SLOW
@given(**tier_args)
def test_tiered_groups_random_sequences_many(config, windows, ops, seed, num_host_blocks, swap,
                                             async_scheduling, with_full):
    run_tiered_groups(dataclasses.replace(config, async_scheduling=async_scheduling), windows, ops,
                      seed, num_host_blocks, swap, with_full)


@st.composite
def prefix_turns(draw):
    """Three turns, each stepped until done: requests sharing a long prefix, then other long
    prompts (they evict the prefix's blocks into the host tier), then the prefix again."""
    prefix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=8, max_size=20))

    def add(prompt: list[int]) -> tuple:
        params = {"max_tokens": draw(st.integers(1, 4)), "ignore_eos": True,
                  "n": draw(st.sampled_from([1, 1, 2]))}
        return ("add", prompt, params, None, 0)

    def tail() -> list[int]:
        return draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5))

    steps = [("step",)] * 30
    return ([add(prefix + tail()) for _ in range(draw(st.integers(1, 2)))] + steps
            + [add(tail() * 4) for _ in range(3)] + steps
            + [add(prefix + tail()) for _ in range(draw(st.integers(1, 2)))])


@st.composite
def turn_configs(draw):
    from raypaged.core.scheduler import SchedulerConfig

    chunked = draw(st.booleans())
    return SchedulerConfig(num_blocks=draw(st.integers(8, 24)), block_size=draw(st.sampled_from([1, 2, 4])),
                           max_num_seqs=draw(st.integers(1, 4)),
                           max_num_batched_tokens=draw(st.integers(4, 16)) if chunked else 40,
                           max_model_len=40, enable_prefix_caching=True, enable_chunked_prefill=chunked,
                           async_scheduling=draw(st.booleans()))


@FAST
@given(config=turn_configs(), windows=windows_lists, ops=prefix_turns(), seed=st.integers(0, 2**32 - 1),
       num_host_blocks=st.integers(8, 40), swap=st.booleans())
def test_a_prefix_evicted_to_the_host_is_hit_again_over_groups(config, windows, ops, seed,
                                                                num_host_blocks, swap):
    run_tiered_groups(config, windows, ops, seed, num_host_blocks, swap, with_full=True)


def outputs_over(config, groups, ops, num_host_blocks: int = 0, swap: bool = False):
    windows = tuple(g.sliding_window for g in groups)
    if num_host_blocks:
        kv: HybridKVCacheManager = TieredHybridKVCacheManager(
            config.num_blocks, config.block_size, groups, config.enable_prefix_caching,
            max_tokens_per_step=config.max_num_batched_tokens, num_host_blocks=num_host_blocks,
            swap_preemption=swap)
        worker = TierShadowWorker(num_host_blocks, config.num_blocks, config.block_size, token_at,
                                  one_behind=config.async_scheduling, windows=windows)
    else:
        kv = HybridKVCacheManager(config.num_blocks, config.block_size, groups,
                                  config.enable_prefix_caching,
                                  max_tokens_per_step=config.max_num_batched_tokens)
        worker = TierShadowWorker(1, config.num_blocks, config.block_size, token_at,
                                  one_behind=config.async_scheduling, windows=windows)
    return run_to_completion(config, ops, kv, worker), worker


@FAST
@given(config=scheduler_configs(), windows=windows_lists, ops=operations,
       num_host_blocks=st.integers(1, 16), swap=st.booleans())
def test_the_host_tier_changes_no_output_over_groups(config, windows, ops, num_host_blocks, swap):
    groups = (FULL,) + tuple(KVCacheGroupSpec(w) for w in windows)
    # A pool every request fits: one that can_fit refuses may still run, chunk by chunk, when
    # the pool happens to have room, and whether it ends LENGTH then depends on timing, with or
    # without a host tier.
    need = sum(g.max_live_blocks(config.block_size, config.max_model_len, config.max_num_batched_tokens)
               for g in groups)
    config = dataclasses.replace(config, num_blocks=max(config.num_blocks, need))
    assert outputs_over(config, groups, ops)[0] == outputs_over(config, groups, ops, num_host_blocks, swap)[0]


def test_swap_preemption_over_groups_loads_instead_of_recomputing():
    """A pool that preempts: with swap the resumed requests load every group's blocks."""
    from raypaged.core.scheduler import SchedulerConfig

    config = SchedulerConfig(num_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=32, enable_prefix_caching=False)
    ops = [("add", [1 + k, 2, 3], {"max_tokens": 12, "ignore_eos": True}, None, 0) for k in range(3)]
    groups = (FULL, SLIDING)
    swapped, worker = outputs_over(config, groups, ops, 24, True)
    assert outputs_over(config, groups, ops)[0] == swapped
    assert worker.num_offloads > 0 and worker.num_loads > 0
