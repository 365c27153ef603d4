"""Random scheduler sequences: the hypothesis strategies (scheduler configs; adds, steps and
aborts) and the runners that drive the real scheduler through them with every invariant checked
after every step (run_scheduler_sequence) or collect each request's outputs (run_to_completion).

Shared by the property tests of the plain, tiered and grouped KV-cache managers
(tests/core/test_properties.py, test_tiered_kv_cache.py, test_hybrid_kv_cache_manager.py,
test_tiered_hybrid_kv_cache.py), which run the same workloads over other managers and workers.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from raypaged.core.async_scheduler import make_scheduler
from raypaged.core.errors import InvalidRequestError
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


def examples(max_examples: int) -> settings:
    """Hypothesis settings for a property over random sequences: no deadline (a sequence's
    length varies a lot) and no example database (each run draws afresh)."""
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


FAST = examples(100)
SLOW = examples(3000)  # scripts/test-slow


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
