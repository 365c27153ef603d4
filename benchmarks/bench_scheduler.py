"""Scheduler hot path: microseconds per engine step for schedule() + update_from_output() with
512 running decode requests and a fake runner (one token per request, built outside the timing).

    python -m benchmarks.bench_scheduler            # table + benchmarks/results/scheduler_cpu.json
    python -m benchmarks.bench_scheduler --profile  # cProfile of the timed steps, top functions
    python -m benchmarks.bench_scheduler --mode hash # the prefix cache's hash chain, builtin vs
                                                     # sha256, salted requests: scheduler_hash_cpu.json

Cases: short and long contexts (per-step cost must not grow with context length), prefix caching
on and off (on: a request that fills a block hashes it into the prefix cache; with staggered
prompts 1/16 of the requests do so every step), the garbage collector on or frozen, and
asynchronous scheduling (the engine's default: schedule() of step N+1, then the update of step N,
each request decoding on a placeholder). The JSON also
records what the step's output batch alone costs: the update appends two list entries per request
(EngineCoreOutputs), next to what one EngineCoreOutput object per request (the former interface)
would cost.
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

from raypaged.core.async_scheduler import make_scheduler
from raypaged.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 16


def fake_runner_output(scheduler: Scheduler, scheduler_output: SchedulerOutput,
                       rng: random.Random) -> ModelRunnerOutput:
    """One random token for each request whose step reaches its last token, none for a chunk
    (an AsyncScheduler counted the step as it scheduled it: the step ends at the request's
    count, where a placeholder or nothing follows)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    token = rng.randrange(1, 32000)
    sampled = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        if scheduler.async_scheduling:
            end = request.num_computed_tokens
            last = end == request.num_tokens or request.all_token_ids[end] == PLACEHOLDER_TOKEN_ID
        else:
            last = request.num_computed_tokens + n == request.num_tokens
        sampled.append([token] if last else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=[None] * len(req_ids))


def build(num_requests: int, prompt_len: int, max_tokens: int, prefix_caching: bool,
          rng: random.Random, async_scheduling: bool = False, hash_algo: str = "sha256",
          salted: bool = False) -> Scheduler:
    """A scheduler whose num_requests requests have all finished their prefill, each step
    answered before the next (so an AsyncScheduler ends with nothing in flight). Prompt lengths
    are staggered over a block so that every step 1/BLOCK_SIZE of the requests fill a block (as in
    steady-state serving), instead of all of them every BLOCK_SIZE-th step."""
    max_model_len = prompt_len + BLOCK_SIZE + max_tokens + 1
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    scheduler = make_scheduler(SchedulerConfig(
        num_blocks=num_requests * blocks_per_request + 16, block_size=BLOCK_SIZE,
        max_num_seqs=num_requests, max_num_batched_tokens=8192, max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
        prefix_caching_hash_algo=hash_algo))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len + i % BLOCK_SIZE)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=0,
                                      cache_salt=f"tenant-{i % 8}" if salted else None))
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, rng))
    return scheduler


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p90": xs[int(len(xs) * 0.9)],
            "min": xs[0]}


def decode_answer(scheduler_output: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    """A token for every request of a decode-only step (asynchronous scheduling: answered after
    the next schedule(), when the scheduler's counts already include that step)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    token = rng.randrange(1, 32000)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token] for _ in req_ids],
                             logprobs=[None] * len(req_ids))


def measure(num_requests: int, prompt_len: int, num_steps: int, prefix_caching: bool,
            gc_freeze: bool = False, profile: cProfile.Profile | None = None,
            async_scheduling: bool = False, hash_algo: str = "sha256", salted: bool = False) -> dict:
    """Per step: wall time, and this thread's CPU time (what the step costs when other
    processes share the cores, as on a busy 2-core machine)."""
    rng = random.Random(0)
    # Requests that finish prefill early decode while the rest prefill: leave them room.
    max_tokens = num_steps + 2 * num_requests * prompt_len // 8192 + 16
    scheduler = build(num_requests, prompt_len, max_tokens, prefix_caching, rng, async_scheduling,
                      hash_algo, salted)
    # Built one step at a time; from here (nothing in flight) the steps overlap if asked.
    answered = None
    if async_scheduling:
        answered = scheduler.schedule()  # the first step in flight
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "update", "step", "step_cpu")}
    gc.collect()
    if gc_freeze:
        # What a long-running engine does after start-up (vLLM does too): the requests' long
        # token lists then stay out of the collector's full passes.
        gc.freeze()
    for _ in range(num_steps):
        if profile is not None:
            profile.enable()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        out = scheduler.schedule()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if profile is not None:
            profile.disable()
        if async_scheduling:
            answered, out = out, answered  # the update takes the step before this one
            runner_output = decode_answer(out, rng)
        else:
            runner_output = fake_runner_output(scheduler, out, rng)
        if profile is not None:
            profile.enable()
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        outputs = scheduler.update_from_output(out, runner_output)
        t3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        if profile is not None:
            profile.disable()
        assert len(out.scheduled_cached_reqs.req_ids) == num_requests and len(outputs) == num_requests
        times["schedule"].append((t1 - t0) / 1e3)
        times["update"].append((t3 - t2) / 1e3)
        times["step"].append((t1 - t0 + t3 - t2) / 1e3)
        times["step_cpu"].append((c1 - c0 + c3 - c2) / 1e3)
    if gc_freeze:
        gc.unfreeze()
    return {"num_requests": num_requests, "prompt_len": prompt_len, "num_steps": num_steps,
            "prefix_caching": prefix_caching, "gc_freeze": gc_freeze,
            "async_scheduling": async_scheduling, "hash_algo": hash_algo, "salted": salted,
            **{f"{k}_us": summary(v) for k, v in times.items()}}


def output_batch_cost(num_requests: int, repeats: int = 200) -> dict[str, dict]:
    """Microseconds to hand out num_requests plain next-token records: as update_from_output
    does (two list appends each into one EngineCoreOutputs), and as one EngineCoreOutput object
    per request would (the interface before)."""
    ids = [f"req-{i}" for i in range(num_requests)]
    sampled = [[7] for _ in ids]
    batch_times, object_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        batch = EngineCoreOutputs()
        ids_append, tokens_append = batch.req_ids.append, batch.new_token_ids.append
        for rid, tokens in zip(ids, sampled):
            ids_append(rid)
            tokens_append(tokens)
        t1 = time.perf_counter_ns()
        [EngineCoreOutput(rid, rid, 0, tokens, None, None, None, 128, 0) for rid, tokens in zip(ids, sampled)]
        t2 = time.perf_counter_ns()
        batch_times.append((t1 - t0) / 1e3)
        object_times.append((t2 - t1) / 1e3)
    return {"batch": summary(batch_times), "objects": summary(object_times)}


def block_hash_cost(repeats: int = 20000) -> dict[str, float]:
    """Nanoseconds to chain one full block of 16 tokens with a salt, per algorithm."""
    from raypaged.core.block_hashing import HASH_ALGOS, block_hasher

    tokens, keys, result = tuple(range(1000, 1000 + BLOCK_SIZE)), ("tenant-0",), {}
    for algo in HASH_ALGOS:
        hasher, parent = block_hasher(algo), 12345
        t0 = time.perf_counter_ns()
        for _ in range(repeats):
            parent = hasher(parent, tokens, keys)
        result[algo] = (time.perf_counter_ns() - t0) / repeats
    return result


def hash_cost(args: argparse.Namespace) -> int:
    """The step with prefix caching on (gc frozen, async and sync), every request salted, under
    each hash algorithm; 1/16 of the requests fill (and hash) a block every step."""
    results = [measure(args.requests, 128, args.steps, True, True, async_scheduling=overlap,
                       hash_algo=algo, salted=True)
               for overlap in (False, True) for algo in ("builtin", "sha256")]
    per_block = block_hash_cost()
    print(f"one block of {BLOCK_SIZE} tokens, salted: " +
          ", ".join(f"{algo} {ns:.0f} ns" for algo, ns in per_block.items()))
    print(f"{'sched':>5} {'hash':>8} | step wall us: {'mean':>6} {'p50':>6} | step CPU us p50")
    for r in results:
        print(f"{'async' if r['async_scheduling'] else 'sync':>5} {r['hash_algo']:>8} | "
              f"{r['step_us']['mean']:>20.0f} {r['step_us']['p50']:>6.0f} | {r['step_cpu_us']['p50']:>6.0f}")
    report = {"benchmark": "scheduler decode step, prefix-cache hash chain builtin vs sha256 (salted)",
              "environment": environment(), "block_hash_ns": per_block, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


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
            "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            # Other processes on a small machine inflate every figure: keep the evidence.
            "load_average_1_5_15min": list(os.getloadavg())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--mode", choices=("step", "hash"), default="step")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/scheduler_cpu.json (--mode hash: scheduler_hash_cpu.json)")
    args = parser.parse_args()
    if args.out is None:
        name = "scheduler_hash_cpu.json" if args.mode == "hash" else "scheduler_cpu.json"
        args.out = os.path.join(os.path.dirname(__file__), "results", name)
    if args.mode == "hash":
        return hash_cost(args)

    if args.profile:
        profile = cProfile.Profile()
        measure(args.requests, 128, args.steps, True, profile=profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
        return 0

    cases = [(128, True, False, False), (128, False, False, False), (2048, True, False, False),
             (128, True, True, False), (2048, True, True, False), (128, True, True, True),
             (2048, True, True, True)]
    results = [measure(args.requests, prompt_len, args.steps, caching, freeze,
                       async_scheduling=overlap)
               for prompt_len, caching, freeze, overlap in cases]
    print(f"{'requests':>8} {'context':>8} {'prefix$':>7} {'gc':>6} {'sched':>5} | wall us: {'schedule':>8} "
          f"{'update':>7} {'step':>6} {'p50':>6} {'min':>6} | step CPU us: {'mean':>6} {'p50':>6}")
    for r in results:
        print(f"{r['num_requests']:>8} {r['prompt_len']:>8} {str(r['prefix_caching']):>7} "
              f"{'frozen' if r['gc_freeze'] else 'on':>6} {'async' if r['async_scheduling'] else 'sync':>5} |"
              f"          {r['schedule_us']['mean']:>8.0f} "
              f"{r['update_us']['mean']:>7.0f} {r['step_us']['mean']:>6.0f} {r['step_us']['p50']:>6.0f} "
              f"{r['step_us']['min']:>6.0f} |              {r['step_cpu_us']['mean']:>6.0f} "
              f"{r['step_cpu_us']['p50']:>6.0f}")
    outputs_cost = output_batch_cost(args.requests)
    print(f"of which handing out {args.requests} plain records (EngineCoreOutputs): "
          f"{outputs_cost['batch']['p50']:.0f} us (p50); as {args.requests} EngineCoreOutput objects "
          f"it would be {outputs_cost['objects']['p50']:.0f} us")
    report = {"benchmark": "scheduler schedule()+update_from_output() per decode step",
              "target_us": 500, "environment": environment(), "results": results,
              "output_records_us": outputs_cost}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
