"""Scheduler, n > 1: one prefill then a fork into samples, samples finishing and aborting alone
or as a group, a parent rescheduled before its children, children past max_num_seqs, and a
finishing record for every sample a group promised, whenever it is aborted.

A ShadowWorker (core_fakes) applies every SchedulerOutput as a worker would and checks that each
request reads back its own K/V; check_invariants recomputes all bookkeeping after every step.
"""

import pytest

from raypaged.core.request import FinishReason
from tests.support.core_fakes import check_pool_whole
from tests.support.scheduler_harness import EOS, Harness

# ---- n > 1 ------------------------------------------------------------------------------------------

def test_parallel_sampling_prefills_once_then_forks():
    h = Harness()
    h.add("g", [1, 2, 3, 4, 5, 6], n=3, max_tokens=4, seed=5)
    h.script["g"] = [30, 31, 32]
    out, outputs = h.step()
    assert out.num_scheduled_tokens == {"g": 6}  # one prefill for the group
    assert {rid: o.new_token_ids for rid, o in outputs.items()} == {"g": [30], "g#1": [31], "g#2": [32]}
    assert [outputs[r].sample_index for r in ("g", "g#1", "g#2")] == [0, 1, 2]
    assert all(o.group_id == "g" for o in outputs.values())
    children = [h.scheduler.requests["g#1"], h.scheduler.requests["g#2"]]
    assert children[0].sampling_params.n == 1 and children[0].sampling_params.seed != 5
    kv = h.scheduler.kv_cache_manager
    assert kv.get_block_ids("g#1") == kv.get_block_ids("g")  # shared, not recomputed

    out, _ = h.step()
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert set(new) == {"g#1", "g#2"} and new["g#1"].num_computed_tokens == 6
    assert new["g#1"].token_ids == [1, 2, 3, 4, 5, 6, 31]
    assert out.scheduled_cached_reqs.req_ids == ["g"]
    # Both children copied the shared partial block; the parent, last holder, writes in place.
    assert len(out.block_copies) == 2 and not out.finished_req_ids
    assert new["g#1"].block_ids[0] == kv.get_block_ids("g")[0]
    finished = h.drain()
    assert {rid for rid in finished} == {"g", "g#1", "g#2"}


def test_samples_finish_independently_and_a_group_aborts_together():
    h = Harness()
    h.add("g", [1, 2, 3], n=3, max_tokens=6)
    h.script["g"] = [5, EOS, 6]  # sample 1 ends at once
    _, outputs = h.step()
    assert outputs["g#1"].finish_reason is FinishReason.STOP
    assert "g#1" not in h.scheduler.requests and "g#2" in h.scheduler.requests
    h.step()
    aborted = h.scheduler.abort_requests("g")
    assert sorted(o.req_id for o in aborted) == ["g", "g#2"]
    h.step()
    check_pool_whole(h.scheduler)


def test_a_parent_scheduled_before_its_children_copies_and_is_resent():
    h = Harness()
    h.add("g", [1, 2, 3, 4, 5, 6], n=2, max_tokens=4)
    h.step()
    running = h.scheduler.running
    running.reverse()  # parent first: it finds its partial block still shared
    out, _ = h.step()
    assert "g" in out.finished_req_ids  # dropped and sent again whole with its new table
    assert {n.req_id for n in out.scheduled_new_reqs} == {"g", "g#1"}
    assert len(out.block_copies) == 1
    h.drain()


def test_children_beyond_max_num_seqs_wait_and_recompute():
    h = Harness(max_num_seqs=2)
    h.add("g", [1, 2, 3, 4, 5], n=4, max_tokens=3)
    h.step()
    assert h.scheduler.num_running == 2 and h.scheduler.num_waiting == 2
    assert all(r.num_computed_tokens == 0 for r in h.scheduler.waiting)
    finished = h.drain()
    assert set(finished) == {"g", "g#1", "g#2", "g#3"}
    assert all(o.finish_reason is FinishReason.LENGTH for o in finished.values())


def test_sample_zero_can_be_aborted_alone():
    h = Harness()
    h.add("g", [1, 2, 3, 4, 5], n=3, max_tokens=8, ignore_eos=True)
    h.step()  # prefill once, fork
    assert sorted(h.scheduler.requests) == ["g", "g#1", "g#2"]
    [out] = h.scheduler.abort_requests("g#0")
    assert (out.req_id, out.sample_index, out.finish_reason) == ("g", 0, FinishReason.ABORT)
    assert sorted(h.scheduler.requests) == ["g#1", "g#2"]
    finished = h.drain()
    assert sorted(finished) == ["g#1", "g#2"]


# ---- a group ends with a record for every sample (issue 24) -----------------------------------------

def _finishing(outputs) -> dict[int, FinishReason]:
    return {o.sample_index: o.finish_reason for o in outputs if o.finished}


@pytest.mark.parametrize("moment", ["waiting", "mid_prefill", "fork_step_running", "after_fork"])
def test_an_aborted_group_ends_every_sample_it_promised(moment):
    """Whatever the moment of the abort, every sample index 0..n-1 gets one finishing record:
    before the fork the samples 1..n-1 exist nowhere but in the client's count."""
    h = Harness(max_num_seqs=4, max_num_batched_tokens=4, enable_chunked_prefill=True)
    h.add("g", list(range(1, 11)), n=3, max_tokens=8, ignore_eos=True)
    finished: dict[int, FinishReason] = {}
    if moment == "mid_prefill":
        _, outputs = h.step()  # 4 of its 10 prompt tokens
        assert not outputs and h.scheduler.requests["g"].num_computed_tokens == 4
    if moment == "fork_step_running":
        h.step(), h.step()
        out = h.scheduler.schedule()  # the prompt's last chunk: the step that forks
        runner_output = h.worker.execute(out)
        finished.update(_finishing(h.scheduler.abort_requests("g")))
        finished.update(_finishing(h.scheduler.update_from_output(out, runner_output)))
    else:
        if moment == "after_fork":
            for _ in range(3):
                h.step()
            assert sorted(h.scheduler.requests) == ["g", "g#1", "g#2"]
        finished.update(_finishing(h.scheduler.abort_requests("g")))
    assert finished == {0: FinishReason.ABORT, 1: FinishReason.ABORT, 2: FinishReason.ABORT}
    assert not h.drain()  # nothing left to run; drain checks every block is back


def test_sample_zero_aborted_before_the_fork_ends_the_group():
    """Sample 0 alone, before it forked: its siblings can never be born, so they end too."""
    h = Harness()
    h.add("g", [1, 2, 3], n=2, max_tokens=8)
    outputs = h.scheduler.abort_requests("g#0")
    assert [(o.req_id, o.sample_index, o.finish_reason) for o in outputs] == [
        ("g", 0, FinishReason.ABORT), ("g#1", 1, FinishReason.ABORT)]
    assert not h.scheduler.has_unfinished_requests()
