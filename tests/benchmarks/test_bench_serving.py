"""The serving benchmark's pure parts: percentiles, the Poisson schedule, the client-side timing of
a stream, the per-rate summary, the KV and prefix-cache summaries and the max-rate choice (its
figures come from a real server; here that what it computes is right); and the multi-turn
trace end to end against the demo model, checked against what its plan implies."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time

import grpc
import numpy as np
import pytest

from benchmarks import bench_serving
from benchmarks.bench_serving import trace_requests
from benchmarks.lib.sharegpt import FIRST_ID
from benchmarks.serving_chat import ChatShape, Conversation, plan_conversations
from benchmarks.serving_load import fresh_prompts, poisson_offsets, send
from benchmarks.serving_report import (
    Timing,
    kv_summary,
    max_rate_meeting,
    percentile,
    prefix_cache_summary,
    should_stop,
    summarize_rate,
)
from raypaged.client import CompletionChunk, RequestError, StreamChunk, Usage


@pytest.mark.parametrize("size", [1, 2, 7, 100, 1001])
def test_percentile_is_numpys_linear_method(size):
    rng = random.Random(size)
    values = [rng.lognormvariate(0, 1) for _ in range(size)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert math.isnan(percentile([], 50))


def test_poisson_offsets_start_at_zero_and_have_exponential_gaps():
    offsets = poisson_offsets(20000, rate=8.0, seed="s")
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert min(gaps) >= 0
    # Exponential with mean 1/rate: the standard deviation equals the mean (coefficient of
    # variation 1; evenly spaced sends would give 0).
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.03)
    assert poisson_offsets(50, 8.0, "s") == offsets[:50]  # seeded
    assert poisson_offsets(50, 8.0, "t") != offsets[:50]
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            poisson_offsets(5, bad, "s")


def test_requests_respect_max_total_len_and_prompts_are_fresh_per_rate():
    requests = trace_requests(200, 1024, vocab_size=3072, seed=0, max_total_len=512)
    assert len(requests) == 200
    assert all(len(r.prompt_token_ids) + r.output_len <= 512 for r in requests)
    unfiltered = trace_requests(200, 1024, vocab_size=3072, seed=0, max_total_len=None)
    assert max(len(r.prompt_token_ids) + r.output_len for r in unfiltered) > 512
    first, second = (fresh_prompts(requests, 3072, f"prompts:0:{rate}") for rate in (1.0, 2.0))
    assert [len(p) for p in first] == [len(r.prompt_token_ids) for r in requests]
    assert all(FIRST_ID <= t < 3072 for p in first for t in p)
    # Different ids at each rate, or the prefix cache would serve one rate's prompts from the last.
    assert sum(a[:16] == b[:16] for a, b in zip(first, second)) == 0
    assert first == fresh_prompts(requests, 3072, "prompts:0:1.0")


def rate_result(rate: float, p99_ttft_s: float, errors: int = 0) -> dict:
    return {"rate": rate, "errors": errors, "ttft": {"p99_ms": 1e3 * p99_ttft_s}}


def test_max_rate_is_the_last_before_the_first_miss():
    results = [rate_result(4, 0.2), rate_result(8, 0.6), rate_result(16, 1.5), rate_result(32, 0.9)]
    # 32 passes by luck above a failing 16: not a rate the server sustains.
    assert max_rate_meeting(results, slo_ttft_s=1.0) == 8
    assert max_rate_meeting(list(reversed(results)), slo_ttft_s=1.0) == 8  # order of the list
    assert max_rate_meeting(results, slo_ttft_s=2.0) == 32
    assert max_rate_meeting(results, slo_ttft_s=0.1) is None
    assert max_rate_meeting([rate_result(4, 0.2), rate_result(8, 0.2, errors=1)], 1.0) == 4
    assert max_rate_meeting([rate_result(4, math.nan)], 1.0) is None  # nothing completed
    assert max_rate_meeting([], 1.0) is None


def test_should_stop_past_the_limit_or_on_errors():
    assert not should_stop(rate_result(8, 9.9), stop_ttft_s=10)
    assert should_stop(rate_result(8, 10.1), stop_ttft_s=10)
    assert should_stop(rate_result(8, 0.1, errors=2), stop_ttft_s=10)
    assert should_stop(rate_result(8, math.nan), stop_ttft_s=10)


def stream_chunk(token_ids: list[int], usage: Usage | None = None) -> StreamChunk:
    """What the client yields: one sample's new tokens, the usage on the stream's last."""
    return StreamChunk("r", [CompletionChunk(0, "", token_ids, None, None, None)], usage)


class FakeClient:
    """Streams chunks of the given token counts, each after its delay."""

    def __init__(self, chunks: list[tuple[float, int]]) -> None:
        self.chunks = chunks
        self.asked: dict = {}

    async def stream(self, prompt, **params):
        self.asked = params
        for i, (delay, count) in enumerate(self.chunks):
            await asyncio.sleep(delay)
            last = i == len(self.chunks) - 1
            yield stream_chunk(list(range(100 * i, 100 * i + count)),
                               Usage(len(prompt), 5, 32) if last else None)


def test_send_times_first_token_and_splits_a_chunk_gap_over_its_tokens():
    client = FakeClient([(0.05, 1), (0.0, 0), (0.06, 3), (0.02, 1)])

    timing = asyncio.run(send(client, [5, 6], output_len=5, due=time.perf_counter()))
    assert client.asked == {"max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    assert timing.error is None and timing.output_tokens == 5
    assert 0.05 <= timing.ttft_s < 0.5
    assert len(timing.gaps_s) == 4  # one per token after the first
    assert timing.gaps_s[0] == timing.gaps_s[1] == timing.gaps_s[2] >= 0.06 / 3
    assert timing.gaps_s[3] >= 0.02
    assert timing.e2e_s == pytest.approx(timing.ttft_s + sum(timing.gaps_s), rel=1e-9)

    assert (timing.prompt_tokens, timing.cached_tokens) == (2, 32)  # the usage of the last chunk

    short = asyncio.run(send(FakeClient([(0.0, 2)]), [5], output_len=3, due=time.perf_counter()))
    assert short.error == "2 tokens streamed for max_tokens 3"

    reply: list[int] = [9]
    asyncio.run(send(FakeClient([(0.0, 1), (0.0, 0), (0.0, 3)]), [5], output_len=4,
                     due=time.perf_counter(), reply=reply))
    assert reply == [9, 0, 200, 201, 202]  # appended, as streamed


def test_summary_counts_only_completed_requests():
    timings = [Timing(late_s=0.001, ttft_s=0.1, e2e_s=1.1, gaps_s=[0.1] * 10, output_tokens=11),
               Timing(late_s=0.002, ttft_s=0.3, e2e_s=2.3, gaps_s=[0.2] * 10, output_tokens=11),
               Timing(late_s=0.0, error="UNAVAILABLE: gone")]
    result = summarize_rate(2.0, timings, wall_s=4.0)
    assert (result["requests"], result["completed"], result["errors"]) == (3, 2, 1)
    assert result["error_examples"] == ["UNAVAILABLE: gone"]
    assert result["request_throughput"] == 0.5
    assert result["output_tokens_per_s"] == 22 / 4.0
    assert result["ttft"]["p50_ms"] == pytest.approx(200)
    assert result["itl"]["p50_ms"] == pytest.approx(150)
    assert result["tpot"]["mean_ms"] == pytest.approx(150)  # (e2e - ttft) / (tokens - 1)
    assert result["normalized_latency"]["mean_ms"] == pytest.approx(1e3 * (1.1 + 2.3) / 2 / 11)
    assert result["e2e"]["p99_ms"] == pytest.approx(1e3 * (1.1 + 0.99 * 1.2))


class SheddingClient:
    """Refuses every call as a shedding front door does."""

    async def stream(self, prompt, **params):
        await asyncio.sleep(0.01)
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "3 requests waiting (bound 3)", retry_after_s=2.0)
        yield  # an async generator, as the real client's stream is


def test_a_shed_call_is_timed_and_counted_apart_from_failures():
    timing = asyncio.run(send(SheddingClient(), [5], output_len=3, due=time.perf_counter()))
    assert timing.error == "RESOURCE_EXHAUSTED: 3 requests waiting (bound 3)"
    assert timing.retry_after_s == 2.0 and 0.01 <= timing.error_s < 5.0
    done = Timing(late_s=0.0, ttft_s=0.1, e2e_s=0.2, gaps_s=[0.1], output_tokens=2)
    shed = [Timing(0.0, error="RESOURCE_EXHAUSTED: full", error_s=0.004, retry_after_s=3.0),
            Timing(0.0, error="RESOURCE_EXHAUSTED: full", error_s=0.002, retry_after_s=1.0)]
    result = summarize_rate(4.0, [done, *shed], wall_s=1.0)
    assert (result["completed"], result["errors"], result["shed"]) == (1, 2, 2)
    assert result["shed_answer"]["p50_ms"] == pytest.approx(3.0)
    assert result["shed_retry_after"]["mean_ms"] == pytest.approx(2e3)
    assert not should_stop(result, stop_ttft_s=1.0)  # shedding is the bound working, not a failure
    failed = summarize_rate(4.0, [done, *shed, Timing(0.0, error="UNAVAILABLE: gone")], wall_s=1.0)
    assert failed["shed"] == 2 and should_stop(failed, stop_ttft_s=1.0)


@pytest.mark.integration
def test_the_shed_mode_end_to_end_on_the_demo_model(tmp_path):
    """--modes shed under a burst far past what the demo model serves: the front door's waiting
    bound (4) refuses some calls at once with a Retry-After, every call it admits streams in
    full, and nothing else fails; the server's RSS is sampled beside the KV gauges."""
    code = bench_serving.main(["--modes", "shed", "--rates", "500", "--num-requests", "32",
                               "--shed-waiting-requests", "4", "--out", str(tmp_path), "--name", "shed"])
    assert code == 0
    record = json.loads((tmp_path / "serving_shed.json").read_text())
    mode = record["shed"]
    assert "--max-waiting-requests" in mode["launch_args"]
    (rate,) = mode["rates"]
    assert rate["requests"] == 32 and rate["shed"] >= 1
    assert rate["errors"] == rate["shed"]  # every other call admitted and streamed whole
    assert rate["completed"] == 32 - rate["shed"] >= 4
    assert rate["shed_retry_after"]["p50_ms"] >= 1e3  # told when to come back: >= 1 s
    assert rate["server_rss_mib"]["peak"] > 0
    assert all(x["server_rss_mib"] > 0 for x in rate["kv_samples"])


def kv_sample(running: int, allocated: int, filled: int, usage: float, waiting: int = 0) -> dict:
    return {"seconds": 0.0, "num_requests_running": running, "num_requests_waiting": waiting,
            "kv_cache_usage_perc": usage, "kv_cache_blocks": 100, "kv_cache_allocated_slots": allocated,
            "kv_cache_filled_slots": filled, "kv_cache_unfilled_slots": allocated - filled,
            "kv_cache_shared_saved_slots": 0}


def test_kv_summary_averages_the_busy_samples():
    samples = [kv_sample(0, 0, 0, 0.0),  # idle: left out
               kv_sample(2, 320, 300, 0.2), kv_sample(4, 640, 600, 0.4, waiting=3)]
    summary = kv_summary(samples, block_size=16)
    assert (summary["samples"], summary["busy_samples"]) == (3, 2)
    assert summary["mean_pool_usage"] == pytest.approx(0.3)
    assert summary["kv_utilization"] == pytest.approx(900 / 960)
    assert summary["pool_token_states"] == pytest.approx(900 / 3200)
    assert summary["waste_share_of_pool"] == pytest.approx(60 / 3200)
    assert summary["unfilled_slots_per_running_request"] == pytest.approx(60 / 6)
    assert (summary["mean_running"], summary["peak_running"], summary["peak_waiting"]) == (3, 4, 3)
    assert kv_summary([kv_sample(0, 0, 0, 0.0)], 16) == {"samples": 1, "busy_samples": 0}


def counters(queries: float, hits: float, prompt_tokens: float) -> dict[str, float]:
    return {"raypaged_prefix_cache_queries_total": queries, "raypaged_prefix_cache_hits_total": hits,
            "raypaged_prompt_tokens_total": prompt_tokens, "raypaged_num_preemptions_total": 3.0}


def test_prefix_cache_summary_is_the_counters_change_over_the_rate():
    timings = [Timing(0.0, ttft_s=0.1, e2e_s=1.0, output_tokens=2, prompt_tokens=600, cached_tokens=512),
               Timing(0.0, ttft_s=0.1, e2e_s=1.0, output_tokens=2, prompt_tokens=100, cached_tokens=0),
               Timing(0.0, prompt_tokens=50, error="UNAVAILABLE: gone")]
    summary = prefix_cache_summary(counters(1000, 200, 1000), counters(1700, 712, 1700), timings)
    assert (summary["queries"], summary["hits"], summary["prompt_tokens"]) == (700, 512, 700)
    assert summary["hit_rate"] == pytest.approx(512 / 700)
    assert (summary["client_prompt_tokens"], summary["client_cached_tokens"]) == (700, 512)
    # Caching off: no lookups, prompts processed, nothing served from a cache.
    off = prefix_cache_summary(counters(0, 0, 10), counters(0, 0, 710), timings[1:2])
    assert off["hit_rate"] == 0.0 and off["client_cached_share"] == 0.0
    assert prefix_cache_summary(counters(0, 0, 0), counters(0, 0, 0), [])["hit_rate"] is None


def planned_prompt_lens(conversation: Conversation, system_len: int) -> list[int]:
    """Each turn's prompt: the system prompt, every earlier message and reply, its message."""
    lens, history = [], system_len
    for turn in conversation.turns:
        lens.append(history + turn.user_len)
        history += turn.user_len + turn.reply_len
    return lens


@pytest.mark.integration
def test_the_multiturn_trace_end_to_end_on_the_demo_model(tmp_path):
    """Both modes of --trace multiturn against `raypaged launch` serving the demo model: every
    planned turn sent and streamed in full, the settings recorded, and the server's prefix-cache
    counters over the rate what the trace implies — with caching, each later turn found at
    least the blocks its conversation's previous turn computed; without, nothing looked up."""
    code = bench_serving.main([
        "--trace", "multiturn", "--rates", "1", "--arrival-window-s", "4", "--turns", "2,3",
        "--system-prompt-len", "64", "--user-turn-mean", "12", "--reply-mean", "12",
        "--think-time-s", "0.2", "--out", str(tmp_path)])
    assert code == 0
    record = json.loads((tmp_path / "serving_demo-multiturn_cpu.json").read_text())
    assert (tmp_path / "serving_demo-multiturn_cpu.png").stat().st_size > 0
    plan = plan_conversations(4, ChatShape(64, 12, 12, 2, 3, 0.2), max_total_len=1024, seed=0)
    prompts = [planned_prompt_lens(c, 64) for c in plan]
    total = sum(map(sum, prompts))
    block = 16
    # Turn k >= 1 finds the full blocks of turn k-1's prompt and reply but its last token (whose
    # K/V nothing computed); the system prompt's blocks may be found too, never a whole prompt.
    at_least = sum((p + t.reply_len - 1) // block * block
                   for c, ps in zip(plan, prompts) for p, t in zip(ps[:-1], c.turns[:-1]))
    at_most = sum((p - 1) // block * block for ps in prompts for p in ps)
    on, off = record["prefix-cache"], record["no-prefix-cache"]
    for mode, caching in ((on, True), (off, False)):
        assert mode["settings"]["effective"]["prefix_caching"] is caching
        assert mode["settings"]["effective"]["async_scheduling"] is True  # launch's default
        assert mode["trace"]["conversations"] == 4 and mode["trace"]["turns"] == sum(map(len, prompts))
        (rate,) = mode["rates"]
        assert rate["errors"] == 0 and rate["preemptions"] == 0
        assert rate["conversations"]["completed"] == 4 == rate["conversations"]["count"]
        assert rate["completed"] == rate["conversations"]["turns_sent"] == sum(map(len, prompts))
        assert rate["output_tokens"] == sum(t.reply_len for c in plan for t in c.turns)
        cache = rate["prefix_cache"]
        assert cache["client_prompt_tokens"] == cache["prompt_tokens"] == total
    hits = on["rates"][0]["prefix_cache"]
    assert hits["queries"] == total  # every prompt token looked up once
    assert at_least <= hits["hits"] <= at_most
    assert hits["client_cached_tokens"] == hits["hits"]  # the usage each stream ended with
    assert hits["hit_rate"] == pytest.approx(hits["hits"] / total) and hits["hit_rate"] > 0.3
    misses = off["rates"][0]["prefix_cache"]
    assert misses["queries"] == misses["hits"] == misses["client_cached_tokens"] == 0
    assert misses["hit_rate"] == 0.0


def test_the_host_tier_summary_and_modes():
    from benchmarks.serving_report import host_tier_summary

    before = {"raypaged_host_cache_hits_total": 16.0, "raypaged_kv_offloaded_bytes_total": 1e9}
    after = {"raypaged_host_cache_hits_total": 48.0, "raypaged_kv_offloaded_bytes_total": 3e9,
             "raypaged_kv_loaded_bytes_total": 1e9, "raypaged_kv_host_copy_seconds_total,kind=copy": 0.5,
             "raypaged_kv_host_copy_seconds_total,kind=exposed": 0.125}
    assert host_tier_summary(before, after, 2.0) == {
        "host_hits": 32.0, "offloaded_bytes": 2e9, "loaded_bytes": 1e9,
        "offload_gb_per_s": 1.0, "load_gb_per_s": 0.5, "copy_s": 0.5, "exposed_s": 0.125}
    assert bench_serving.parse_args(["--trace", "multiturn"]).modes == ["prefix-cache", "no-prefix-cache"]
    args = bench_serving.parse_args(["--trace", "multiturn", "--modes", "host-tier,host-tier-swap"])
    assert args.modes == ["host-tier", "host-tier-swap"] and args.kv_offload_size > 0
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--modes", "host-tier"])  # the sharegpt trace has no such mode


@pytest.mark.integration
@pytest.mark.slow
def test_the_host_tier_mode_end_to_end_on_the_demo_model(tmp_path):
    """--modes host-tier on a pool smaller than the conversations' histories: their blocks leave
    the pool between turns and later turns find them in the host tier."""
    code = bench_serving.main([
        "--trace", "multiturn", "--modes", "host-tier", "--rates", "2", "--arrival-window-s", "4",
        "--turns", "3,4", "--system-prompt-len", "64", "--user-turn-mean", "12", "--reply-mean", "12",
        "--think-time-s", "0.5", "--num-kv-blocks", "16", "--out", str(tmp_path)])
    assert code == 0
    record = json.loads((tmp_path / "serving_demo-multiturn_cpu.json").read_text())
    (rate,) = record["host-tier"]["rates"]
    assert rate["errors"] == 0 and rate["conversations"]["completed"] == rate["conversations"]["count"]
    assert rate["host_tier"]["host_hits"] > 0 and rate["host_tier"]["loaded_bytes"] > 0
    assert rate["prefix_cache"]["hits"] >= rate["host_tier"]["host_hits"]
