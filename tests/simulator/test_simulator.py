"""The memory simulator: traces, the fake runner, paged vs contiguous on small traces, the CLI."""

from __future__ import annotations

import json

import pytest

from raypaged.cli import main as raypaged_main
from raypaged.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raypaged.core.sampling_params import SamplingParams
from raypaged.simulator.fake_runner import FakeModelRunner, fake_token_id
from raypaged.simulator.simulate import SimConfig, simulate
from raypaged.simulator.traces import SYSTEM_PROMPT_LEN, TRACE_NAMES, make_trace

# Real lengths (max_model_len 2048, ShareGPT-like means) on a pool that holds exactly three
# max_model_len reservations of 128 blocks: small enough for CI, memory-bound for a while.
SMALL = SimConfig(num_blocks=384, block_size=16, max_model_len=2048, max_num_seqs=64,
                  max_num_batched_tokens=2048)
RESERVATION_BLOCKS = 2048 // 16
N = 40


@pytest.fixture(scope="module")
def runs():
    """Every (trace, allocator) pair once for the module: the runs are the expensive part."""
    out = {}
    for name in TRACE_NAMES:
        trace = make_trace(name, N, SMALL.max_model_len, seed=3)
        for allocator in ("paged", "contiguous", "contiguous-oracle"):
            out[name, allocator] = (trace, simulate(trace, allocator, SMALL))
    return out


# ---- traces ----------------------------------------------------------------------------------

def test_traces_are_deterministic_per_seed_and_differ_across_seeds():
    a = make_trace("sharegpt", 50, 2048, seed=7)
    assert a == make_trace("sharegpt", 50, 2048, seed=7)
    assert a != make_trace("sharegpt", 50, 2048, seed=8)


def test_sharegpt_lengths_have_the_target_means_and_a_long_tail():
    trace = make_trace("sharegpt", 4000, 2048, seed=0)
    assert 140 <= trace.mean_prompt_len <= 180
    assert 300 <= trace.mean_output_len <= 380
    outputs = sorted(r.output_len for r in trace.requests)
    median, p99 = outputs[len(outputs) // 2], outputs[int(0.99 * len(outputs))]
    assert p99 > 5 * median  # long-tailed, not a bell around the mean
    assert all(r.total_len <= 2048 and r.prompt_len >= 1 and r.output_len >= 1 for r in trace.requests)


def test_shared_prefix_trace_shares_exactly_the_system_prompt():
    trace = make_trace("shared-prefix", 20, 2048, seed=1)
    prefixes = {r.prompt_token_ids[:SYSTEM_PROMPT_LEN] for r in trace.requests}
    assert len(prefixes) == 1
    user_parts = {r.prompt_token_ids[SYSTEM_PROMPT_LEN:] for r in trace.requests}
    assert len(user_parts) == 20 and all(user_parts)


def test_fixed_trace_and_poisson_arrivals():
    trace = make_trace("fixed", 200, 1024, seed=2, arrival_rate=0.5)
    assert {(r.prompt_len, r.output_len) for r in trace.requests} == {(160, 340)}
    steps = [r.arrival_step for r in trace.requests]
    assert steps == sorted(steps) and 300 <= steps[-1] <= 500  # ~ 200 / 0.5
    assert all(r.arrival_step == 0 for r in make_trace("fixed", 5, 1024).requests)


def test_bad_trace_arguments_raise():
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("lmsys", 5, 2048)
    with pytest.raises(ValueError):
        make_trace("fixed", 5, 256)  # 160 + 340 does not fit
    with pytest.raises(ValueError):
        make_trace("sharegpt", 5, 2048, arrival_rate=-1)


def test_trace_request_asks_for_exactly_its_output_length():
    r = make_trace("sharegpt", 1, 2048).requests[0].to_request()
    assert r.sampling_params.ignore_eos and r.sampling_params.max_tokens == make_trace(
        "sharegpt", 1, 2048).requests[0].output_len


# ---- fake runner -----------------------------------------------------------------------------

def test_fake_runner_samples_only_when_a_request_reaches_its_last_token():
    runner = FakeModelRunner()
    params = SamplingParams(max_tokens=4)
    step1 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [5] * 10, 10, params, [0], 0),
                            NewRequestData("b", [6] * 3, 3, params, [1], 0)],
        num_scheduled_tokens={"a": 6, "b": 3}, total_num_scheduled_tokens=9)
    out = runner.execute(step1)
    assert out.req_ids == ["a", "b"]
    assert out.sampled_token_ids == [[], [fake_token_id("b", 3)]]  # a's chunk stops short
    step2 = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a", "b"], [[5] * 4, [out.sampled_token_ids[1][0]]],
                                                [[], []], [6, 3]),
        num_scheduled_tokens={"a": 4, "b": 1}, total_num_scheduled_tokens=5)
    assert runner.execute(step2).sampled_token_ids == [[fake_token_id("a", 10)], [fake_token_id("b", 4)]]
    runner.execute(SchedulerOutput(finished_req_ids={"a"}, preempted_req_ids={"b"}))
    assert runner.num_requests == 0


def test_fake_runner_rejects_a_step_past_the_last_token():
    runner = FakeModelRunner()
    bad = SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", [5] * 3, 3, SamplingParams(), [0], 0)],
                          num_scheduled_tokens={"a": 4}, total_num_scheduled_tokens=4)
    with pytest.raises(RuntimeError, match="past its last token"):
        runner.execute(bad)


# ---- paged vs contiguous ---------------------------------------------------------------------

def test_paged_utilization_is_high_and_contiguous_far_lower(runs):
    for name in TRACE_NAMES:
        paged = runs[name, "paged"][1]
        contiguous = runs[name, "contiguous"][1]
        assert paged.kv_utilization(saturated=True) >= 0.90, name
        assert contiguous.kv_utilization(saturated=True) <= 0.6 * paged.kv_utilization(saturated=True), name


def test_paged_waste_per_request_stays_under_one_block(runs):
    for name in TRACE_NAMES:
        assert runs[name, "paged"][1].max_unfilled_per_request < SMALL.block_size, name
    # A max-length reservation wastes far more than a block on some request.
    assert runs["sharegpt", "contiguous"][1].max_unfilled_per_request > 4 * SMALL.block_size


def test_paged_runs_more_requests_at_once_and_drains_sooner(runs):
    for name in TRACE_NAMES:
        paged, contiguous = runs[name, "paged"][1], runs[name, "contiguous"][1]
        assert contiguous.peak_running == SMALL.num_blocks // RESERVATION_BLOCKS
        assert paged.peak_running > 2 * contiguous.peak_running, name
        assert paged.steps_to_drain < contiguous.steps_to_drain, name


def test_both_generate_every_requested_token_and_leave_the_pool_whole(runs):
    for (name, allocator), (trace, result) in runs.items():
        assert result.output_tokens == trace.total_output_tokens, (name, allocator)
        assert result.pool_whole_at_end, (name, allocator)


def test_every_step_splits_the_whole_pool_into_non_negative_parts(runs):
    for (name, allocator), (_, result) in runs.items():
        for sample in result.samples:
            assert min(sample.slots.values()) >= 0, (name, allocator, sample)
            assert sum(sample.slots.values()) == result.pool_slots, (name, allocator, sample)


def test_fragmentation_shows_where_it_should(runs):
    for name in TRACE_NAMES:
        assert runs[name, "paged"][1].pool_share("external_fragmentation") == 0.0
        assert runs[name, "contiguous"][1].preemptions == 0  # a reservation never runs out
    # The pool holds three max_model_len reservations exactly: no remainder to strand...
    assert runs["sharegpt", "contiguous"][1].pool_share("external_fragmentation") == 0.0
    # ...but variable-size (oracle) reservations leave holes too short for the next request.
    assert runs["sharegpt", "contiguous-oracle"][1].pool_share("external_fragmentation", True) > 0.005


def test_prefix_sharing_saves_the_system_prompt_on_the_shared_prefix_trace(runs):
    paged = runs["shared-prefix", "paged"][1]
    full_shared_blocks = SYSTEM_PROMPT_LEN // SMALL.block_size
    # Each extra running request reuses the prompt's full blocks instead of holding its own copy.
    assert paged.peak_shared_saved_slots >= full_shared_blocks * SMALL.block_size * (paged.peak_running // 2)
    assert paged.prefix_cache_hit_tokens >= (N - paged.peak_running) * full_shared_blocks * SMALL.block_size
    assert runs["sharegpt", "paged"][1].peak_shared_saved_slots == 0  # random prompts share nothing
    assert runs["shared-prefix", "contiguous"][1].peak_shared_saved_slots == 0


def test_simulation_is_deterministic(runs):
    trace, first = runs["sharegpt", "paged"]
    again = simulate(trace, "paged", SMALL)
    assert again.summary() == first.summary()
    assert [s.slots for s in again.samples] == [s.slots for s in first.samples]


def test_poisson_arrivals_drain_and_are_not_saturated_at_a_light_rate():
    trace = make_trace("sharegpt", 20, SMALL.max_model_len, seed=4, arrival_rate=0.005)
    result = simulate(trace, "paged", SMALL)
    assert result.output_tokens == trace.total_output_tokens and result.pool_whole_at_end
    assert result.steps_to_drain > trace.requests[-1].arrival_step
    assert result.engine_steps < result.steps_to_drain  # idle gaps between arrivals were skipped


def test_simulate_rejects_a_trace_longer_than_the_model():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate(make_trace("sharegpt", 3, 4096), "paged", SMALL)
    with pytest.raises(ValueError, match="unknown allocator"):
        simulate(make_trace("sharegpt", 3, 512), "buddy", SMALL)


# ---- CLI -------------------------------------------------------------------------------------

@pytest.mark.integration
def test_cli_runs_end_to_end_without_plot(tmp_path, capsys):
    rc = raypaged_main(["simulate", "--trace", "fixed", "--num-requests", "8", "--num-blocks", "256",
                        "--out", str(tmp_path), "--no-plot", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "paged" in printed and "contiguous" in printed and "PagedAttention paper" in printed
    record = json.loads((tmp_path / "simulate_memory.json").read_text())
    assert {r["allocator"] for r in record["results"]} == {
        "paged", "contiguous", "contiguous-pow2", "contiguous-oracle"}
    assert record["traces"][0]["total_output_tokens"] == 8 * 340
    assert all(r["output_tokens"] == 8 * 340 for r in record["results"])
    assert record["command"].startswith("raypaged simulate --trace fixed")
    assert not (tmp_path / "simulate_memory.png").exists()


def test_cli_reports_an_impossible_size_as_an_error(tmp_path, capsys):
    def run(num_blocks: str, allocator: str) -> int:
        return raypaged_main(["simulate", "--trace", "fixed", "--num-requests", "2", "--num-blocks",
                              num_blocks, "--out", str(tmp_path), "--no-progress", "--allocators", allocator])

    # 100 blocks of 16 slots hold a 160-token prompt, not a 2048-token reservation.
    assert run("100", "contiguous") == 2
    assert "no request could run" in capsys.readouterr().err
    assert run("5", "paged") == 2
    assert "larger than the whole KV cache" in capsys.readouterr().err
    assert not (tmp_path / "simulate_memory.json").exists()


def test_plot_is_written(runs, tmp_path):
    from raypaged.simulator.plot import save_plot

    save_plot([result for _, result in runs.values()], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration  # git rev-parse for the record's commit
def test_cli_fp8_kv_holds_twice_the_blocks_in_the_same_memory(tmp_path, capsys):
    rc = raypaged_main(["simulate", "--trace", "fixed", "--num-requests", "8", "--num-blocks", "256",
                        "--kv-cache-dtype", "fp8", "--allocators", "paged", "--out", str(tmp_path),
                        "--no-plot", "--no-progress"])
    assert rc == 0
    assert "KV cache fp8: 512 blocks in the memory of 256 16-bit ones" in capsys.readouterr().out
    record = json.loads((tmp_path / "simulate_memory.json").read_text())
    assert "--kv-cache-dtype fp8" in record["command"]
    assert '"num_blocks": 512' in json.dumps(record)
