"""Soak test: many streaming requests over gRPC against a real `raypaged launch`, a share of them
cancelled by their clients at random moments and some with deadlines. Nothing may be lost:

- every request ends: it completes (a finish reason on every sample, usage that adds up), is
  cancelled by its client, runs past its deadline (DEADLINE_EXCEEDED), or gets an error status;
  one still open after its bound is *hung*, and one completed inconsistently is *broken*;
- the block pool is whole at the end (Prometheus: free blocks == blocks, nothing running/waiting);
- the server's memory does not grow without bound (RSS of every process of the launch session —
  the frontend, the engine actor, its workers, Ray's own — sampled throughout);
- the server is SERVING throughout and exits 0 on SIGTERM.

    python -m benchmarks.soak                        # 1,000 requests on the built-in demo model
    python -m benchmarks.soak --num-requests 200 --model DIR --tp 2
    python -m benchmarks.soak --server HOST:PORT --metrics-url http://HOST:PORT/metrics

Prints a summary and writes benchmarks/results/soak_<name>.json. tests/reliability/test_soak.py
runs a small version of the same code in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Self

import grpc

from raypaged.client import AsyncClient, RequestError


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 1000
    concurrency: int = 32
    cancel_fraction: float = 0.3  # cancelled by the client at a random moment
    deadline_fraction: float = 0.15  # sent with a deadline, often too short to finish
    max_prompt_tokens: int = 96
    max_new_tokens: int = 64
    seed: int = 0
    request_bound_s: float = 300.0  # a request still open after this long is hung: lost
    sample_interval_s: float = 1.0  # RSS and health


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    n: int
    ignore_eos: bool
    temperature: float
    cancel_after_chunks: int | None  # leave the stream after this many messages…
    cancel_after_s: float | None  # …or after this long, whichever applies
    deadline_s: float | None


@dataclass
class Outcome:
    index: int
    kind: str  # completed | cancelled | deadline_exceeded | error | hung | broken
    seconds: float
    num_tokens: int = 0
    detail: str = ""


def plan_requests(config: SoakConfig, vocab_size: int, max_model_len: int) -> list[PlannedRequest]:
    rng = random.Random(config.seed)
    plan = []
    for i in range(config.num_requests):
        prompt_len = rng.randint(1, min(config.max_prompt_tokens, max_model_len // 2))
        max_tokens = rng.randint(1, min(config.max_new_tokens, max_model_len - prompt_len))
        cancelled = rng.random() < config.cancel_fraction
        by_chunks = cancelled and rng.random() < 0.5
        plan.append(PlannedRequest(
            index=i,
            prompt_token_ids=[rng.randrange(3, vocab_size) for _ in range(prompt_len)],
            max_tokens=max_tokens,
            n=2 if rng.random() < 0.1 else 1,
            ignore_eos=rng.random() < 0.5,
            temperature=0.0 if rng.random() < 0.5 else 0.8,
            cancel_after_chunks=rng.randint(1, max_tokens) if by_chunks else None,
            cancel_after_s=rng.uniform(0.0, 1.0) if cancelled and not by_chunks else None,
            deadline_s=rng.uniform(0.05, 3.0) if rng.random() < config.deadline_fraction else None,
        ))
    return plan


async def run_request(client: AsyncClient, planned: PlannedRequest, bound_s: float) -> Outcome:
    started = time.monotonic()
    state = {"tokens": 0}

    async def consume() -> Outcome:
        tokens: dict[int, int] = {}
        finish: dict[int, str] = {}
        usage = None
        messages = 0
        stream = client.stream(planned.prompt_token_ids, max_tokens=planned.max_tokens, n=planned.n,
                               ignore_eos=planned.ignore_eos, temperature=planned.temperature,
                               timeout=planned.deadline_s)
        try:
            async for chunk in stream:
                messages += 1
                for out in chunk.outputs:
                    if out.index in finish:
                        return _broken(planned, started, f"sample {out.index} went on after finishing")
                    tokens[out.index] = tokens.get(out.index, 0) + len(out.token_ids)
                    state["tokens"] += len(out.token_ids)
                    if out.finish_reason is not None:
                        finish[out.index] = out.finish_reason
                usage = chunk.usage or usage
                if planned.cancel_after_chunks is not None and messages >= planned.cancel_after_chunks:
                    return Outcome(planned.index, "cancelled", time.monotonic() - started, state["tokens"])
        finally:
            await stream.aclose()  # cancels the call if it is still open
        return _check_completed(planned, started, tokens, finish, usage)

    try:
        if planned.cancel_after_s is not None:
            try:
                return await asyncio.wait_for(consume(), planned.cancel_after_s)
            except asyncio.TimeoutError:
                return Outcome(planned.index, "cancelled", time.monotonic() - started, state["tokens"])
        return await asyncio.wait_for(consume(), bound_s)
    except asyncio.TimeoutError:
        return Outcome(planned.index, "hung", time.monotonic() - started, state["tokens"],
                       f"still open after {bound_s:.0f} s")
    except RequestError as e:
        kind = "deadline_exceeded" if (e.code == grpc.StatusCode.DEADLINE_EXCEEDED
                                       and planned.deadline_s is not None) else "error"
        return Outcome(planned.index, kind, time.monotonic() - started, state["tokens"],
                       f"{e.code.name}: {e.message}")


def _check_completed(planned: PlannedRequest, started: float, tokens: dict[int, int],
                     finish: dict[int, str], usage) -> Outcome:
    seconds = time.monotonic() - started
    total = sum(tokens.values())
    problems = []
    if sorted(finish) != list(range(planned.n)):
        problems.append(f"finish reasons for samples {sorted(finish)} of {planned.n}")
    if usage is None or usage.completion_tokens != total:
        problems.append(f"usage {usage} does not count the {total} tokens streamed")
    for index, count in tokens.items():
        if count > planned.max_tokens or (planned.ignore_eos and count != planned.max_tokens):
            problems.append(f"sample {index}: {count} tokens for max_tokens {planned.max_tokens}")
    if problems:
        return _broken(planned, started, "; ".join(problems))
    return Outcome(planned.index, "completed", seconds, total)


def _broken(planned: PlannedRequest, started: float, detail: str) -> Outcome:
    return Outcome(planned.index, "broken", time.monotonic() - started, 0, detail)


async def drive(address: str, plan: list[PlannedRequest], config: SoakConfig,
                on_progress=None, **client_options) -> list[Outcome]:
    """Runs the plan with `concurrency` requests in flight; on_progress(done) after each."""
    outcomes: list[Outcome] = []
    queue = list(reversed(plan))
    async with AsyncClient(address, **client_options) as client:
        async def worker() -> None:
            while queue:
                outcomes.append(await run_request(client, queue.pop(), config.request_bound_s))
                if on_progress is not None:
                    on_progress(len(outcomes))

        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    return sorted(outcomes, key=lambda o: o.index)


# ---- the server under test ---------------------------------------------------------------------

_READY = re.compile(r"raypaged ready: .* on (\S+):(\d+), metrics on (http://\S+/metrics)")


class LaunchedServer:
    """`raypaged launch` in a session of its own, so that every process it starts (Ray's
    included) can be found, measured and, at the end, checked gone."""

    def __init__(self, launch_args: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raypaged.cli", "launch", "--port", "0", "--metrics-port", "0",
             *launch_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **(env or {})})
        self.log: list[str] = []
        self.address = self.metrics_url = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.address, self.metrics_url = f"{match[1]}:{match[2]}", match[3]
                self._ready.set()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("raypaged launch did not become ready:\n" + "".join(self.log[-30:]))

    def session_pids(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) == self.process.pid:
                        pids.append(int(entry))
                except OSError:  # gone meanwhile
                    pass
        return pids

    def rss_by_process(self) -> dict[int, tuple[str, int]]:
        """pid -> (name, RSS in bytes) of each process of the session (Ray names its workers
        after their actor and task: ray::EngineActor.get_outputs, ray::RayWorkerActor…)."""
        sizes = {}
        for pid in self.session_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/status") as f:
                    rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            except OSError:  # gone meanwhile
                continue
            name = os.path.basename(argv[0].decode(errors="replace")) or "?"
            if name.startswith("python") and len(argv) > 1:
                name = " ".join(os.path.basename(a.decode(errors="replace")) for a in argv[1:4])
            sizes[pid] = (name[:60], rss)
        return sizes

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then the exit status (SIGKILL to everything left if it does not exit)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def scrape(metrics_url: str) -> dict[str, float]:
    """The unlabelled-by-reason gauges and counters of a /metrics page, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "engine"))
            values[key] = sample.value
    return values


def pool_whole(metrics: dict[str, float]) -> bool:
    return (metrics.get("raypaged_kv_cache_free_blocks") == metrics.get("raypaged_kv_cache_blocks")
            and metrics.get("raypaged_num_requests_running") == 0
            and metrics.get("raypaged_num_requests_waiting") == 0)


class Sampler:
    """RSS and health sampled in a thread while the load runs."""

    def __init__(self, server: LaunchedServer, interval_s: float = 1.0) -> None:
        self.server = server
        self.interval_s = interval_s
        self.rss: list[tuple[float, int, int]] = []  # (seconds, requests done, bytes)
        self.by_process: list[tuple[int, dict[int, tuple[str, int]]]] = []  # (requests done, per process)
        self.health: Counter = Counter()
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from raypaged.client import Client

        with Client(self.server.address) as client:
            while not self._stop.is_set():
                done, sizes = self.done, self.server.rss_by_process()
                self.rss.append((time.monotonic() - self._started, done, sum(rss for _, rss in sizes.values())))
                self.by_process.append((done, sizes))
                try:
                    self.health[client.health(timeout=5)] += 1
                except RequestError as e:
                    self.health[e.code.name] += 1
                self._stop.wait(self.interval_s)


def rss_summary(samples: list[tuple[float, int, int]], num_requests: int) -> dict:
    """Memory after warm-up (the first 20% of requests) against the end of the run, and over the
    second half alone: a leak grows with the requests served (the second half grows as much as
    the first), warm-up does not. `curve` is (requests done, MiB) at about 20 points."""
    mib = 1024 * 1024

    def first_at(fraction: float) -> int:
        return next((b for _, done, b in samples if done >= fraction * num_requests), samples[-1][2])

    final, peak = samples[-1][2], max(b for *_, b in samples)
    step = max(1, len(samples) // 20)
    return {"after_warmup_mib": round(first_at(0.2) / mib, 1), "final_mib": round(final / mib, 1),
            "peak_mib": round(peak / mib, 1), "growth_mib": round((final - first_at(0.2)) / mib, 1),
            "growth_second_half_mib": round((final - first_at(0.5)) / mib, 1),
            "samples": len(samples),
            "curve": [(done, round(b / mib, 1)) for _, done, b in samples[::step]]}


def growth_by_process(samples: list[tuple[int, dict[int, tuple[str, int]]]], num_requests: int) -> dict:
    """MiB each process grew from the end of warm-up to the end, largest first (where the
    memory goes if the total grows; processes started or gone meanwhile count from or to 0),
    with the RSS curve (requests done, MiB) of the three that grew most."""
    start = next((sizes for done, sizes in samples if done >= 0.2 * num_requests), samples[0][1])
    end = samples[-1][1]
    growth = {}
    for pid in start.keys() | end.keys():
        growth[pid] = (end.get(pid, ("", 0))[1] - start.get(pid, ("", 0))[1]) / 2**20
    top = sorted(growth, key=lambda pid: -abs(growth[pid]))[:8]

    def label(pid: int) -> str:
        name, _ = end.get(pid) or start[pid]
        return f"{name} {pid}" + ("" if pid in start and pid in end else " (new)" if pid in end else " (gone)")

    step = max(1, len(samples) // 20)
    return {"growth_mib": {label(pid): round(growth[pid], 1) for pid in top},
            "curves_mib": {label(pid): [(done, round(sizes[pid][1] / 2**20, 1))
                                        for done, sizes in samples[::step] if pid in sizes]
                           for pid in top[:3]}}


def run_soak(launch_args: list[str], config: SoakConfig, log=print) -> dict:
    server = LaunchedServer(launch_args)
    try:
        server.wait_ready()
        from raypaged.client import Client

        with Client(server.address) as client:
            info = client.model_info()
        plan = plan_requests(config, info.vocab_size, info.max_model_len)
        started = time.monotonic()
        with Sampler(server, config.sample_interval_s) as sampler:
            def progress(done: int) -> None:
                sampler.done = done
                if done % max(1, config.num_requests // 10) == 0:
                    log(f"  {done}/{config.num_requests} requests ended ({time.monotonic() - started:.0f} s)")

            outcomes = asyncio.run(drive(server.address, plan, config, progress))
        seconds = time.monotonic() - started
        deadline = time.monotonic() + 15  # the engine stats reach the metrics once a second
        while not pool_whole(metrics := scrape(server.metrics_url)) and time.monotonic() < deadline:
            time.sleep(0.25)
        exit_code = server.stop()
        left = server.session_pids()
        return summarize(config, info, outcomes, seconds, metrics, sampler, exit_code, left)
    finally:
        server.kill()


def summarize(config: SoakConfig, info, outcomes: list[Outcome], seconds: float,
              metrics: dict[str, float], sampler: Sampler, exit_code: int, left: list[int]) -> dict:
    kinds = Counter(o.kind for o in outcomes)
    errors = Counter(o.detail.split(":")[0] for o in outcomes if o.kind == "error")
    lost = [asdict(o) for o in outcomes if o.kind in ("hung", "broken")]
    return {
        "config": asdict(config),
        "model": info.name, "num_blocks": info.num_blocks, "tensor_parallel_size": info.tensor_parallel_size,
        "requests": len(outcomes), "seconds": round(seconds, 1),
        "outcomes": dict(kinds), "error_codes": dict(errors),
        "lost": len(lost), "lost_examples": lost[:10],
        "tokens_streamed": sum(o.num_tokens for o in outcomes),
        "preemptions": metrics.get("raypaged_num_preemptions_total"),
        "pool_whole": pool_whole(metrics),
        "pool": {k: metrics.get(f"raypaged_{k}") for k in
                 ("kv_cache_blocks", "kv_cache_free_blocks", "num_requests_running", "num_requests_waiting")},
        "health_samples": dict(sampler.health),
        "rss": rss_summary(sampler.rss, len(outcomes)),
        "rss_by_process": growth_by_process(sampler.by_process, len(outcomes)),
        "server_exit_code": exit_code, "processes_left": len(left),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=SoakConfig.num_requests)
    parser.add_argument("--concurrency", type=int, default=SoakConfig.concurrency)
    parser.add_argument("--cancel-fraction", type=float, default=SoakConfig.cancel_fraction)
    parser.add_argument("--deadline-fraction", type=float, default=SoakConfig.deadline_fraction)
    parser.add_argument("--max-new-tokens", type=int, default=SoakConfig.max_new_tokens)
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--name", default="cpu", help="results file: benchmarks/results/soak_<name>.json")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                        help="fail when memory grows more than this after warm-up")
    parser.add_argument("launch_args", nargs=argparse.REMAINDER,
                        help="after --: flags for raypaged launch (default: the demo model on CPU)")
    args = parser.parse_args(argv)
    launch_args = [a for a in args.launch_args if a != "--"] or ["--device", "cpu"]
    config = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                        cancel_fraction=args.cancel_fraction, deadline_fraction=args.deadline_fraction,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"soak: {config.num_requests} requests, {config.concurrency} at a time, "
          f"raypaged launch {' '.join(launch_args)}")
    result = run_soak(launch_args, config)
    from benchmarks.lib.common import environment, write_json

    result["environment"] = environment()
    path = write_json(f"soak_{args.name}", result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "lost_examples", "environment")},
                     indent=1))
    print(f"written to {path}")
    ok = (result["lost"] == 0 and result["pool_whole"] and result["rss"]["growth_mib"] <= args.max_rss_growth_mib
          and result["server_exit_code"] == 0 and set(result["health_samples"]) == {"SERVING"})
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
