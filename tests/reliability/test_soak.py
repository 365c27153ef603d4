"""Soak over gRPC against a real `raypaged launch` (benchmarks/soak.py): streaming requests of
random lengths, 30% cancelled by their clients at random moments, some with deadlines. Every
request ends, none is lost or inconsistent, the pool is whole, memory stays bounded, health is
SERVING throughout and the server exits cleanly. CI runs 300 requests on a tiny checkpoint; the
slow run is the full 1,000 on the built-in demo model."""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, plan_requests, run_soak
from tests.support.checkpoints import checkpoint_dir

pytestmark = pytest.mark.integration

MAX_RSS_GROWTH_MIB = 64


def assert_nothing_lost(result: dict, config: SoakConfig) -> None:
    outcomes = result["outcomes"]
    assert result["requests"] == config.num_requests
    assert sum(outcomes.values()) == config.num_requests  # every request ended, one way or another
    assert result["lost"] == 0, result["lost_examples"]  # none hung, none broken
    assert outcomes.get("error", 0) == 0, result["error_codes"]
    # The mix really happened: completions, client cancels and expired deadlines.
    assert outcomes["completed"] > 0.4 * config.num_requests
    assert outcomes["cancelled"] > 0.15 * config.num_requests
    assert outcomes.get("deadline_exceeded", 0) > 0
    assert result["pool_whole"], result["pool"]
    assert result["preemptions"] is not None
    assert set(result["health_samples"]) == {"SERVING"}, result["health_samples"]
    assert result["rss"]["samples"] >= 3
    assert result["rss"]["growth_mib"] < MAX_RSS_GROWTH_MIB, result["rss"]
    assert result["server_exit_code"] == 0 and result["processes_left"] == 0


def test_plan_is_seeded_and_fits_the_model():
    config = SoakConfig(num_requests=400, seed=5)
    plan = plan_requests(config, vocab_size=320, max_model_len=256)
    assert plan == plan_requests(config, vocab_size=320, max_model_len=256)
    assert all(3 <= t < 320 for p in plan for t in p.prompt_token_ids)
    assert all(len(p.prompt_token_ids) + p.max_tokens <= 256 for p in plan)
    cancelled = sum(p.cancel_after_chunks is not None or p.cancel_after_s is not None for p in plan)
    assert 0.2 < cancelled / len(plan) < 0.4
    assert any(p.deadline_s for p in plan) and any(p.n == 2 for p in plan)


def test_soak_small():
    config = SoakConfig(num_requests=300, concurrency=16, max_new_tokens=48, sample_interval_s=0.2,
                        request_bound_s=120, seed=1)
    result = run_soak(["--model", str(checkpoint_dir("llama")), "--device", "cpu",
                       "--num-gpu-blocks-override", "24", "--max-num-seqs", "8"], config, log=lambda _: None)
    assert_nothing_lost(result, config)
    assert result["preemptions"] > 0  # a small pool: recompute preemption ran under the load too


@pytest.mark.slow
def test_soak_full_on_the_demo_model():
    config = SoakConfig(num_requests=1000, concurrency=32, request_bound_s=600)
    result = run_soak(["--device", "cpu"], config, log=lambda _: None)
    assert_nothing_lost(result, config)
