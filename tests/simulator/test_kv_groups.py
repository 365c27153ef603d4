"""KV-cache groups through the real Scheduler: a trace with shared prefixes and preemption over a
sliding + full mix, and the simulator's Gemma-3-shaped report and CLI."""

from __future__ import annotations

import json

import pytest

from raypaged.cli import main as raypaged_main
from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from raypaged.core.kv_cache_groups import group_layers
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.simulator.fake_runner import FakeModelRunner
from raypaged.simulator.kv_groups import LayeredModel, kv_per_request
from raypaged.simulator.traces import make_trace


def test_scheduler_runs_a_trace_on_groups_with_prefix_hits_and_preemption():
    groups = group_layers([64, 64, None] * 2)  # 1 full group, 2 sliding of window 64
    trace = make_trace("shared-prefix", 24, 1024, seed=1)
    kv = HybridKVCacheManager(160, 16, groups, max_tokens_per_step=256)
    scheduler = Scheduler(SchedulerConfig(num_blocks=160, block_size=16, max_num_seqs=8,
                                          max_num_batched_tokens=256, max_model_len=1024),
                          kv_cache_manager=kv)
    for spec in trace.requests:
        scheduler.add_request(spec.to_request())
    runner, generated, preempted = FakeModelRunner(), {}, 0
    for _ in range(20000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        preempted += len(out.preempted_req_ids)
        for rid in out.num_scheduled_tokens:
            tables = kv.get_group_block_ids(rid)
            live = [sum(b >= 0 for b in t) for t in tables]
            assert live[1] <= (64 - 1 + 256) // 16 + 2 and live[2] <= (64 - 1 + 256) // 16 + 2
        result = scheduler.update_from_output(out, runner.execute(out))
        for rid, tokens in zip(result.req_ids, result.new_token_ids):
            generated[rid] = generated.get(rid, 0) + len(tokens)
    assert not scheduler.has_unfinished_requests()
    assert generated == {r.request_id: r.output_len for r in trace.requests}
    assert preempted > 0, "the pool should be small enough to preempt"
    stats = kv.stats()
    assert stats.prefix_cache_hits > 0 and kv.num_free_blocks == 160 and not any(kv.block_pool.ref_cnt)


def test_gemma3_shaped_report_saves_most_of_the_kv_at_long_context():
    model = LayeredModel("tiny", num_layers=12, num_kv_heads=2, head_dim=8, dtype_bytes=2,
                         sliding_window=64, full_every=6)
    report = kv_per_request(model, block_size=8, max_num_batched_tokens=128, contexts=(256, 2048))
    short, long = report["rows"]
    assert report["group_size"] == 2 and len(report["groups"]) == 6
    # Decoding: the full group holds the context, each sliding group ceil(64 / 8) + 1 blocks.
    assert long["grouped_decode_blocks_per_group"] == [256] + [9] * 5
    assert long["full_decode_bytes"] == 12 * 2048 * model.layer_token_bytes
    assert 4.5 < long["decode_ratio"] < 6 and long["peak_ratio"] > 4 and short["decode_ratio"] < long["decode_ratio"]
    assert long["ideal_grouped_bytes"] <= long["grouped_decode_bytes"]
    assert short["pool_whole_at_end"] and long["pool_whole_at_end"]


@pytest.mark.integration  # git rev-parse for the record's commit
def test_simulate_cli_writes_the_gemma3_report(tmp_path, capsys):
    rc = raypaged_main(["simulate", "--model", "gemma3", "--contexts", "4096", "--out", str(tmp_path),
                        "--no-plot"])
    assert rc == 0
    assert "gemma3-27b" in capsys.readouterr().out
    record = json.loads((tmp_path / "simulate_kv_groups.json").read_text())
    assert record["command"].startswith("raypaged simulate") and "--num-requests" not in record["command"]
    (row,) = record["rows"]
    assert row["context"] == 4096 and row["decode_ratio"] > 2


def test_an_fp8_kv_cache_halves_every_byte_count():
    import dataclasses

    from raypaged.simulator.kv_groups import MODELS

    bf16 = kv_per_request(MODELS["gemma3"], block_size=16, max_num_batched_tokens=2048, contexts=(8192,))
    fp8 = kv_per_request(dataclasses.replace(MODELS["gemma3"], dtype_bytes=1), block_size=16,
                         max_num_batched_tokens=2048, contexts=(8192,))
    assert fp8["block_bytes"] * 2 == bf16["block_bytes"]
    assert fp8["rows"][0]["grouped_peak_bytes"] * 2 == bf16["rows"][0]["grouped_peak_bytes"]
