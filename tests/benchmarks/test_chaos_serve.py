"""The chaos soak (benchmarks/chaos.py) against the Ray Serve app (benchmarks/lib/chaos_serve.py:
an ingress over two engine replicas on a tiny checkpoint): streamed gRPC and OpenAI HTTP calls —
greedy and seeded sampled, n = 2, client cancels, deadlines, malformed requests — while an
engine replica's actor is killed mid-stream (`replica_killed`), then one replica's Ray worker
actor is SIGKILLed (`worker_sigkill`: its engine restarts the worker group inside the replica's
placement group). Nothing is lost, no token is doubled or skipped against the fault-free
reference, both faults are recovered from, the streams the kill cut went on on the other
replica, every pool is whole and SIGTERM drains.

What needs no server first: which fault kinds a target takes, and that the replica fault and
the Serve target refuse what they cannot do."""

from __future__ import annotations

import re

import pytest

from benchmarks.chaos import SERVE_FAULTS, ChaosConfig, check_kinds, passed, run_chaos
from benchmarks.lib.chaos_faults import FAULT_KINDS
from benchmarks.lib.chaos_plan import ChaosMix
from benchmarks.lib.chaos_serve import ServeTarget
from tests.support.checkpoints import checkpoint_dir

APP_ARGS = {"num_gpu_blocks_override": 48, "max_num_seqs": 8, "block_size": 8}
EVERY_SERVE_FAULT = tuple(sorted(ServeTarget.fault_kinds))


def test_each_target_takes_its_own_fault_kinds():
    check_kinds(SERVE_FAULTS, "serve")
    check_kinds(("worker_sigkill", "engine_sigkill"), "server")
    with pytest.raises(ValueError, match="need --target serve"):
        check_kinds(("replica_killed", "engine_sigkill"), "server")
    with pytest.raises(ValueError, match="do not apply to the Serve target"):
        check_kinds(("replica_killed", "node_removed"), "serve")


def test_the_replica_fault_needs_a_serve_target_of_two_replicas_or_more():
    with pytest.raises(TypeError, match="Serve target"):
        FAULT_KINDS["replica_killed"](None)
    with pytest.raises(ValueError, match="at least 2 engine replicas"):
        ServeTarget({"num_replicas": 1})  # refused before any process starts


@pytest.mark.integration
def test_serve_chaos_short():
    config = ChaosConfig(num_calls=64, concurrency=8, num_faults=2, fault_kinds=("replica_killed", "worker_sigkill"),
                         seed=4,
                         target="serve", sample_interval_s=0.5, mix=ChaosMix(max_prompt_tokens=32, max_new_tokens=32),
                         call_bound_s=150, recover_bound_s=150, drain_calls=3)
    result = run_chaos([], config, log=lambda _: None,
                       app_args={"model": str(checkpoint_dir("llama")), **APP_ARGS})
    assert result["calls"] == config.num_calls
    assert result["lost"] == 0, result["lost_examples"]
    assert result["mismatches"] == 0, result["mismatch_examples"]
    assert result["reference_failed"] == 0, result["reference_failed_examples"]
    assert result["malformed_misanswered"] == 0, result["malformed_misanswered_examples"]
    fault, worker_fault = result["faults"]
    assert fault["kind"] == "replica_killed" and fault["recovered_after_s"] is not None, fault
    assert worker_fault["kind"] == "worker_sigkill" and worker_fault["recovered_after_s"] is not None, worker_fault
    running = int(re.search(r"\((\d+) requests running\)", fault["what"])[1])
    assert running > 0, fault  # the kill fell mid-stream
    # Not asserted: streams_replayed >= 1. A 32-token stream the engine counted as running can
    # have had its last token out before the kill (its journal complete: nothing to resume), and
    # then lost 0 / mismatches 0 already say all is well. test_ingress_failover.py kills a replica
    # under a long stream and checks the carry-over itself. The worker fault falls as the load
    # ends: only the idle engine's health check finds it (its recovery is asserted above).
    assert result["pool_whole"], result["pool"]
    assert result["drain"] == {"calls": 3, "finished_whole": 3, "exit_code": 0, "processes_left": 0}
    assert passed(result, max_rss_growth_mib=256.0)


@pytest.mark.integration
@pytest.mark.slow
def test_serve_chaos_long_every_fault_kind():
    """The long Serve soak: every fault kind of the Serve target, twice over a seeded schedule —
    replicas killed, engine actors and workers SIGKILLed, workers hung — and the whole verdict
    (`passed`: nothing lost or changed, every fault recovered, pools whole, RSS and object
    store bounded, the drain whole)."""
    config = ChaosConfig(num_calls=300, concurrency=10, num_faults=6, fault_kinds=EVERY_SERVE_FAULT, seed=5,
                         target="serve", sample_interval_s=1.0, mix=ChaosMix(max_prompt_tokens=32, max_new_tokens=32),
                         call_bound_s=300, recover_bound_s=180, drain_calls=3)
    result = run_chaos([], config, log=print, app_args={"model": str(checkpoint_dir("llama")), **APP_ARGS})
    assert result["lost"] == 0, result["lost_examples"]
    assert result["mismatches"] == 0, result["mismatch_examples"]
    assert len(result["faults"]) == 6 and all(f["recovered_after_s"] is not None for f in result["faults"]), \
        result["faults"]
    assert {f["kind"] for f in result["faults"]} == set(EVERY_SERVE_FAULT), result["faults"]
    assert result["pool_whole"], result["pool"]
    assert passed(result, max_rss_growth_mib=256.0)
