"""The host tier of KV blocks: HostBlockPool, TieredKVCacheManager, and random scheduler
sequences over both tiers.

The sequences are test_properties.py's (tests/support/scheduler_sequences.py), run with a
TieredKVCacheManager (a small host pool, recompute or swap preemption) and a TierShadowWorker
(tests/support/tier_shadow_worker.py), a ShadowWorker that also keeps host blocks and applies
each step's transfers (offloads, then loads) before its forward: its check that every K/V read is
the reader's own prefix is what proves a host hit only ever brings back the same tokens. After
every step both tiers' invariants hold; at the end both pools are whole (GPU blocks all free, host
blocks free or cached and none pinned); and the outputs (tokens drawn as a function of request
and position) are the same as without a host tier.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.block_pool import hash_block_tokens
from raypaged.core.host_block_pool import HostBlockPool
from raypaged.core.request import RequestStatus
from raypaged.core.scheduler import SchedulerConfig
from raypaged.core.tiered_kv_cache_manager import TieredKVCacheManager
from tests.support.core_fakes import make_request
from tests.support.scheduler_sequences import (
    FAST,
    SLOW,
    operations,
    run_scheduler_sequence,
    run_to_completion,
    scheduler_configs,
    token_at,
)
from tests.support.tier_shadow_worker import TierShadowWorker


def h(tokens, parent=None, salt=None):
    return hash_block_tokens(parent, tuple(tokens), (salt,) if salt else None)


# ---- HostBlockPool -------------------------------------------------------------------------------

def test_host_pool_stores_once_per_hash_and_evicts_lru_unpinned():
    pool = HostBlockPool(2)
    a, b, c = h([1]), h([2]), h([3])
    assert pool.store(a) == (0, True)
    assert pool.store(a) == (0, False)  # already there: no copy, one more pin
    pool.unpin([0, 0])
    assert pool.store(b) == (1, True)
    pool.unpin([1])
    pool.touch(0)  # a hit: a is now the most recent, b is evicted first
    assert pool.store(c) == (1, True)
    assert pool.get_cached_block(b) is None and pool.get_cached_block(a) == 0 and pool.get_cached_block(c) == 1
    pool.check()
    pool.pin(0)  # a pinned too (c still is, by its store): nothing can be evicted
    assert pool.store(h([4])) is None
    pool.unpin([0])
    assert pool.store(h([4])) == (0, True)  # a, the one unpinned block
    pool.check()


def test_host_lookup_compares_the_whole_hash():
    pool = HostBlockPool(2)
    pool.store(h([1, 2], salt="tenant-a"))
    assert pool.get_cached_block(h([1, 2], salt="tenant-b")) is None
    assert pool.get_cached_block(h([1, 2])) is None
    assert pool.get_cached_block(h([1, 2], salt="tenant-a")) == 0


def test_unpinning_an_unpinned_block_is_an_error():
    pool = HostBlockPool(1)
    with pytest.raises(ValueError):
        pool.unpin([0])
    with pytest.raises(ValueError):
        pool.pin(0)


# ---- the manager, step by step -------------------------------------------------------------------

def _admit(kv: TieredKVCacheManager, request):
    hits, num_hit = kv.get_computed_blocks(request)
    blocks = kv.allocate_slots(request, len(request.all_token_ids) - num_hit, hits)
    assert blocks is not None
    request.num_computed_tokens = len(request.all_token_ids)
    kv.cache_blocks(request, request.num_computed_tokens)
    return num_hit


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    kv = TieredKVCacheManager(4, 2, num_host_blocks=4)
    first = make_request("a", [1, 2, 3, 4, 5])
    _admit(kv, first)  # 3 blocks, two full ones cached
    kv.free(first)
    assert kv.take_transfers() is None
    other = make_request("b", [7, 7, 7, 7, 7, 7, 7])  # 4 blocks: evicts a's cached blocks
    _admit(kv, other)
    transfers = kv.take_transfers()
    assert transfers is not None and not transfers.loads
    host_of = dict(transfers.offloads)  # a's GPU block -> the host block it went to
    assert sorted(host_of) == [0, 1]  # a's two full blocks
    kv.free(other)
    again = make_request("c", [1, 2, 3, 4, 6])
    assert kv.get_computed_blocks(again) == ([], 4)  # both from the host tier
    assert kv.get_computed_blocks(make_request("d", [1, 2, 3, 4, 6], salt="s")) == ([], 0)
    _admit(kv, again)
    transfers = kv.take_transfers()
    assert transfers is not None  # (its offloads: b's cached blocks, evicted in turn)
    # a's blocks 0 and 1 were GPU blocks 0 and 1: each comes back from where it went.
    assert [host for host, _ in transfers.loads] == [host_of[0], host_of[1]]
    assert [gpu for _, gpu in transfers.loads] == kv.get_block_ids("c")[:2]
    stats = kv.stats()
    assert stats.host_cache_hits == 4 and stats.prefix_cache_hits == 4
    kv.free(again)
    kv.host_pool.check()
    assert all(p == 0 for p in kv.host_pool.pin_cnt)


def test_swap_preemption_pins_the_blocks_until_resumption():
    kv = TieredKVCacheManager(4, 2, enable_prefix_caching=False, num_host_blocks=2,
                              swap_preemption=True)
    request = make_request("a", [1, 2, 3, 4, 5])
    _admit(kv, request)
    kv.free_preempted(request)
    request.num_computed_tokens = 0
    transfers = kv.take_transfers()
    assert transfers is not None and len(transfers.offloads) == 2
    assert kv.host_pool.pin_cnt == [1, 1]  # pinned for the waiting request
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)  # not shared
    assert kv.get_computed_blocks(request) == ([], 4)
    _admit(kv, request)
    transfers = kv.take_transfers()
    assert transfers is not None and len(transfers.loads) == 2
    assert kv.host_pool.pin_cnt == [0, 0]
    kv.free(request)
    assert kv.num_free_blocks == 4


# ---- random sequences over both tiers ------------------------------------------------------------

def check_host_tier(scheduler) -> None:
    kv = scheduler.kv_cache_manager
    kv.tier.check_pins()
    for request_id in kv.tier.swapped:
        assert scheduler.requests[request_id].status is RequestStatus.PREEMPTED


def tiered(config: SchedulerConfig, num_host_blocks: int, swap: bool) -> TieredKVCacheManager:
    return TieredKVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                num_host_blocks=num_host_blocks, swap_preemption=swap)


def run_tiered_sequence(config: SchedulerConfig, ops, seed: int, num_host_blocks: int, swap: bool) -> None:
    scheduler = run_scheduler_sequence(
        config, ops, seed, tiered(config, num_host_blocks, swap),
        make_worker=lambda *args, **kwargs: TierShadowWorker(num_host_blocks, *args, **kwargs),
        check_more=check_host_tier)
    kv = scheduler.kv_cache_manager
    assert not kv.tier.swapped and not kv.tier.prefetched and all(p == 0 for p in kv.host_pool.pin_cnt)


@FAST
@given(config=scheduler_configs(), ops=operations, seed=st.integers(0, 2**32 - 1),
       num_host_blocks=st.integers(1, 12), swap=st.booleans(), async_scheduling=st.booleans())
def test_tiered_random_sequences(config, ops, seed, num_host_blocks, swap, async_scheduling):
    run_tiered_sequence(dataclasses.replace(config, async_scheduling=async_scheduling), ops, seed,
                        num_host_blocks, swap)


@pytest.mark.slow
@SLOW
@given(config=scheduler_configs(), ops=operations, seed=st.integers(0, 2**32 - 1),
       num_host_blocks=st.integers(1, 12), swap=st.booleans(), async_scheduling=st.booleans())
def test_tiered_random_sequences_many(config, ops, seed, num_host_blocks, swap, async_scheduling):
    run_tiered_sequence(dataclasses.replace(config, async_scheduling=async_scheduling), ops, seed,
                        num_host_blocks, swap)


def tiered_outputs(config: SchedulerConfig, ops, num_host_blocks: int, swap: bool):
    worker = TierShadowWorker(num_host_blocks, config.num_blocks, config.block_size, token_at,
                              one_behind=config.async_scheduling)
    return run_to_completion(config, ops, tiered(config, num_host_blocks, swap), worker), worker


@FAST
@given(config=scheduler_configs(), ops=operations, num_host_blocks=st.integers(1, 12), swap=st.booleans())
def test_the_host_tier_changes_no_output(config, ops, num_host_blocks, swap):
    assert run_to_completion(config, ops) == tiered_outputs(config, ops, num_host_blocks, swap)[0]


def test_swap_preemption_loads_instead_of_recomputing():
    """A pool that preempts: with swap preemption the resumed requests load their blocks."""
    config = SchedulerConfig(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=32, enable_prefix_caching=False)
    ops = [("add", [1 + k, 2, 3, 4, 5, 6], {"max_tokens": 6, "ignore_eos": True}, None, 0)
           for k in range(3)]
    swapped, worker = tiered_outputs(config, ops, 12, True)
    assert run_to_completion(config, ops) == swapped
    assert worker.num_offloads > 0 and worker.num_loads > 0
