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

Default runs are small; `scripts/test-slow` (pytest -m slow) runs thousands of sequences.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raypaged.core.async_scheduler import make_scheduler
from raypaged.core.block_pool import BlockPool, hash_block_tokens
from raypaged.core.errors import InvalidRequestError, NoFreeBlocksError
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_fakes import (
    OutputLog,
    ShadowEngine,
    ShadowWorker,
    check_invariants,
    check_pool_whole,
    make_request,
)

EOS, STOP_ID, VOCAB = 0, 5, 8
PREFIXES = ([1, 2, 3, 4, 1, 2, 3, 4, 6, 7, 1, 2], [3, 3, 3, 3, 3, 3], [])

FAST = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=3000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def scheduler_configs(draw):
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(8, 40))
    return SchedulerConfig(
        num_blocks=draw(st.integers(3, 24)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=(draw(st.integers(1, 24)) if chunked
                                else max_model_len + draw(st.integers(0, 8))),
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


@st.composite
def add_ops(draw):
    prefix = draw(st.sampled_from(PREFIXES))
    prompt = prefix[: draw(st.integers(0, len(prefix)))] + draw(
        st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=10))
    max_tokens = draw(st.integers(1, 12))
    params = dict(n=draw(st.sampled_from([1, 1, 2, 3])), max_tokens=max_tokens,
                  min_tokens=draw(st.integers(0, min(2, max_tokens))),
                  ignore_eos=draw(st.booleans()),
                  stop_token_ids=draw(st.sampled_from([(), (STOP_ID,)])),
                  logprobs=draw(st.sampled_from([None, None, 1])))
    return ("add", prompt or [1], params, draw(st.sampled_from([None, None, "salt"])),
            draw(st.integers(0, 2)))


operations = st.lists(st.one_of(add_ops(), add_ops(), st.just(("step",)), st.just(("step",)),
                                st.just(("step",)), st.tuples(st.just("abort"), st.integers(0, 50))),
                      min_size=4, max_size=60)


def run_scheduler_sequence(config: SchedulerConfig, ops, seed: int, kv_cache_manager=None,
                           make_worker: Callable[..., ShadowWorker] = ShadowWorker,
                           check_more: Callable[[Scheduler], None] = lambda _: None) -> Scheduler:
    """make_worker(num_blocks, block_size, sample, rng, one_behind=...) builds the worker;
    check_more(scheduler) runs after every check of the invariants. Returns the scheduler."""
    rng = random.Random(seed)
    scheduler = make_scheduler(config, kv_cache_manager)
    worker = make_worker(config.num_blocks, config.block_size, lambda *_: rng.randrange(VOCAB), rng,
                         one_behind=config.async_scheduling)
    stepper = ShadowEngine(scheduler, worker)

    log = OutputLog()

    def check_invariants_and_more():
        check_invariants(scheduler, worker)
        check_more(scheduler)

    def step():
        log.add(stepper.step())
        log.note(scheduler)
        check_invariants_and_more()

    for k, op in enumerate(ops):
        if op[0] == "add":
            _, prompt, params, salt, priority = op
            request = make_request(f"r{k}", prompt, eos=EOS, salt=salt, priority=priority,
                                   arrival=float(k), **params)
            try:
                scheduler.add_request(request)
            except InvalidRequestError:
                assert request.request_id not in scheduler.requests
            log.note(scheduler)
            check_invariants_and_more()
        elif op[0] == "step":
            step()
        elif scheduler.requests:  # abort a live request or a whole group
            ids = sorted(set(scheduler.requests) | set(scheduler._groups))
            log.add(scheduler.abort_requests(ids[op[1] % len(ids)]))
            check_invariants_and_more()
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        step()
    check_pool_whole(scheduler)
    log.check_all_finished(scheduler)
    return scheduler


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


def run_to_completion(config: SchedulerConfig, ops, kv_cache_manager=None,
                      worker: ShadowWorker | None = None) -> dict[str, tuple]:
    """Adds and steps (no aborts: their effect depends on timing), then steps until all end.
    Returns each request's (output tokens, finish reason, stop reason). A worker given must draw
    its tokens with token_at."""
    scheduler = make_scheduler(config, kv_cache_manager)
    if worker is None:
        worker = ShadowWorker(config.num_blocks, config.block_size, token_at,
                              one_behind=config.async_scheduling)
    stepper = ShadowEngine(scheduler, worker)
    log = OutputLog()
    for k, op in enumerate(ops):
        if op[0] == "add":
            _, prompt, params, salt, priority = op
            params = dict(params, n=1)  # n > 1 samples draw the same tokens per position here
            try:
                scheduler.add_request(make_request(f"r{k}", prompt, eos=EOS, salt=salt,
                                                   priority=priority, arrival=float(k), **params))
            except InvalidRequestError:
                pass
            log.note(scheduler)
        elif op[0] == "step":
            log.add(stepper.step())
            log.note(scheduler)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        log.add(stepper.step())
        log.note(scheduler)
    check_pool_whole(scheduler)
    log.check_all_finished(scheduler)
    return {rid: (tuple(log.tokens[rid]), out.finish_reason, out.stop_reason)
            for rid, out in log.finished.items()}


def token_at(req_id: str, position: int) -> int:
    """The token a request samples at a position, wherever and whenever it is computed."""
    return zlib.crc32(f"{req_id}@{position}".encode()) % VOCAB


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
