"""Scheduler preemption: recompute of the newest (or, under priority, the least important)
request when the pool runs out, a resumed request sent whole, and priority order.

A ShadowWorker (core_fakes) applies every SchedulerOutput as a worker would and checks that each
request reads back its own K/V; check_invariants recomputes all bookkeeping after every step.
"""

from raypaged.core.request import FinishReason, RequestStatus
from tests.support.scheduler_harness import Harness

# ---- preemption ------------------------------------------------------------------------------------

def test_preemption_recomputes_the_newest_request():
    h = Harness(num_blocks=4, max_num_batched_tokens=16)
    a = h.add("a", [1, 2, 3, 4, 5, 6], max_tokens=8)
    b = h.add("b", [11, 12, 13, 14, 15], max_tokens=8)
    h.step()  # a: 6 tokens in 2 blocks, b: 5 in 2 — the pool is full
    h.step()  # both decode inside their last blocks
    h.step()
    out, _ = h.step()  # a's 9th token needs a third block: b (newest) is preempted
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert list(h.scheduler.waiting)[0] is b
    outputs_b = list(b.output_token_ids)
    h.drain()
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert b.output_token_ids[: len(outputs_b)] == outputs_b


def test_a_resumed_request_is_sent_whole_and_hits_the_prefix_cache():
    h = Harness(num_blocks=5, max_num_batched_tokens=16)
    h.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=6)
    b = h.add("b", [21, 22, 23, 24, 25, 26, 27], max_tokens=6)
    resumed = None
    for _ in range(20):
        out, _ = h.step()
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and b.num_preemptions:
                resumed = new
        if resumed:
            break
    assert resumed is not None
    assert resumed.token_ids[: len(b.prompt_token_ids)] == b.prompt_token_ids
    assert len(resumed.token_ids) > b.num_prompt_tokens  # prompt + outputs so far
    assert resumed.num_computed_tokens == 4  # its first full block was still cached
    h.drain()


def test_a_request_that_outgrows_the_pool_ends_with_length():
    h = Harness(num_blocks=2, max_model_len=64)
    request = h.add("a", [1, 2, 3, 4, 5], max_tokens=40)
    finished = h.drain()
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 9  # 8 slots computed, the 9th could never get one


# ---- priority --------------------------------------------------------------------------------------

def test_priority_runs_the_most_important_first_and_preempts_the_least():
    h = Harness(policy="priority", num_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    h.add("low", [1, 2, 3, 4, 5, 6], priority=5, max_tokens=20, arrival=0.0)
    h.add("mid", [7, 8, 9], priority=3, max_tokens=20, arrival=1.0)
    out, _ = h.step()
    assert list(out.num_scheduled_tokens) == ["mid", "low"][: len(out.num_scheduled_tokens)]
    h.step()
    # A more important request arrives: the batch is full, so it takes low's place.
    h.add("high", [4, 4, 4], priority=0, max_tokens=2, arrival=2.0)
    out, _ = h.step()
    assert "high" in out.num_scheduled_tokens and "low" in out.preempted_req_ids
    finished = h.drain()
    assert set(finished) == {"low", "mid", "high"}


def test_fcfs_waiting_requests_never_preempt():
    h = Harness(num_blocks=3, max_num_batched_tokens=16)
    h.add("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=3)
    h.step()
    h.add("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], priority=-10, max_tokens=2)
    out, _ = h.step()
    assert out.preempted_req_ids == set() and "b" not in out.num_scheduled_tokens
    h.drain()
