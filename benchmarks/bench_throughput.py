"""Offline throughput, every request there at the start, at one or more precisions in one run,
and where the KV memory goes while the engine serves them (issue 8's "Offline throughput" and
"Memory" benchmarks; issue 22's FP8 throughput).

    python -m benchmarks.bench_throughput       # CPU-sized: a tiny random Llama, 32 requests, fp32
    bash scripts/gpu.sh throughput              # the H200 run: 8B-shaped, bf16, 1,000 requests
    bash scripts/gpu.sh throughput-fp8          # the same requests, bf16 vs FP8 weights + FP8 KV
    bash scripts/gpu.sh throughput-fixed        # 1,000 x (1,000 in, 1,000 out), fp8 and bf16
    python -m benchmarks.bench_throughput --shape 8b --kv-capacity auto,fp8   # KV capacity only

--workload sharegpt (the default): the simulator's seeded ShareGPT-like trace (prompt ≈ 160 and
output ≈ 340 tokens on average, lognormal long tails, clipped to max_model_len; --max-total-len
prunes as vLLM's benchmark does). --workload fixed: --num-requests prompts of exactly --input-len
random token ids, each asking for exactly --output-len tokens (benchmarks/lib/fixed_requests.py).
Every request generates exactly its output length (ignore_eos). --precisions (benchmarks/lib/
precisions.py: bf16, fp32, fp8 = FP8 weights + FP8 KV, fp8-weights, fp8-kv) run one after the
other, each its own engine and its own profiled KV pool (on CPU, the memory of --num-kv-blocks
blocks of the precision's dtype); each runs the --modes:
  - paged: raypaged's paged KV cache (blocks on demand);
  - contiguous: kv_cache_mode "contiguous", every request reserving max_model_len slots when it
    starts — the allocator PagedAttention replaces — on the paged run's number of blocks;
and, once, at the baseline precision's dtype:
  - transformers `generate` with static batching: consecutive requests in batches of
    --hf-batch-size, prompts left-padded, each batch generating until its longest request is done.
    Only the tokens each request asked for count. On the first --hf-requests requests; with
    --hf-max-time a batch stops after that many seconds (what it produced by then counts, which
    favours transformers: the steps it skips are those where most rows are already done).
The baseline precision is the first unquantized one listed; every other precision records its
output tok/s over the baseline's, mode by mode (`over_baseline`), so `--precisions fp8,bf16` runs
fp8 first and still reports fp8 / bf16. Where another engine published a figure on the same
fixed workload (benchmarks/lib/published_peers.py: TensorRT-LLM, Llama-3.1-8B FP8, 1000 / 1000),
it is recorded beside raypaged's under `published_peers`, marked published, not measured here.

JSON: precisions.<precision>.<mode> is one engine run (tok/s, steps, preemptions, pool, KV
samples); precisions.<precision>.settings the engine settings. Every --stats-every engine steps
the scheduler's KVCacheStats are sampled: pool usage, filled and allocated slots, prefix-sharing
savings. Writes benchmarks/results/throughput_<name>_<device>.json and a PNG beside it; the name is
--name, else the shape, then "-fixed" for the fixed workload and "-fp8" when an FP8 precision ran.
The JSON is rewritten after every engine run: a run cut short keeps what it measured.

--kv-capacity DTYPES answers the capacity question instead (benchmarks/lib/kv_capacity.py): per KV
dtype, the profiled pool's blocks and the largest batch of --capacity-context-token requests that
fits, checked by running one more than that, at the first precision's dtype; writes
kv_capacity_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.lib import kv_capacity
from benchmarks.lib.common import (
    SHAPES,
    device_tag,
    environment,
    release_memory,
    sync,
    write_config,
    write_json,
)
from benchmarks.lib.fixed_requests import fixed_requests
from benchmarks.lib.hf_static import hf_static_batching
from benchmarks.lib.kv_memory import KVSample, memory_summary, sample_kv
from benchmarks.lib.precisions import Precision, baseline_of, parse_precisions
from benchmarks.lib.published_peers import published_for
from benchmarks.lib.sharegpt import BenchRequest, sharegpt_requests
from benchmarks.lib.step_profile import StepProfiler
from benchmarks.lib.throughput_plot import save_plot
from benchmarks.lib.throughput_report import add_ratios, print_table
from raypaged import LLM, SamplingParams
from raypaged.config.sections import KV_CACHE_DTYPES, kv_cache_value_bytes
from raypaged.core.request import Request

MODES = ("paged", "contiguous")
WORKLOADS = ("sharegpt", "fixed")
# On the H200 the profiled pool holds ~100 reservations of 8,192 tokens for 1,000 requests: about
# one per ten requests. The CPU default keeps that regime for its 32 requests: 4 x 2,048 tokens.
CPU_NUM_KV_BLOCKS = 512
PROGRESS_EVERY_S = 30.0  # a line in the log this often: a GPU run cut by its timeout still says how far it got


def warm_up(llm: LLM, requests: list[BenchRequest], max_tokens: int) -> float:
    """The whole workload once, untimed, each request cut to max_tokens: the timed run then meets
    no step shape for the first time (Triton compiling a kernel's specialization, the allocator
    growing: one-off costs that otherwise land in its first steps; benchmarks/README.md, the FP8
    throughput row). Each prompt reversed, so that its blocks hash apart from the timed run's and
    the prefix cache serves it nothing. Returns the seconds."""
    started = time.perf_counter()
    if max_tokens > 0:
        prompts = [{"prompt_token_ids": list(reversed(r.prompt_token_ids))} for r in requests]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - started


def run_engine(llm: LLM, requests: list[BenchRequest], stats_every: int, device: torch.device,
               label: str = "", profiler: StepProfiler | None = None, warm_up_tokens: int = 16) -> dict:
    """Submit every request at once, step the engine until all are done. Timed from the first
    submission to the last token. Raises RuntimeError if any request fails or the tokens
    generated are not exactly those asked for. With a profiler, its window of steps is traced
    (lib/step_profile.py) and recorded as "step_profile"."""
    engine = llm.engine
    warm_up_seconds = warm_up(llm, requests, warm_up_tokens)
    expected = sum(r.output_len for r in requests)
    samples: list[KVSample] = []
    generated = steps = 0
    preemptions_before = engine.scheduler.num_preemptions
    hits_before = engine.scheduler.stats().kv_cache.prefix_cache_hits
    sync(device)
    start = last_report = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(Request(f"bench-{i}", list(r.prompt_token_ids), params))
    while engine.has_unfinished_requests():
        if profiler is not None:
            stats = engine.scheduler.stats()
            profiler.before_step(steps + 1, stats.num_running, stats.num_waiting)
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.req_id} failed: {out.error}")
            generated += len(out.new_token_ids)
        steps += 1
        if profiler is not None:
            stats = engine.scheduler.stats()
            profiler.after_step(steps, stats.num_running, stats.num_waiting)
        if steps % stats_every == 0:
            samples.append(sample_kv(engine, time.perf_counter() - start, steps))
            if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
                last_report = time.perf_counter()
                print(f"[{label}] {samples[-1].seconds:.0f} s: {generated:,} of {expected:,} tokens, "
                      f"{samples[-1].running} running, {samples[-1].waiting} waiting", flush=True)
    elapsed = time.perf_counter() - start
    if generated != expected:
        raise RuntimeError(f"generated {generated} tokens, the requests asked for {expected}")
    block_size = engine.config.scheduler.block_size
    return {
        "requests": len(requests), "output_tokens": generated, "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed, "engine_steps": steps,
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "num_kv_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
        "memory": memory_summary(samples, engine.num_blocks * block_size, block_size),
        "samples": [asdict(s) for s in samples],
        "step_profile": None if profiler is None else profiler.result,
        "warm_up_seconds": warm_up_seconds,
        "prefix_cache_hit_tokens": engine.scheduler.stats().kv_cache.prefix_cache_hits - hits_before,
        # The first sampled window, against the run's mean: what a one-off cost would show as.
        "first_window": None if not samples else {"steps": samples[0].step, "seconds": samples[0].seconds},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory to take the config from instead of --shape's "
                             "(weights random all the same: load_format dummy; not for --kv-capacity)")
    parser.add_argument("--precisions", default=None,
                        help="comma list of bf16, fp32, fp8 (FP8 weights + FP8 KV), fp8-weights, fp8-kv, run "
                             "in that order (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1000, help="fixed workload: prompt tokens a request")
    parser.add_argument("--output-len", type=int, default=1000, help="fixed workload: output tokens a request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the shape's max_position_embeddings; what a contiguous "
                             "request reserves, and the cap on a trace request's length")
    parser.add_argument("--max-total-len", type=int, default=None,
                        help="sharegpt: skip trace requests whose prompt + output exceed this (vLLM's "
                             "ShareGPT benchmark uses 2048); max_model_len is unchanged")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool: the memory of this many blocks of each precision's model dtype "
                             "(an FP8 pool gets twice the blocks), the same for both modes (default: "
                             f"profiled on CUDA; on CPU {CPU_NUM_KV_BLOCKS}, four max-length reservations "
                             "of the tiny shape)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="both raypaged modes with asynchronous scheduling (default on, as "
                             "the engine; off: the file name ends in _sync)")
    parser.add_argument("--stats-every", type=int, default=4, help="sample KV stats every N steps")
    parser.add_argument("--warm-up-tokens", type=int, default=16,
                        help="before each timed run, the whole workload once untimed at this many output "
                             "tokens a request (0: no warm-up)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="trace this many engine steps of each run (lib/step_profile.py: the GPU's "
                             "kernels by family per step), from --profile-from-step; 0: none")
    parser.add_argument("--profile-from-step", type=int, default=200,
                        help="the first traced step (a run shorter than the window records none)")
    parser.add_argument("--hf-requests", type=int, default=16, help="0: skip transformers")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--hf-max-time", type=float, default=None,
                        help="seconds after which a transformers batch stops (none by default)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on CPU (default 1: on a small shared machine more "
                             "threads spin against each other and every figure gets noisy)")
    parser.add_argument("--name", default=None,
                        help="results file throughput_<name>_<device>.json (default: the shape, "
                             "-fixed for the fixed workload, -fp8 when an FP8 precision runs)")
    parser.add_argument("--out", default=None, help="directory for the JSON and PNG")
    parser.add_argument("--kv-capacity", default=None,
                        help="comma list of KV dtypes (e.g. auto,fp8): measure the pool's capacity "
                             "at each instead of the throughput")
    parser.add_argument("--capacity-context", type=int, default=8192,
                        help="tokens of each request in the capacity batch")
    parser.add_argument("--capacity-run", action=argparse.BooleanOptionalAction, default=True,
                        help="check the capacity by running fits + 1 such requests at once")
    return parser.parse_args(argv)


def run_mode(model_dir: Path, mode: str, precision: Precision, args: argparse.Namespace,
             max_model_len: int, num_blocks: int | None, requests: list[BenchRequest],
             device: torch.device) -> dict:
    """One engine of `precision` in KV `mode` over `requests`: its run_engine record, plus its
    start-up time."""
    start = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=num_blocks, kv_cache_mode=mode,
              async_scheduling=args.async_scheduling, **precision.engine_settings())
    init_seconds = time.perf_counter() - start
    label = f"{precision.name} {mode}"
    try:
        profiler = StepProfiler(args.profile_from_step, args.profile_steps, device) if args.profile_steps else None
        result = run_engine(llm, requests, args.stats_every, device, label, profiler, args.warm_up_tokens)
    finally:
        llm.shutdown()
        del llm
        release_memory(device)
    result["init_seconds"] = init_seconds
    if device.type == "cuda":  # what the next run finds still taken
        result["cuda_gib_left_after_release"] = torch.cuda.memory_allocated() / 2**30
    mem = result["memory"]["all_steps"]
    print(f"[{label}] {result['output_tokens_per_s']:.0f} output tok/s in {result['seconds']:.1f} s "
          f"(start-up {init_seconds:.0f} s); {result['num_kv_blocks']} blocks; mean running "
          f"{mem.get('mean_running', 0):.1f}; {result['preemptions']} preemptions", flush=True)
    if (window := result["step_profile"]) is not None:
        print(f"[{label}] steps {args.profile_from_step}-{args.profile_from_step + window['steps'] - 1} traced: "
              f"{window['wall_ms_per_step']:.2f} ms a step, GPU busy {window['busy_ms_per_step']:.2f}; "
              + ", ".join(f"{family} {ms:.2f}" for family, ms in window["families_ms_per_step"].items()),
              flush=True)
    return result


def make_requests(args: argparse.Namespace, max_model_len: int, vocab_size: int) -> tuple[list[BenchRequest], dict]:
    """The workload's requests and its record (what it is, its lengths)."""
    if args.workload == "fixed":
        if args.max_total_len is not None:
            raise SystemExit("--max-total-len prunes the sharegpt trace; the fixed workload has none to prune")
        if args.input_len + args.output_len > max_model_len:
            raise SystemExit(f"--input-len + --output-len = {args.input_len + args.output_len} exceeds "
                             f"max_model_len {max_model_len}")
        requests = fixed_requests(args.num_requests, args.input_len, args.output_len, vocab_size, args.seed)
        record = {"name": "fixed", "input_len": args.input_len, "output_len": args.output_len,
                  "description": f"fixed requests of {args.input_len} in / {args.output_len} out"}
    else:
        requests = sharegpt_requests(args.num_requests, max_model_len, vocab_size, args.seed, args.max_total_len)
        record = {"name": "sharegpt", "description": "ShareGPT-like requests",
                  "max_total_len_pruned_at": args.max_total_len}
    record.update({
        "num_requests": len(requests),
        "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output_len": sum(r.output_len for r in requests) / len(requests),
        "max_total_len": max(len(r.prompt_token_ids) + r.output_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    })
    return requests, record


def results_name(args: argparse.Namespace, model: str, precisions: list[Precision]) -> str:
    """throughput_<--name>_<device>, the name defaulting to the model's, -fixed, -fp8 as they apply."""
    name = args.name or (model + ("-fixed" if args.workload == "fixed" else "")
                         + ("-fp8" if any(p.quantized for p in precisions) else ""))
    return f"throughput_{name}_{device_tag()}" + ("" if args.async_scheduling else "_sync")


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma list of {', '.join(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    try:
        precisions = parse_precisions(args.precisions or ("bf16" if device.type == "cuda" else "fp32"))
    except ValueError as e:
        raise SystemExit(f"--precisions: {e}") from None
    baseline = baseline_of(precisions)
    shape = json.loads((Path(args.model) / "config.json").read_text()) if args.model else SHAPES[args.shape]
    model = Path(args.model).name if args.model else args.shape
    if args.kv_capacity:
        return measure_capacity(args, (baseline or precisions[0]).dtype, device)
    max_model_len = args.max_model_len or shape["max_position_embeddings"]
    requests, workload = make_requests(args, max_model_len, shape["vocab_size"])
    result: dict = {
        "env": environment(), "load_average_1_5_15min_at_start": os.getloadavg(),
        "shape": model, "args": vars(args), "workload": workload, "modes": modes,
        "block_size": args.block_size, "max_model_len": max_model_len,
        "baseline_precision": baseline.name if baseline else None,
        "precisions": {p.name: {"settings": p.engine_settings()} for p in precisions},
    }
    if args.workload == "fixed":
        result["published_peers"] = [p.record() for p in published_for(args.input_len, args.output_len,
                                                                        result["env"]["device"])]
    print(f"{len(requests)} {workload['description']}: prompt {workload['mean_prompt_len']:.0f}, output "
          f"{workload['mean_output_len']:.0f} tokens on average, longest {workload['max_total_len']}", flush=True)
    name = results_name(args, model, precisions)

    def save() -> Path:  # after every run: a run cut short still leaves what it measured
        add_ratios(result, MODES)
        result["wall_seconds"] = time.perf_counter() - began
        result["load_average_1_5_15min_at_end"] = os.getloadavg()  # others' work skews CPU runs
        return write_json(name, result, Path(args.out) if args.out else None)

    base_blocks = args.num_kv_blocks or (CPU_NUM_KV_BLOCKS if device.type == "cpu" else None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_config(args.shape, precisions[0].dtype, Path(tmp))
        for precision in precisions:
            runs = result["precisions"][precision.name]
            num_blocks = None if base_blocks is None else precision.kv_blocks_in_memory_of(base_blocks)
            for mode in modes:
                runs[mode] = run_mode(model_dir, mode, precision, args, max_model_len, num_blocks,
                                      requests, device)
                num_blocks = runs[mode]["num_kv_blocks"]  # the next mode gets exactly this pool
                save()
        hf_precision = baseline or precisions[0]
        if args.hf_requests > 0:
            try:
                result["hf_generate"] = {"precision": hf_precision.name, "dtype": hf_precision.dtype,
                                         **hf_static_batching(model_dir, requests[:args.hf_requests],
                                                              args.hf_batch_size, args.hf_max_time,
                                                              getattr(torch, hf_precision.dtype), device)}
                print(f"[transformers] {result['hf_generate']['output_tokens_per_s']:.0f} output "
                      f"tok/s", flush=True)
            except RuntimeError as e:  # out of memory, say: keep the engines' figures and the plot
                result["hf_generate_error"] = f"{type(e).__name__}: {e}"
                print(f"[transformers] failed: {result['hf_generate_error']}", flush=True)
    path = save()
    print_table(result)
    save_plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0
def measure_capacity(args: argparse.Namespace, dtype_name: str, device: torch.device) -> int:
    """The --kv-capacity run: each KV dtype's pool, on the same model and memory settings."""
    dtypes = [d for d in args.kv_capacity.split(",") if d]
    if not dtypes or any(d not in KV_CACHE_DTYPES for d in dtypes):
        raise SystemExit(f"--kv-capacity: a comma list of {', '.join(KV_CACHE_DTYPES)}")
    # Without profiling (CPU, or --num-kv-blocks): the memory of that many blocks of the model's
    # dtype, which a 1-byte pool fills with proportionally more.
    blocks = args.num_kv_blocks or (CPU_NUM_KV_BLOCKS if device.type == "cpu" else None)
    model_bytes = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    result: dict = {"env": environment(), "shape": args.shape, "dtype": dtype_name, "args": vars(args),
                    "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        for kv in dtypes:
            pool = None if blocks is None else blocks * model_bytes // kv_cache_value_bytes(kv, model_bytes)
            result["results"].append(kv_capacity.measure(
                model_dir, kv, dtype_name, args.capacity_context, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                num_kv_blocks=pool, vocab_size=int(SHAPES[args.shape]["vocab_size"]),
                run_batch=args.capacity_run))
            release_memory(device)
            print(result["results"][-1], flush=True)
    kv_capacity.print_table(result["results"])
    path = write_json(f"kv_capacity_{args.shape}_{device_tag()}", result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
