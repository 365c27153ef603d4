"""Offline throughput on ShareGPT-like requests, three ways in one run, and where the KV memory
goes while the engine serves them (issue 8's "Offline throughput" and "Memory" benchmarks).

    python -m benchmarks.bench_throughput       # CPU-sized: a tiny random Llama, 32 requests
    bash scripts/gpu.sh throughput              # the H200 run: 8B-shaped, bf16, 1,000 requests
    python -m benchmarks.bench_throughput --shape 8b --kv-capacity auto,fp8   # KV capacity only

The requests come from the simulator's seeded ShareGPT-like trace (prompt ≈ 160 and output ≈ 340
tokens on average, lognormal long tails, clipped to max_model_len), all there at the start; each
generates exactly its output length (ignore_eos). They run through
  - raypaged, paged KV cache (blocks on demand);
  - raypaged with kv_cache_mode "contiguous": every request reserves max_model_len slots when it
    starts — the allocator PagedAttention replaces — on a pool of the same number of blocks;
  - transformers `generate` with static batching: consecutive requests in batches of
    --hf-batch-size, prompts left-padded, each batch generating until its longest request is done.
    Only the tokens each request asked for count. On the first --hf-requests requests; with
    --hf-max-time a batch stops after that many seconds (what it produced by then counts, which
    favours transformers: the steps it skips are those where most rows are already done).
Every --stats-every engine steps the scheduler's KVCacheStats are sampled: pool usage, filled and
allocated slots, prefix-sharing savings. Writes benchmarks/results/throughput_<shape>_<device>.json
and a PNG beside it. --kv-cache-dtype runs both modes on that KV pool (fp8: one byte a value).

--kv-capacity DTYPES answers the capacity question instead (benchmarks/lib/kv_capacity.py): per KV
dtype, the profiled pool's blocks and the largest batch of --capacity-context-token requests that
fits, checked by running one more than that; writes kv_capacity_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
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
from benchmarks.lib.hf_static import hf_static_batching
from benchmarks.lib.kv_memory import KVSample, memory_summary, sample_kv
from benchmarks.lib.sharegpt import BenchRequest, sharegpt_requests
from raypaged import LLM, SamplingParams
from raypaged.config.sections import KV_CACHE_DTYPES, kv_cache_value_bytes
from raypaged.core.request import Request

MODES = ("paged", "contiguous")
# On the H200 the profiled pool holds ~100 reservations of 8,192 tokens for 1,000 requests: about
# one per ten requests. The CPU default keeps that regime for its 32 requests: 4 x 2,048 tokens.
CPU_NUM_KV_BLOCKS = 512


def run_engine(llm: LLM, requests: list[BenchRequest], stats_every: int, device: torch.device) -> dict:
    """Submit every request at once, step the engine until all are done. Timed from the first
    submission to the last token."""
    engine = llm.engine
    # Warm-up on a few of the requests, cut short: compiles the kernels for prefill, decode and
    # mixed steps (Triton specializes on some sizes) outside the timed run.
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids[:256]} for r in requests[:8]], warm)
    expected = sum(r.output_len for r in requests)
    samples: list[KVSample] = []
    generated = steps = 0
    preemptions_before = engine.scheduler.num_preemptions
    sync(device)
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(Request(f"bench-{i}", list(r.prompt_token_ids), params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.req_id} failed: {out.error}")
            generated += len(out.new_token_ids)
        steps += 1
        if steps % stats_every == 0:
            samples.append(sample_kv(engine, time.perf_counter() - start, steps))
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
    }


def save_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, pool, running) = plt.subplots(1, 3, figsize=(16, 4.5))
    names, values = [], []
    for mode in MODES:
        names.append(f"raypaged\n{mode}")
        values.append(result[mode]["output_tokens_per_s"])
    if "hf_generate" in result:
        names.append("transformers\nstatic batches")
        values.append(result["hf_generate"]["output_tokens_per_s"])
    bars.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray"][:len(values)])
    for x, v in enumerate(values):
        bars.text(x, v, f"{v:,.0f}", ha="center", va="bottom")
    bars.set_ylabel("output tokens / s")
    bars.set_title(f"{result['num_requests']} ShareGPT-like requests, {result['shape']} "
                   f"({result['env']['device']})")
    for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
        samples = result[mode]["samples"]
        pool_slots = result[mode]["num_kv_blocks"] * result["block_size"]
        t = [s["seconds"] for s in samples]
        pool.plot(t, [s["allocated_slots"] / pool_slots for s in samples], color=color,
                  label=f"{mode}: held")
        pool.plot(t, [s["filled_slots"] / pool_slots for s in samples], color=color,
                  linestyle="--", label=f"{mode}: holding tokens")
        running.plot(t, [s["running"] for s in samples], color=color, label=mode)
    pool.set_xlabel("seconds")
    pool.set_ylabel("share of the KV pool")
    pool.set_title("KV pool over the run")
    pool.legend(fontsize=8)
    running.set_xlabel("seconds")
    running.set_ylabel("running requests")
    running.set_title("batch size over the run")
    running.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the shape's max_position_embeddings; what a contiguous "
                             "request reserves, and the cap on a trace request's length")
    parser.add_argument("--max-total-len", type=int, default=None,
                        help="skip trace requests whose prompt + output exceed this (vLLM's "
                             "ShareGPT benchmark uses 2048); max_model_len is unchanged")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks, the same for both modes (default: profiled "
                             f"on CUDA; on CPU {CPU_NUM_KV_BLOCKS}, four max-length reservations of the "
                             "tiny shape)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="both raypaged modes with asynchronous scheduling (default on, as "
                             "the engine; off: the file name ends in _sync)")
    parser.add_argument("--stats-every", type=int, default=4, help="sample KV stats every N steps")
    parser.add_argument("--hf-requests", type=int, default=16, help="0: skip transformers")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--hf-max-time", type=float, default=None,
                        help="seconds after which a transformers batch stops (none by default)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on CPU (default 1: on a small shared machine more "
                             "threads spin against each other and every figure gets noisy)")
    parser.add_argument("--out", default=None, help="directory for the JSON and PNG")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="what the KV pool holds in the throughput modes")
    parser.add_argument("--kv-capacity", default=None,
                        help="comma list of KV dtypes (e.g. auto,fp8): measure the pool's capacity "
                             "at each instead of the throughput")
    parser.add_argument("--capacity-context", type=int, default=8192,
                        help="tokens of each request in the capacity batch")
    parser.add_argument("--capacity-run", action=argparse.BooleanOptionalAction, default=True,
                        help="check the capacity by running fits + 1 such requests at once")
    return parser.parse_args()


def run_mode(model_dir: Path, mode: str, args: argparse.Namespace, dtype_name: str,
             max_model_len: int, num_blocks: int | None, requests: list[BenchRequest],
             device: torch.device) -> dict:
    start = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              gpu_memory_utilization=args.gpu_memory_utilization,
              num_gpu_blocks_override=num_blocks, kv_cache_mode=mode,
              async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype)
    init_seconds = time.perf_counter() - start
    try:
        result = run_engine(llm, requests, args.stats_every, device)
    finally:
        llm.shutdown()
        del llm
        release_memory(device)
    result["init_seconds"] = init_seconds
    if device.type == "cuda":  # what the next run finds still taken
        result["cuda_gib_left_after_release"] = torch.cuda.memory_allocated() / 2**30
    mem = result["memory"]["all_steps"]
    print(f"[{mode}] {result['output_tokens_per_s']:.0f} output tok/s in {result['seconds']:.1f} s "
          f"(start-up {init_seconds:.0f} s); {result['num_kv_blocks']} blocks; mean running "
          f"{mem['mean_running']:.1f}; KV filled/held {mem['kv_utilization']:.1%}", flush=True)
    return result


def add_ratios(result: dict) -> None:
    if "paged" in result and "contiguous" in result:
        result["paged_vs_contiguous"] = (result["paged"]["output_tokens_per_s"]
                                         / result["contiguous"]["output_tokens_per_s"])
    if "paged" in result and "hf_generate" in result:
        hf = result["hf_generate"]
        result["paged_vs_hf"] = result["paged"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["paged_vs_hf_uncut"] = (result["paged"]["output_tokens_per_s"]
                                       / hf["projected_uncut_output_tokens_per_s"])


def main() -> int:
    began = time.perf_counter()
    args = parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma list of {', '.join(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    shape = SHAPES[args.shape]
    if args.kv_capacity:
        return measure_capacity(args, dtype_name, device)
    max_model_len = args.max_model_len or shape["max_position_embeddings"]
    requests = sharegpt_requests(args.num_requests, max_model_len, shape["vocab_size"], args.seed,
                                 args.max_total_len)
    result = {
        "env": environment(), "load_average_1_5_15min_at_start": os.getloadavg(),
        "shape": args.shape, "dtype": dtype_name, "args": vars(args),
        "num_requests": len(requests), "block_size": args.block_size, "max_model_len": max_model_len,
        "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output_len": sum(r.output_len for r in requests) / len(requests),
        "max_total_len": max(len(r.prompt_token_ids) + r.output_len for r in requests),
    }
    print(f"{len(requests)} requests: prompt {result['mean_prompt_len']:.0f}, output "
          f"{result['mean_output_len']:.0f} tokens on average, longest {result['max_total_len']}",
          flush=True)
    name = f"throughput_{args.shape}_{device_tag()}" + ("" if args.async_scheduling else "_sync")

    def save() -> Path:  # after every phase: a run cut short still leaves what it measured
        add_ratios(result)
        result["wall_seconds"] = time.perf_counter() - began
        result["load_average_1_5_15min_at_end"] = os.getloadavg()  # others' work skews CPU runs
        return write_json(name, result, Path(args.out) if args.out else None)

    num_blocks = args.num_kv_blocks or (CPU_NUM_KV_BLOCKS if device.type == "cpu" else None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        for mode in modes:
            result[mode] = run_mode(model_dir, mode, args, dtype_name, max_model_len, num_blocks,
                                    requests, device)
            num_blocks = result[mode]["num_kv_blocks"]  # the next mode gets exactly this pool
            save()
        if args.hf_requests > 0:
            try:
                result["hf_generate"] = hf_static_batching(
                    model_dir, requests[:args.hf_requests], args.hf_batch_size, args.hf_max_time,
                    getattr(torch, dtype_name), device)
                print(f"[transformers] {result['hf_generate']['output_tokens_per_s']:.0f} output "
                      f"tok/s", flush=True)
            except RuntimeError as e:  # out of memory, say: keep the engines' figures and the plot
                result["hf_generate_error"] = f"{type(e).__name__}: {e}"
                print(f"[transformers] failed: {result['hf_generate_error']}", flush=True)
    path = save()
    print_table(result, modes)
    if set(MODES) <= set(modes):
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


def print_table(result: dict, modes: list[str]) -> None:
    print("\n| what | figure |\n| --- | --- |")
    for mode in modes:
        r, mem = result[mode], result[mode]["memory"]["all_steps"]
        print(f"| raypaged {mode} | {r['output_tokens_per_s']:,.0f} output tok/s ({r['seconds']:.1f} s, "
              f"mean running {mem['mean_running']:.1f}, peak {r['memory']['peak_running']}, "
              f"{r['preemptions']} preemptions) |")
        print(f"| KV memory, {mode} | filled / held {mem['kv_utilization']:.1%}; pool holding tokens "
              f"{mem['pool_token_states']:.1%}, held but empty {mem['waste_share_of_pool']:.1%}; "
              f"{mem['unfilled_slots_per_running_request']:.1f} empty slots per running request |")
    if "paged_vs_contiguous" in result:
        print(f"| paged / contiguous reservation | {result['paged_vs_contiguous']:.2f}x (target >= 2x) |")
    if "hf_generate" in result:
        hf = result["hf_generate"]
        cut = ", cut by --hf-max-time" if hf["truncated"] else ""
        print(f"| transformers static batches ({hf['requests']} requests, batch {hf['batch_size']}{cut}) "
              f"| {hf['output_tokens_per_s']:,.0f} output tok/s "
              f"(uncut at the same step rate: {hf['projected_uncut_output_tokens_per_s']:,.0f}) |")
    if "paged_vs_hf" in result:
        print(f"| paged / transformers | {result['paged_vs_hf']:.1f}x (target >= 20x; "
              f"{result['paged_vs_hf_uncut']:.1f}x against the uncut figure) |")
    print(f"| whole run | {result['wall_seconds']:.0f} s |")


if __name__ == "__main__":
    sys.exit(main())
