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
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import grpc

# scrape: re-exported for the benchmarks that took it from here (bench_serving).
from benchmarks.lib.launched_server import LaunchedServer, pool_whole, wait_pool_whole
from benchmarks.lib.launched_server import scrape as scrape
from benchmarks.lib.server_sampler import Sampler, growth_by_process, rss_summary
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


def run_soak(launch_args: list[str], config: SoakConfig, log=print) -> dict:
    server = LaunchedServer(launch_args)
    try:
        address, metrics_url, info = server.start()
        plan = plan_requests(config, info.vocab_size, info.max_model_len)
        started = time.monotonic()
        with Sampler(server, config.sample_interval_s) as sampler:
            def progress(done: int) -> None:
                sampler.done = done
                if done % max(1, config.num_requests // 10) == 0:
                    log(f"  {done}/{config.num_requests} requests ended ({time.monotonic() - started:.0f} s)")

            outcomes = asyncio.run(drive(address, plan, config, progress))
        seconds = time.monotonic() - started
        metrics = wait_pool_whole(metrics_url)
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
