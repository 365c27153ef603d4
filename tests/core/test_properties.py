"""Property tests: random operation sequences against the scheduler, the KV cache manager and the
block pool, with every invariant recomputed from scratch after every step.

The scheduler sequences mix adds (prompts drawn from a few shared prefixes, with and without
salts, n = 1..3, EOS / stop ids / min_tokens / length limits, logprobs or not), steps answered by a ShadowWorker
with random tokens, and aborts of requests and groups, on pools small enough to preempt often.
After each step check_invariants asserts: every block is free or held, reference counts equal
the number of tables holding the block, a block is in two tables only when shared by prefix or
fork (same position, same tokens, same fill), cached blocks hold exactly their hash's tokens,
allocated-but-unfilled slots per request < block_size, the waste accounting matches a brute-force
recount, and the workers' view equals the scheduler's. The ShadowWorker checks that every K/V
read returns the reading request's own prefix (so prefix hits and copy-on-write are right). When
all requests end, the pool must be whole, and the records handed out must have carried every
request's tokens and finish exactly (OutputLog).

The steps are EngineCore's own (ShadowEngine: step, which runs step_with_batch_queue under
asynchronous scheduling). Every sequence also runs under asynchronous scheduling (each step
answered one schedule() later, placeholders filled by the worker), with the same checks; and the
same workload, with tokens drawn as a function of (request, position), must produce
token-identical outputs and finishes with asynchronous scheduling on and off.

The strategies and runners live in tests/support/scheduler_sequences.py (the tiered and grouped
managers' property tests run them too). Default runs are small; `scripts/test-slow` (pytest -m
slow) runs thousands of sequences.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypaged.core.block_pool import BlockPool, hash_block_tokens
from raypaged.core.errors import NoFreeBlocksError
from tests.support.scheduler_sequences import (
    FAST,
    SLOW,
    operations,
    run_scheduler_sequence,
    run_to_completion,
    scheduler_configs,
)


@FAST
@given(config=scheduler_configs(), ops=operations, seed=st.integers(0, 2**32 - 1))
def test_scheduler_random_sequences(config, ops, seed):
    run_scheduler_sequence(config, ops, seed)


@FAST
@given(config=scheduler_configs(), ops=operations, seed=st.integers(0, 2**32 - 1))
def test_scheduler_random_sequences_async(config, ops, seed):
    run_scheduler_sequence(dataclasses.replace(config, async_scheduling=True), ops, seed)


@pytest.mark.slow
@SLOW
@given(config=scheduler_configs(), ops=operations, seed=st.integers(0, 2**32 - 1),
       async_scheduling=st.booleans())
def test_scheduler_random_sequences_many(config, ops, seed, async_scheduling):
    run_scheduler_sequence(dataclasses.replace(config, async_scheduling=async_scheduling), ops, seed)


@FAST
@given(config=scheduler_configs(), ops=operations)
def test_async_scheduling_gives_the_same_outputs(config, ops):
    """Where a request is scheduled may change (it sits out a step, is preempted at another
    time), what it generates must not: every token is a function of its request and position."""
    sync = run_to_completion(config, ops)
    assert sync == run_to_completion(dataclasses.replace(config, async_scheduling=True), ops)


# ---- the block pool against a plain model -----------------------------------------------------------

pool_ops = st.lists(st.tuples(st.sampled_from(["get", "free", "touch", "cache", "reset"]),
                              st.integers(0, 7), st.integers(0, 3)), max_size=60)


def run_pool_sequence(num_blocks: int, ops) -> None:
    pool = BlockPool(num_blocks)
    refs = [0] * num_blocks  # the model: references, and which blocks hold which contents
    contents: dict[int, object] = {}
    for kind, a, b in ops:
        held = [i for i in range(num_blocks) if refs[i]]
        if kind == "get":
            if b > num_blocks - len(held):
                with pytest.raises(NoFreeBlocksError):
                    pool.get_new_blocks(b)
                continue
            for block in pool.get_new_blocks(b):
                assert refs[block] == 0
                refs[block] = 1
                contents.pop(block, None)  # reused: whatever it cached is gone
        elif kind == "free" and held:
            block = held[a % len(held)]
            pool.free_blocks([block])
            refs[block] -= 1
        elif kind == "touch" and contents:
            block = sorted(contents)[a % len(contents)]
            pool.touch([block])
            refs[block] += 1
        elif kind == "cache" and held:
            block = held[a % len(held)]
            h = hash_block_tokens(None, (a, b))
            if block in contents or pool.get_cached_block(h) is not None:
                continue
            assert pool.cache_full_block(block, h)
            contents[block] = h
        elif kind == "reset":
            if pool.reset_prefix_cache():
                assert not held
                contents.clear()
        assert pool.ref_cnt == refs
        free = pool.free_block_ids()
        assert sorted(free) == [i for i in range(num_blocks) if refs[i] == 0]
        # Uncached free blocks are reused before cached ones.
        cached_flags = [block in contents for block in free]
        assert cached_flags == sorted(cached_flags)
        for block, h in contents.items():
            assert pool.get_cached_block(h) == block and pool.block_hash[block] == h
        assert pool.num_cached_blocks == len(contents)


@FAST
@given(num_blocks=st.integers(1, 6), ops=pool_ops)
def test_block_pool_random_sequences(num_blocks, ops):
    run_pool_sequence(num_blocks, ops)


@pytest.mark.slow
@SLOW
@given(num_blocks=st.integers(1, 6), ops=pool_ops)
def test_block_pool_random_sequences_many(num_blocks, ops):
    run_pool_sequence(num_blocks, ops)


@pytest.mark.slow
@SLOW
@given(config=scheduler_configs(), ops=operations)
def test_async_scheduling_gives_the_same_outputs_many(config, ops):
    sync = run_to_completion(config, ops)
    assert sync == run_to_completion(dataclasses.replace(config, async_scheduling=True), ops)
