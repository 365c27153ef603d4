"""Scheduler hot path: microseconds per engine step for schedule() + update_from_output() with
512 running decode requests and a fake runner (one token per request, built outside the timing).

    python benchmarks/bench_scheduler.py            # table + benchmarks/results/scheduler_cpu.json
    python benchmarks/bench_scheduler.py --profile  # cProfile of the timed steps, top functions

Cases: short and long contexts (per-step cost must not grow with context length), prefix caching
on and off (on: every 16th step a request's block fills and is hashed and registered).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time

from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 16


def fake_runner_output(scheduler: Scheduler, scheduler_output: SchedulerOutput,
                       rng: random.Random) -> ModelRunnerOutput:
    """One random token for each request whose step reaches its last token, none for a chunk."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    token = rng.randrange(1, 32000)
    sampled = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        sampled.append([token] if request.num_computed_tokens + n == request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=[None] * len(req_ids))


def build(num_requests: int, prompt_len: int, max_tokens: int, prefix_caching: bool,
          rng: random.Random) -> Scheduler:
    """A scheduler whose num_requests requests have all finished their prefill."""
    max_model_len = prompt_len + max_tokens + 1
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_requests * blocks_per_request + 16, block_size=BLOCK_SIZE,
        max_num_seqs=num_requests, max_num_batched_tokens=8192, max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=0))
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, rng))
    return scheduler


def measure(num_requests: int, prompt_len: int, num_steps: int, prefix_caching: bool,
            profile: cProfile.Profile | None = None) -> dict:
    rng = random.Random(0)
    # Requests that finish prefill early decode while the rest prefill: leave them room.
    max_tokens = num_steps + num_requests * prompt_len // 8192 + 16
    scheduler = build(num_requests, prompt_len, max_tokens, prefix_caching, rng)
    schedule_us, update_us = [], []
    gc.collect()
    for _ in range(num_steps):
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if profile is not None:
            profile.disable()
        runner_output = fake_runner_output(scheduler, out, rng)
        if profile is not None:
            profile.enable()
        t2 = time.perf_counter()
        outputs = scheduler.update_from_output(out, runner_output)
        t3 = time.perf_counter()
        if profile is not None:
            profile.disable()
        assert len(out.scheduled_cached_reqs.req_ids) == num_requests and len(outputs) == num_requests
        schedule_us.append((t1 - t0) * 1e6)
        update_us.append((t3 - t2) * 1e6)
    total = [a + b for a, b in zip(schedule_us, update_us)]

    def summary(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p90": xs[int(len(xs) * 0.9)],
                "min": xs[0]}

    return {"num_requests": num_requests, "prompt_len": prompt_len, "num_steps": num_steps,
            "prefix_caching": prefix_caching, "schedule_us": summary(schedule_us),
            "update_us": summary(update_us), "step_us": summary(total)}


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"git_commit": commit, "python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scheduler_cpu.json"))
    args = parser.parse_args()

    if args.profile:
        profile = cProfile.Profile()
        measure(args.requests, 128, args.steps, True, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
        return 0

    cases = [(128, True), (128, False), (2048, True)]
    results = [measure(args.requests, prompt_len, args.steps, caching) for prompt_len, caching in cases]
    header = f"{'requests':>8} {'context':>8} {'prefix$':>7} {'schedule us':>12} {'update us':>10} {'step us':>9} {'p50':>7} {'p90':>7}"
    print(header)
    for r in results:
        print(f"{r['num_requests']:>8} {r['prompt_len']:>8} {str(r['prefix_caching']):>7} "
              f"{r['schedule_us']['mean']:>12.0f} {r['update_us']['mean']:>10.0f} "
              f"{r['step_us']['mean']:>9.0f} {r['step_us']['p50']:>7.0f} {r['step_us']['p90']:>7.0f}")
    report = {"benchmark": "scheduler schedule()+update_from_output() per decode step",
              "target_us": 500, "environment": environment(), "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
