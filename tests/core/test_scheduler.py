"""Scheduler: validation, the diff the workers get (batching, chunked prefill), stops, abort,
stats and a replaced worker group. Preemption and priority: test_preemption.py; n > 1:
test_parallel_sampling.py.

A ShadowWorker (core_fakes) applies every SchedulerOutput as a worker would and checks that each
request reads back its own K/V; check_invariants recomputes all bookkeeping after every step.
"""

from collections import defaultdict

import pytest

from raypaged.core.async_scheduler import AsyncScheduler, make_scheduler
from raypaged.core.errors import InvalidRequestError, QueueFullError, UnknownRequestError
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput
from raypaged.core.request import FinishReason, RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_fakes import ShadowWorker, check_invariants, check_pool_whole, make_request
from tests.support.scheduler_harness import EOS, Harness


def state(scheduler: Scheduler):
    return (sorted(scheduler.requests), [r.request_id for r in scheduler.waiting],
            [r.request_id for r in scheduler.running], sorted(scheduler._groups),
            scheduler.kv_cache_manager.stats())


# ---- add_request validation -------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: make_request("a", [1, 2]), "already in use"),
    (lambda: make_request("b", []), "empty prompt"),
    (lambda: make_request("c", list(range(1, 17))), "max_model_len"),
    (lambda: make_request("d", [1, -2]), "non-negative"),
    (lambda: make_request("e", [1, 2.0]), "non-negative"),
    (lambda: make_request("f", [1], priority=1.5), "priority"),
    (lambda: make_request("a#1", [1]), "reserved"),
    (lambda: make_request("x", [1], n=3), "already in use"),  # its sample x#2 exists
    ("not a request", "expected a Request"),
])
def test_invalid_requests_change_nothing(make, message):
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16))
    scheduler.add_request(make_request("a", [1, 2], n=2))
    scheduler.add_request(make_request("x#2", [5]))
    before = state(scheduler)
    with pytest.raises(InvalidRequestError, match=message):
        scheduler.add_request(make() if callable(make) else make)
    assert state(scheduler) == before


def test_prompt_larger_than_the_whole_pool_is_refused():
    scheduler = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=64))
    with pytest.raises(InvalidRequestError, match="larger than the whole KV cache"):
        scheduler.add_request(make_request("a", list(range(1, 10))))
    scheduler.add_request(make_request("b", list(range(1, 9))))  # exactly the pool


def test_queue_bound_raises_a_distinct_error():
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, max_waiting_requests=2))
    scheduler.add_request(make_request("a", [1]))
    scheduler.add_request(make_request("b", [1]))
    before = state(scheduler)
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("c", [1]))
    assert issubclass(QueueFullError, InvalidRequestError)
    assert state(scheduler) == before


@pytest.mark.parametrize("config", [
    dict(num_blocks=0), dict(num_blocks=4, block_size=0), dict(num_blocks=4, policy="lifo"),
    dict(num_blocks=4, max_waiting_requests=-1),
    dict(num_blocks=4, enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200),
])
def test_bad_config(config):
    with pytest.raises(ValueError):
        SchedulerConfig(**config)


def test_the_scheduler_class_follows_async_scheduling():
    assert type(make_scheduler(SchedulerConfig(num_blocks=8))) is Scheduler
    assert type(make_scheduler(SchedulerConfig(num_blocks=8, async_scheduling=True))) is AsyncScheduler
    with pytest.raises(ValueError, match="make_scheduler"):
        Scheduler(SchedulerConfig(num_blocks=8, async_scheduling=True))
    with pytest.raises(ValueError, match="make_scheduler"):
        AsyncScheduler(SchedulerConfig(num_blocks=8))


def test_injected_manager_must_agree_on_block_size():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(num_blocks=8, block_size=16), KVCacheManager(8, 8))


# ---- the diff the workers get -----------------------------------------------------------------------

def test_prefill_then_decode_diff():
    h = Harness()
    h.add("a", [1, 2, 3, 4, 5, 6], max_tokens=5)
    h.script["a"] = [11, 12, 13]
    out, outputs = h.step()
    (new,) = out.scheduled_new_reqs
    assert new.token_ids == [1, 2, 3, 4, 5, 6] and new.num_computed_tokens == 0
    assert new.block_ids == h.scheduler.kv_cache_manager.get_block_ids("a") and len(new.block_ids) == 2
    assert out.num_scheduled_tokens == {"a": 6} and out.total_num_scheduled_tokens == 6
    assert outputs["a"].new_token_ids == [11] and outputs["a"].num_prompt_tokens == 6
    out, outputs = h.step()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.new_token_ids == [[11]]
    assert cached.num_computed_tokens == [6] and cached.new_block_ids == [[]]
    out, _ = h.step()  # position 7 fills block 2; position 8 starts block 3
    out, _ = h.step()
    assert len(out.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert h.drain()["a"].finish_reason is FinishReason.LENGTH


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    h = Harness(max_num_batched_tokens=4)
    h.add("a", list(range(1, 11)), max_tokens=2)
    chunks = []
    for _ in range(3):
        out, outputs = h.step()
        chunks.append(out.num_scheduled_tokens["a"])
        assert ("a" in outputs) == (len(chunks) == 3)  # a token only when the prompt completes
    assert chunks == [4, 4, 2]
    out, _ = h.step()
    assert out.scheduled_cached_reqs.new_token_ids == [[7]]


def test_running_decodes_come_before_waiting_prefills_under_the_budget():
    h = Harness(max_num_batched_tokens=5)
    h.add("a", [1, 2, 3], max_tokens=10)
    h.step()
    h.add("b", list(range(1, 11)), max_tokens=1)
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    h = Harness(max_num_batched_tokens=64, enable_chunked_prefill=False)
    h.add("a", list(range(1, 40)), max_tokens=3)
    h.add("b", list(range(100, 129)), max_tokens=3)
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 39}  # b's 29 do not fit the 25 left
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 29}
    h.drain()


def test_max_num_seqs_caps_the_batch():
    h = Harness(max_num_seqs=2)
    for rid in "abc":
        h.add(rid, [1, 2], max_tokens=3)
    out, _ = h.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and h.scheduler.num_waiting == 1
    assert set(h.drain()) == {"a", "b", "c"}


# ---- stop conditions --------------------------------------------------------------------------------

@pytest.mark.parametrize("params, script, reason, stop_reason, num_tokens", [
    (dict(max_tokens=10), [5, EOS], FinishReason.STOP, None, 2),
    (dict(max_tokens=10, ignore_eos=True), [5, EOS, 6], FinishReason.LENGTH, None, 10),
    (dict(max_tokens=10, stop_token_ids=[9]), [5, 9], FinishReason.STOP, 9, 2),
    (dict(max_tokens=10, min_tokens=3, stop_token_ids=[9]), [EOS, 9, 9, 9], FinishReason.STOP, 9, 3),
    (dict(max_tokens=3), [], FinishReason.LENGTH, None, 3),
    (dict(max_tokens=50), [], FinishReason.LENGTH, None, 12),  # max_model_len 16, prompt 4
])
def test_stop_conditions(params, script, reason, stop_reason, num_tokens):
    h = Harness(max_model_len=16)
    request = h.add("a", [1, 2, 3, 4], **params)
    h.script["a"] = list(script)
    finished = h.drain()
    assert finished["a"].finish_reason is reason and finished["a"].stop_reason == stop_reason
    assert request.num_output_tokens == num_tokens and request.status is RequestStatus.FINISHED


def test_finished_blocks_are_freed_at_once_and_dropped_next_step():
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=1)
    h.add("b", [1, 2, 3], max_tokens=5)
    _, outputs = h.step()
    assert outputs["a"].finished
    assert h.scheduler.kv_cache_manager.get_block_ids("a") == []
    out, _ = h.step()
    assert out.finished_req_ids == {"a"}
    out, _ = h.step()
    assert out.finished_req_ids == set()


# ---- abort -----------------------------------------------------------------------------------------

def test_abort_in_any_state():
    h = Harness(max_num_seqs=1)
    h.add("run", [1, 2, 3], max_tokens=10)
    h.add("wait", [1, 2], max_tokens=10)
    h.step()
    outputs = h.scheduler.abort_requests(["run", "wait"])
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("run", FinishReason.ABORT),
                                                              ("wait", FinishReason.ABORT)]
    check_invariants(h.scheduler, h.worker)
    out, _ = h.step()
    assert out.finished_req_ids == {"run"}  # the workers never held "wait"
    check_pool_whole(h.scheduler)


def test_abort_unknown_changes_nothing():
    h = Harness()
    h.add("a", [1, 2, 3])
    h.step()
    before = state(h.scheduler)
    with pytest.raises(UnknownRequestError):
        h.scheduler.abort_requests(["a", "nope"])
    assert state(h.scheduler) == before
    assert h.scheduler.abort_requests("a")[0].req_id == "a"  # a bare id works too
    with pytest.raises(UnknownRequestError):
        h.scheduler.abort_requests("a")


def test_abort_while_the_step_runs():
    h = Harness()
    h.add("a", [1, 2, 3])
    out = h.scheduler.schedule()
    runner_output = h.worker.execute(out)
    h.scheduler.abort_requests("a")
    assert list(h.scheduler.update_from_output(out, runner_output)) == []
    out, _ = h.step()
    assert out.finished_req_ids == {"a"}
    check_pool_whole(h.scheduler)


def test_runner_output_must_answer_the_schedule():
    h = Harness()
    h.add("a", [1, 2, 3])
    out = h.scheduler.schedule()
    with pytest.raises(ValueError):
        h.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[1]]))
    with pytest.raises(ValueError):
        h.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[1, 2]]))


# ---- stats and a replaced worker group ---------------------------------------------------------

def test_stats():
    h = Harness()
    h.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    h.add("b", [1, 2, 3], max_tokens=3)
    h.step()
    stats = h.scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (2, 0, 0)
    assert stats.kv_cache.filled_slots == 8 and stats.kv_cache.allocated_slots == 12


def test_reset_workers_recomputes_everything_in_order_on_a_fresh_worker():
    """After the worker group is replaced, every running request is recomputed from prompt +
    outputs (no token lost or repeated), the prefix cache (whose blocks died with the old
    workers) is empty, and the new worker is never told to drop what it never held."""
    h = Harness(num_blocks=32)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    for i in range(3):
        h.add(f"r{i}", shared + [20 + i], max_tokens=6, ignore_eos=True)
    tokens = defaultdict(list)
    for _ in range(3):
        for rid, out in h.step()[1].items():
            tokens[rid].extend(out.new_token_ids)
    assert h.scheduler.kv_cache_manager.block_pool.num_cached_blocks > 0
    h.scheduler.reset_workers()
    assert [r.request_id for r in h.scheduler.waiting] == ["r0", "r1", "r2"]
    assert all(r.num_computed_tokens == 0 for r in h.scheduler.waiting)
    kv = h.scheduler.kv_cache_manager
    assert kv.block_pool.num_cached_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    h.worker = ShadowWorker(32, 4, h._sample)  # the new group holds nothing
    out, outputs = h.step()
    assert not out.finished_req_ids and not out.preempted_req_ids
    assert [new.token_ids[-len(tokens[new.req_id]):] for new in out.scheduled_new_reqs] == \
        [tokens[f"r{i}"] for i in range(3)]
    for rid, o in outputs.items():
        tokens[rid].extend(o.new_token_ids)
    while h.scheduler.has_unfinished_requests():
        for rid, o in h.step()[1].items():
            tokens[rid].extend(o.new_token_ids)
    check_pool_whole(h.scheduler)
    assert {rid: len(t) for rid, t in tokens.items()} == {"r0": 6, "r1": 6, "r2": 6}
