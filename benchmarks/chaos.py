"""Chaos soak: many streamed calls over gRPC and OpenAI HTTP against a real target while a seeded
schedule injects faults. The target (benchmarks/lib/chaos_target.py `ChaosTarget`): a `raypaged
serve` (both doors, one engine) — a worker actor SIGKILLed, the engine actor SIGKILLed, a worker
hung (benchmarks/lib/chaos_faults.py; more kinds plug in there), or, on a cluster of several
raylets, the node of the engine's workers removed (chaos_node.py); or, `--target serve`, the Ray
Serve app (an ingress over two engine replicas, chaos_serve.py) — an engine replica's actor
killed mid-stream (chaos_replica.py), an engine actor SIGKILLed. The
calls mix greedy and seeded sampled requests (n = 2 among them), client cancels, deadlines and
malformed requests (benchmarks/lib/chaos_plan.py). Every well-formed call is first run whole in a
fault-free reference run on the same server; under chaos each must stream exactly the
reference's tokens (or a prefix of them, when cancelled or past its deadline):

- lost: 0 (no call hangs, no well-formed call fails), duplicated or missing tokens: 0;
- malformed calls refused with INVALID_ARGUMENT / HTTP 400;
- the pool whole at the end (free blocks == blocks, nothing running or waiting);
- memory bounded: RSS of every process of the server's session and the Ray object store's bytes
  in use, sampled throughout;
- the time to recover from each fault, per kind;
- then SIGTERM drains: calls in flight finish whole, the server exits 0, no process is left.

    python -m benchmarks.chaos                              # short: 200 calls on the demo model
    python -m benchmarks.chaos --num-calls 3000 --faults 12 # long
    python -m benchmarks.chaos -- --model DIR --tp 2        # flags after -- go to raypaged serve
    python -m benchmarks.chaos --fault-kinds node_removed --faults 2 --name nodes
    python -m benchmarks.chaos --target serve --num-calls 1000 --faults 4 --name serve_cpu
    python -m benchmarks.chaos --target serve --app-args '{"model": "DIR", "num_replicas": 3}'

Writes benchmarks/results/chaos_<name>.json. tests/reliability/test_chaos.py runs a short one;
tests/benchmarks/test_chaos_serve.py a short one on Serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from benchmarks.lib.chaos_calls import Doors, run_call
from benchmarks.lib.chaos_check import verdict
from benchmarks.lib.chaos_cluster import ClusterServer
from benchmarks.lib.chaos_faults import FAULT_KINDS, FaultKind, wait_recovered
from benchmarks.lib.chaos_node import NODE_KINDS
from benchmarks.lib.chaos_plan import COMPLETED, ChaosMix, PlannedCall, plan_calls
from benchmarks.lib.chaos_replica import SERVE_KINDS
from benchmarks.lib.chaos_serve import ServeTarget
from benchmarks.lib.chaos_target import PROCESS_KINDS, ChaosTarget, ServerTarget
from benchmarks.lib.launched_server import LaunchedServer
from benchmarks.lib.server_sampler import Sampler, growth_by_process, object_store_probe, rss_summary

DEFAULT_FAULTS = ("worker_sigkill", "engine_sigkill", "worker_hang")
SERVE_FAULTS = ("replica_killed", "engine_sigkill")  # --target serve's default
TARGETS = ("server", "serve")
# The server's settings a chaos run needs whatever the model: Ray worker actors to fault even at
# TP 1, a step timeout that finds a hung worker soon, and room for several restarts.
CHAOS_FLAGS = ["--distributed-executor-backend", "ray", "--step-timeout-s", "5",
               "--max-worker-restarts", "3", "--engine-recovery-timeout", "120"]


@dataclass(frozen=True)
class ChaosConfig:
    num_calls: int = 200
    concurrency: int = 12
    mix: ChaosMix = field(default_factory=ChaosMix)
    fault_kinds: tuple[str, ...] = DEFAULT_FAULTS
    target: str = "server"  # server: `raypaged serve`; serve: the Ray Serve app (chaos_serve.py)
    num_faults: int = 3  # spread evenly over the run, kinds in a seeded order
    seed: int = 0
    call_bound_s: float = 300.0  # a call still open after this long is hung: lost
    recover_bound_s: float = 180.0
    sample_interval_s: float = 1.0
    drain_calls: int = 4


async def drive(doors: Doors, calls: list[PlannedCall], config: ChaosConfig,
                on_done: Callable[[int], None] | None = None) -> dict[int, object]:
    """Runs `calls` with `concurrency` in flight; on_done(number ended) after each."""
    results: dict = {}
    queue = list(reversed(calls))

    async def worker() -> None:
        while queue:
            call = queue.pop()
            results[call.index] = await run_call(doors, call, config.call_bound_s)
            if on_done is not None:
                on_done(len(results))

    await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    return results


class FaultSchedule:
    """Injects `num_faults` faults in a thread, the k-th once k / (num_faults + 1) of the calls
    have ended, each only after the server recovered from the one before."""

    def __init__(self, target: ChaosTarget, config: ChaosConfig, num_calls: int, log) -> None:
        rng = random.Random(config.seed + 1)
        kinds = [config.fault_kinds[i % len(config.fault_kinds)] for i in range(config.num_faults)]
        rng.shuffle(kinds)
        self.plan = [(round((k + 1) * num_calls / (config.num_faults + 1)), kind, rng.random())
                     for k, kind in enumerate(kinds)]
        self.target, self.config, self.log = target, config, log
        self.done = 0
        self.injected: list[dict] = []
        self.injected_at: list[float] = []  # time.monotonic() of each fault, and of each recovery
        self.recovered_at: list[float] = []
        self.faults: list[FaultKind] = []
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FaultSchedule:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._finished.set()
        self._thread.join()
        for fault in self.faults:
            fault.cleanup()

    def _run(self) -> None:
        for at, kind, value in self.plan:
            while self.done < at:
                if self._finished.wait(0.05):
                    return
            fault = FAULT_KINDS[kind](self.target)
            self.faults.append(fault)
            record: dict = {"kind": kind, "after_calls": self.done}
            try:
                record["what"] = fault.inject(value)
                self.injected_at.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - reported: a fault that could not be done
                record["error"] = repr(e)
                self.injected.append(record)
                continue
            seconds = wait_recovered(fault, self.config.recover_bound_s)
            record["recovered_after_s"] = None if seconds is None else round(seconds, 2)
            record["recovered_at_calls"] = self.done
            self.recovered_at.append(time.monotonic())
            self.log(f"  fault {kind}: {record['what']}; recovered after {record['recovered_after_s']} s")
            self.injected.append(record)


def recovery_by_kind(injected: list[dict]) -> dict:
    by_kind: dict[str, dict] = {}
    for record in injected:
        entry = by_kind.setdefault(record["kind"], {"injected": 0, "not_recovered": 0, "recovered_after_s": []})
        entry["injected"] += 1
        if record.get("recovered_after_s") is None:
            entry["not_recovered"] += 1
        else:
            entry["recovered_after_s"].append(record["recovered_after_s"])
    for entry in by_kind.values():
        entry["max_s"] = max(entry["recovered_after_s"], default=None)
    return by_kind


async def drain_check(target: ChaosTarget, doors: Doors, calls: list[PlannedCall], reference: dict,
                      config: ChaosConfig) -> dict:
    """SIGTERM with calls in flight: each must finish whole (as in the reference), and the
    server exit 0 leaving no process of its session."""
    tasks = [asyncio.ensure_future(run_call(doors, call, config.call_bound_s)) for call in calls]
    await asyncio.sleep(0.3)
    exit_code = await asyncio.to_thread(target.stop)
    results = await asyncio.gather(*tasks)
    whole = sum(r.outcome == COMPLETED and r.text == reference[r.index].text for r in results)
    await asyncio.sleep(1.0)
    return {"calls": len(calls), "finished_whole": whole, "exit_code": exit_code,
            "processes_left": len(target.session_pids())}


def rss_bound(samples: list[tuple[float, int, int]]) -> dict:
    """The session's RSS from the chaos run's start (after the reference run warmed everything
    up) to its end, in MiB. A fault replaces processes, and a new one starts smaller than the one
    it replaces and grows back, so growth from the first 20% (rss_summary's) measures restarts;
    the end against the start measures what a run of faults leaves behind."""
    mib = 2**20
    start, final = samples[0][2], samples[-1][2]
    return {"start_mib": round(start / mib, 1), "final_mib": round(final / mib, 1),
            "peak_mib": round(max(b for *_, b in samples) / mib, 1), "growth_mib": round((final - start) / mib, 1)}


def object_store_summary(samples: list[tuple[float, int, int]], schedule: FaultSchedule) -> dict:
    """Bytes in use in Ray's object store over the chaos run, MiB: start, peak, final, the curve
    (calls ended, MiB) at about 20 points, and `growth_between_faults`: the most it grew from
    one recovery to the next fault (or the end) — what the calls themselves leave behind. What a
    fault leaves is apart from that: Ray frees a compiled graph's shared-memory channels only
    with the process that made them (ray-project/ray#43836), so each restart of the worker group
    leaves its old graph's buffers in the engine actor until the engine itself is replaced."""
    mib = 2**20
    if not samples:
        return {"samples": 0, "start": None, "peak": None, "final": None, "curve": [],
                "growth_between_faults": None}
    step = max(1, len(samples) // 20)
    starts = [samples[0][0], *schedule.recovered_at]
    ends = [*schedule.injected_at, samples[-1][0] + 1][: len(starts)]
    growth = 0
    for low, high in zip(starts, ends):
        inside = [b for at, _, b in samples if low <= at < high]
        if len(inside) > 1:
            growth = max(growth, inside[-1] - inside[0])
    return {"samples": len(samples), "start": round(samples[0][2] / mib, 2),
            "peak": round(max(b for *_, b in samples) / mib, 2), "final": round(samples[-1][2] / mib, 2),
            "growth_between_faults": round(growth / mib, 2),
            "curve": [(done, round(b / mib, 2)) for _, done, b in samples[::step]],
            "faults_at_calls": [f["after_calls"] for f in schedule.injected]}


def check_kinds(fault_kinds: tuple[str, ...], target: str = "server") -> None:
    """ValueError unless the kinds can share one target of that kind: node kinds with node kinds
    only, on a server; the Serve app takes the replica and engine kinds
    (ServeTarget.fault_kinds)."""
    kinds = set(fault_kinds)
    if target == "serve":
        refused = kinds - ServeTarget.fault_kinds
        if refused:
            raise ValueError(f"fault kinds {', '.join(sorted(refused))} do not apply to the Serve target "
                             f"(it takes {', '.join(sorted(ServeTarget.fault_kinds))})")
        return
    if kinds & SERVE_KINDS:
        raise ValueError(f"fault kinds {', '.join(sorted(kinds & SERVE_KINDS))} need --target serve")
    on_nodes = kinds & NODE_KINDS
    if on_nodes and not on_nodes >= kinds:
        raise ValueError(f"fault kinds {', '.join(sorted(on_nodes))} run on a multi-node cluster and "
                         f"cannot be mixed with {', '.join(sorted(kinds - on_nodes))}")


def make_target(serve_args: list[str], fault_kinds: tuple[str, ...], target: str = "server",
                app_args: dict | None = None) -> ChaosTarget:
    """The target the faults need. server: node faults a `raypaged serve` joined to a cluster of
    several raylets (benchmarks/lib/chaos_cluster.py), process faults one with a Ray of its own,
    whose processes are all of its session (the two cannot be mixed in one run); serve: the Ray
    Serve app of `app_args` (build_app's arguments) in a session of its own."""
    check_kinds(fault_kinds, target)
    if target == "serve":
        return ServeTarget(app_args)
    if set(fault_kinds) & NODE_KINDS:
        return ServerTarget(ClusterServer([*CHAOS_FLAGS, *serve_args]), NODE_KINDS)
    return ServerTarget(LaunchedServer([*CHAOS_FLAGS, *serve_args], command="serve"), PROCESS_KINDS)


def run_chaos(serve_args: list[str], config: ChaosConfig, log=print, app_args: dict | None = None) -> dict:
    """serve_args: `raypaged serve`'s flags (server target); app_args: build_app's (serve)."""
    target = make_target(serve_args, config.fault_kinds, config.target, app_args)
    phases: dict[str, float] = {}
    clock = time.monotonic()
    try:
        info = target.start()
        address = target.address
        assert address is not None
        phases["start"] = time.monotonic() - clock
        plan = plan_calls(config.num_calls, config.mix, info.vocab_size, info.max_model_len, config.seed)
        whole = [call.whole() for call in plan if not call.malformed]
        drain = [c for c in whole if c.max_tokens >= 8][: config.drain_calls]
        gcs = target.gcs_address()

        async def run() -> dict:
            doors = Doors(address, target.http_url, info.name, info.vocab_size)
            try:
                started = time.monotonic()
                reference = await drive(doors, whole, config)
                await asyncio.to_thread(target.settle)
                phases["reference"] = time.monotonic() - started
                log(f"  reference: {len(reference)} calls in {phases['reference']:.0f} s")
                started = time.monotonic()
                probe = object_store_probe(gcs) if gcs else None
                with Sampler(target, config.sample_interval_s, probe) as sampler, \
                        FaultSchedule(target, config, len(plan), log) as schedule:
                    def done(count: int) -> None:
                        sampler.done = schedule.done = count

                    chaos = await drive(doors, plan, config, done)
                seconds = phases["chaos"] = time.monotonic() - started
                pools = await asyncio.to_thread(target.settle, 30.0)
                started = time.monotonic()
                drained = await drain_check(target, doors, drain, reference, config)
                phases["drain"] = time.monotonic() - started
            finally:
                await doors.close()
            return {"reference": reference, "chaos": chaos, "seconds": seconds, "pools": pools,
                    "sampler": sampler, "schedule": schedule, "drain": drained}

        ran = asyncio.run(run())
        result = verdict(plan, [ran["chaos"][c.index] for c in plan], ran["reference"])
        sampler, pools = ran["sampler"], ran["pools"]
        result.update({
            "config": asdict(config), "model": info.name, "num_blocks": info.num_blocks,
            "tensor_parallel_size": info.tensor_parallel_size, "seconds": round(ran["seconds"], 1),
            "faults": ran["schedule"].injected, "recovery_by_kind": recovery_by_kind(ran["schedule"].injected),
            "pool_whole": pools.whole, "pool": pools.pool, "streams_replayed": pools.streams_resumed,
            "health_samples": dict(sampler.health),
            "rss": rss_summary(sampler.rss, len(plan)),
            "rss_bound": rss_bound(sampler.rss),
            "rss_by_process": growth_by_process(sampler.by_process, len(plan)),
            "object_store_mib": object_store_summary(sampler.object_store_bytes, ran["schedule"]),
            "drain": ran["drain"],
            "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        })
        return result
    finally:
        target.kill()


def passed(result: dict, max_rss_growth_mib: float = 64.0, max_object_store_growth_mib: float = 8.0) -> bool:
    return (result["lost"] == 0 and result["mismatches"] == 0 and result["malformed_misanswered"] == 0
            and result["reference_failed"] == 0 and result["pool_whole"]
            and all(k["not_recovered"] == 0 for k in result["recovery_by_kind"].values())
            and all("error" not in f for f in result["faults"])
            and result["rss_bound"]["growth_mib"] <= max_rss_growth_mib
            and (result["object_store_mib"]["growth_between_faults"] or 0) <= max_object_store_growth_mib
            and result["drain"]["finished_whole"] == result["drain"]["calls"]
            and result["drain"]["exit_code"] == 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-calls", type=int, default=ChaosConfig.num_calls)
    parser.add_argument("--concurrency", type=int, default=ChaosConfig.concurrency)
    parser.add_argument("--faults", type=int, default=ChaosConfig.num_faults, help="faults injected in all")
    parser.add_argument("--target", choices=TARGETS, default="server",
                        help="server: `raypaged serve` (one engine); serve: the Ray Serve app (two engine replicas)")
    parser.add_argument("--fault-kinds", default=None,
                        help=f"comma-separated, of: {', '.join(sorted(FAULT_KINDS))} (default: "
                             f"{','.join(DEFAULT_FAULTS)}; --target serve: {','.join(SERVE_FAULTS)})")
    parser.add_argument("--app-args", default=None,
                        help="--target serve: build_app's arguments as JSON, over chaos_serve.py's defaults")
    parser.add_argument("--seed", type=int, default=ChaosConfig.seed)
    parser.add_argument("--name", default="cpu", help="results file: benchmarks/results/chaos_<name>.json")
    parser.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="after --: flags for raypaged serve (default: the demo model on CPU)")
    args = parser.parse_args(argv)
    serve_args = [a for a in args.serve_args if a != "--"]
    if args.target == "serve" and serve_args:
        parser.error("--target serve takes --app-args, not raypaged serve's flags")
    serve_args = serve_args or ["--device", "cpu"]
    app_args = None
    if args.app_args is not None:
        if args.target != "serve":
            parser.error("--app-args is for --target serve")
        app_args = json.loads(args.app_args)
    default_kinds = SERVE_FAULTS if args.target == "serve" else DEFAULT_FAULTS
    kinds = tuple(args.fault_kinds.split(",")) if args.fault_kinds else default_kinds
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        parser.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    try:
        check_kinds(kinds, args.target)
    except ValueError as e:
        parser.error(str(e))
    config = ChaosConfig(num_calls=args.num_calls, concurrency=args.concurrency, num_faults=args.faults,
                         fault_kinds=kinds, seed=args.seed, target=args.target)
    against = (f"the Serve app {json.dumps(app_args or {})}" if args.target == "serve"
               else f"raypaged serve {' '.join(serve_args)}")
    print(f"chaos: {config.num_calls} calls, {config.concurrency} at a time, {config.num_faults} faults "
          f"of {', '.join(kinds)}; {against}")
    result = run_chaos(serve_args, config, app_args=app_args)
    from benchmarks.lib.common import environment, write_json

    result["environment"] = environment()
    path = write_json(f"chaos_{args.name}", result, args.out)
    shown = {k: v for k, v in result.items() if not k.endswith("_examples") and k not in ("config", "environment")}
    print(json.dumps(shown, indent=1, default=str))
    print(f"written to {path}")
    ok = passed(result)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
