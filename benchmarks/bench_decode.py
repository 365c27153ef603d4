"""The decode step of a random-weights Llama, four ways (--mode):

    time    the whole engine's steady decode step at each --batch-sizes with --context tokens of
            context, against the byte floor (weights and KV read once at the copy bandwidth
            measured in the same run), and output tokens/s of --throughput-batch requests of
            --prompt-len + --output-len tokens (--hf: transformers `generate` beside it)
            -> decode_<shape>_<device>.json, .png
    phases  where a step's host time goes, phase by phase, in process and through a Ray actor
            (benchmarks/lib/phases.py) -> decode_phases_<shape>_<device>[_mixed][_no_piecewise].json
    trace   the GPU's kernel time per step against the wall time, the top kernels and what each
            kernel of a layer adds (benchmarks/lib/trace.py) -> decode_trace_<shape>_<device>.json, .png
    model   the model alone, eager and CUDA graph, no engine (benchmarks/lib/model_step.py;
            CUDA only) -> decode_model_<shape>_<device>.json

    python -m benchmarks.bench_decode                                  # CPU-sized: tiny shape, time
    python -m benchmarks.bench_decode --shape 8b --batch-sizes 1,8,64,256 --context 1024 \\
        --steps 50 --executors uni --scheduling async --throughput-batch 8 --prompt-len 64 \\
        --output-len 32                                                # scripts/gpu.sh decode

Each of --executors (uni: in process; ray: the worker in a Ray actor) runs with each of
--scheduling (sync: one step at a time; async: step N+1 scheduled while step N runs). A step's
time is the wall time of --steps steps over their number, in steady state (with async
scheduling a step call returns the previous step's tokens, so the pipeline's period, not one
call's duration, is the step time). The floor's bandwidth is the higher of two copy
measurements, one before and one after the runs (the card's clocks vary between them by a few
percent). Every window checks that its batch stayed whole (benchmarks/lib/decode.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib import decode, phases, trace
from benchmarks.lib.common import (
    SHAPES,
    add_replot_argument,
    copy_bandwidth,
    device_tag,
    environment,
    hf_random_model,
    release_memory,
    replot,
    sync,
    write_config,
    write_json,
)
from raypaged import LLM

MODES = ("time", "phases", "trace", "model")
# Per mode: default --steps, --executors, --scheduling.
DEFAULTS = {"time": (10, "uni", "sync,async"), "phases": (30, "uni,ray", "sync"),
            "trace": (20, "uni", "sync,async"), "model": (0, "uni", "sync")}


def build_llm(args: argparse.Namespace, model_dir: Path, dtype_name: str, executor: str,
              scheduling: str, device: torch.device) -> LLM:
    """The engine each mode times, sized so that no window's request finishes inside it."""
    batch_sizes = args.batch_list
    if args.mode == "trace":
        # The engine's default token budget is at least 2,048: the bound assumed when none is given.
        budget = args.max_num_batched_tokens
        max_len = args.context + decode.decode_output_tokens(max(batch_sizes), args.context, args.steps,
                                                             budget or 2048)
        seqs = args.max_num_seqs or max(batch_sizes)
    else:
        budget = args.max_num_batched_tokens or (8192 if device.type == "cuda" else
                                                 1024 if args.mode == "time" else 2048)
        max_len = args.context + decode.decode_output_tokens(max(batch_sizes), args.context, args.steps,
                                                             budget)
        if args.mode == "time":
            max_len = max(max_len, args.prompt_len + args.output_len + 8)
            seqs = args.max_num_seqs or max(batch_sizes + [args.throughput_batch])
        else:
            max_len = max(max_len, args.mixed_prompt_len + args.steps + 16)
            seqs = args.max_num_seqs or max(batch_sizes) + (args.steps if args.mixed_prompt_len else 0)
    # Only what a run changes from the engine's defaults (CUDA graphs, piecewise graphs).
    extra = {"enforce_eager": True} if args.enforce_eager else {}
    if args.no_piecewise_cuda_graph:
        extra["piecewise_cuda_graph"] = False
    return LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
               max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=budget,
               gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=2**30,
               distributed_executor_backend=executor, async_scheduling=scheduling == "async", **extra)


def start_ray(with_phase_timers: bool) -> None:
    import ray

    if not ray.is_initialized():
        runtime_env = {"worker_process_setup_hook": phases.ray_worker_setup_hook} if with_phase_timers else None
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 runtime_env=runtime_env)


def run_engine_modes(args: argparse.Namespace, result: dict, device: torch.device, dtype_name: str) -> None:
    """time / phases / trace: one engine per (executor, scheduling), every batch size on it."""
    vocab = SHAPES[args.shape]["vocab_size"]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        if args.mode == "time" and args.hf:
            dtype = getattr(torch, dtype_name)
            result["hf_generate"] = hf_throughput(model_dir, args, vocab, dtype, device)
            print(f"transformers generate: {result['hf_generate']['output_tokens_per_s']:.0f} tok/s", flush=True)
        for executor in args.executors.split(","):
            if executor == "ray":
                start_ray(with_phase_timers=args.mode == "phases")
                worker_steps = phases.ray_worker_steps
            elif args.mode == "phases":
                worker_steps = phases.install_in_process_timers()
            for scheduling in args.scheduling.split(","):
                llm = build_llm(args, model_dir, dtype_name, executor, scheduling, device)
                result.setdefault("num_kv_blocks", llm.engine.num_blocks)
                for batch in args.batch_list:
                    if args.mode == "time":
                        step_ms, calls = decode.decode_step_ms(llm, batch, args.context, args.steps, vocab, device)
                        rows.append({"executor": executor, "scheduling": scheduling, "batch": batch,
                                     "context": args.context, "step_ms": step_ms,
                                     "call_ms_median": statistics.median(calls), "call_ms": calls})
                        print(f"[{executor}, {scheduling}] decode B={batch}: {step_ms:.2f} ms/step "
                              f"(one call's median {rows[-1]['call_ms_median']:.2f} ms)", flush=True)
                    elif args.mode == "phases":
                        row = phases.profile_batch(llm, batch, args.context, args.steps, vocab, worker_steps,
                                                   args.mixed_prompt_len)
                        result["phases_us"][f"{executor}/{scheduling}/{batch}"] = row
                        print(f"[{executor}, {scheduling}] batch {batch}: "
                              + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
                    else:
                        run = trace.trace_steps(llm, batch, args.context, args.steps, vocab, device)
                        result["runs"][f"{scheduling}/{batch}"] = run
                        print(f"[{scheduling}] batch {batch}: {run['wall_ms']:.2f} ms a step, GPU busy "
                              f"{run['busy_ms']:.2f} ms ({run['idle_share']:.0%} idle)", flush=True)
                        for name, ms in run["top_kernels_ms"][:6]:
                            print(f"    {ms:7.3f} ms  {name}")
                if args.mode == "time" and (executor == "uni" or "raypaged" not in result):
                    # Throughput with the last in-process scheduling mode listed (async if asked).
                    result["raypaged"] = decode.throughput(llm, args.throughput_batch, args.prompt_len,
                                                           args.output_len, vocab)
                    result["raypaged"].update(executor=executor, scheduling=scheduling)
                llm.shutdown()
                del llm
                release_memory(device)
    if args.mode == "time":
        result["decode"] = rows


def hf_throughput(model_dir: Path, args: argparse.Namespace, vocab: int, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """transformers `generate`, one static batch of the throughput requests (one length: no padding)."""
    count, prompt_len, output_len = args.throughput_batch, args.prompt_len, args.output_len
    model = hf_random_model(model_dir, dtype, device)
    ids = torch.tensor([p["prompt_token_ids"] for p in decode.prompts(count, prompt_len, vocab, seed=7)],
                       device=device)
    kwargs = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, **{**kwargs, "attention_mask": torch.ones_like(ids[:2])})
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, **kwargs)
        sync(device)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - prompt_len) * count
    del model, out
    release_memory(device)
    return {"requests": count, "output_tokens": generated, "seconds": elapsed,
            "output_tokens_per_s": generated / elapsed}


def report_time(args: argparse.Namespace, result: dict, device: torch.device, element: int,
                bandwidth: float) -> None:
    """Each decode row's floor and ratio, Ray's cost per step, and the table printed last."""
    rows = result["decode"]
    after = copy_bandwidth(device)
    result["copy_bandwidth_TBps_after"] = after / 1e12
    bandwidth = max(bandwidth, after)  # the better of the two copies: the stricter bar
    for row in rows:
        row["floor_ms"] = (decode.weight_bytes(args.shape, element, row["batch"]) + row["batch"] * args.context
                           * decode.kv_bytes_per_token(args.shape, element)) / bandwidth * 1e3
        row["ratio_to_floor"] = row["step_ms"] / row["floor_ms"]
    ours = result["raypaged"]["output_tokens_per_s"]
    print("\n| what | figure |\n| --- | --- |")
    print(f"| copy bandwidth | {bandwidth / 1e12:.2f} TB/s |")
    for row in rows:
        print(f"| decode step [{row['executor']}, {row['scheduling']}], batch {row['batch']}, context "
              f"{row['context']} | {row['step_ms']:.2f} ms ({row['ratio_to_floor']:.2f}x the "
              f"{row['floor_ms']:.2f} ms floor) |")
    by_key = {(r["executor"], r["scheduling"], r["batch"]): r["step_ms"] for r in rows}
    for scheduling in args.scheduling.split(","):
        for batch in args.batch_list:
            uni, ray_ = by_key.get(("uni", scheduling, batch)), by_key.get(("ray", scheduling, batch))
            if uni and ray_:
                overhead = ray_ / uni - 1
                result.setdefault("ray_overhead", {}).setdefault(scheduling, {})[str(batch)] = overhead
                print(f"| Ray's cost per step ({scheduling}), batch {batch} | {overhead * 100:+.1f}% |")
    print(f"| raypaged ({result['raypaged']['executor']}, {result['raypaged']['scheduling']}), "
          f"{args.throughput_batch} x ({args.prompt_len} + {args.output_len}) | {ours:.0f} output tok/s |")
    if "hf_generate" in result:
        hf = result["hf_generate"]["output_tokens_per_s"]
        result["speedup_vs_hf"] = ours / hf
        print(f"| transformers generate, same requests | {hf:.0f} output tok/s ({ours / hf:.1f}x) |")


def plot_time(result: dict, path: Path) -> None:
    """Decode step time against batch size, per executor and scheduling, beside the byte floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decode"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["executor"], r["scheduling"]) for r in rows}):
        mine = sorted((r for r in rows if (r["executor"], r["scheduling"]) == key), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], "o-",
                label=f"raypaged ({key[0]}, {key[1]})")
    floor = sorted({(r["batch"], r["floor_ms"]) for r in rows})
    ax.plot([b for b, _ in floor], [f for _, f in floor], "k--", label="byte floor")
    ax.plot([b for b, _ in floor], [1.2 * f for _, f in floor], "k:", label="1.2x floor (target)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (decoding requests)")
    ax.set_ylabel("decode step, ms")
    ax.set_title(f"decode step, context {rows[0]['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_phases(result: dict) -> None:
    keys = sorted({k for row in result["phases_us"].values() for k in row})
    columns = list(result["phases_us"])
    print("\n| phase (median µs) | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{result['phases_us'][c].get(key, float('nan')):.0f}"
                                         for c in columns) + " |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="time")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed (traced) steps a batch; default 10 (time), 30 (phases), 20 (trace)")
    parser.add_argument("--executors", default=None,
                        help="comma list of uni,ray (ray = the worker in a Ray actor, the step broadcast "
                             "over a compiled graph); default uni, phases uni,ray; trace runs uni only")
    parser.add_argument("--scheduling", default=None,
                        help="comma list of sync,async; default sync,async, phases sync")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: the largest batch (time: or --throughput-batch)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: 8,192 on CUDA (trace: the engine's default)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    time_args = parser.add_argument_group("--mode time")
    time_args.add_argument("--throughput-batch", type=int, default=16)
    time_args.add_argument("--prompt-len", type=int, default=64)
    time_args.add_argument("--output-len", type=int, default=32)
    time_args.add_argument("--hf", action="store_true", help="also time transformers generate")
    phase_args = parser.add_argument_group("--mode phases")
    phase_args.add_argument("--enforce-eager", action="store_true")
    phase_args.add_argument("--no-piecewise-cuda-graph", action="store_true",
                            help="mixed steps run eagerly (the effect of piecewise graphs)")
    phase_args.add_argument("--mixed-prompt-len", type=int, default=0,
                            help="add a request with a prompt this long before every measured step, "
                                 "so each step mixes the batch's decodes with one prefill")
    model_args = parser.add_argument_group("--mode model")
    model_args.add_argument("--profile", action="store_true", help="print a profile of each decode step")
    model_args.add_argument("--quantization", choices=("fp8",), default=None,
                            help="fp8: the linears quantized at load (W8A8 e4m3, _scaled_mm)")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    add_replot_argument(parser)
    args = parser.parse_args(argv)
    steps, executors, scheduling = DEFAULTS[args.mode]
    args.steps = steps if args.steps is None else args.steps
    args.executors = args.executors or executors
    args.scheduling = args.scheduling or scheduling
    if args.mode == "trace" and args.executors != "uni":
        parser.error("--mode trace profiles this process: --executors uni only")
    args.batch_list = [int(b) for b in args.batch_sizes.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, plot_time if args.mode == "time" else trace.plot)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    recorded = {k: v for k, v in vars(args).items() if k not in ("batch_list", "replot")}
    result: dict = {"env": environment(), "mode": args.mode, "shape": args.shape, "dtype": dtype_name,
                    "args": recorded}
    name = f"decode_{args.shape}_{device_tag()}"
    if args.mode == "model":
        if device.type != "cuda":
            print("--mode model needs CUDA")
            return 2
        from benchmarks.lib.model_step import time_steps

        result["timing"] = time_steps(args.shape, args.batch_list, args.context, args.profile, device,
                                      quantization=args.quantization)
        tag = "decode_model_fp8_" if args.quantization else "decode_model_"
        print(f"wrote {write_json(name.replace('decode_', tag), result, args.out)}")
        return 0
    if args.mode == "time":
        element = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
        bandwidth = copy_bandwidth(device)
        result["copy_bandwidth_TBps"] = bandwidth / 1e12
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    result.update({"phases": {"phases_us": {}}, "trace": {"runs": {}}}.get(args.mode, {}))
    run_engine_modes(args, result, device, dtype_name)
    if args.mode == "time":
        report_time(args, result, device, element, bandwidth)
        path = write_json(name, result, args.out)
        plot_time(result, path.with_suffix(".png"))
    elif args.mode == "trace":
        path = write_json(name.replace("decode_", "decode_trace_"), result, args.out)
        trace.plot(result, path.with_suffix(".png"))
    else:
        print_phases(result)
        suffix = ("_mixed" if args.mixed_prompt_len else "") + ("_no_piecewise" if args.no_piecewise_cuda_graph else "")
        path = write_json(name.replace("decode_", "decode_phases_") + suffix, result, args.out)
    print(f"wrote {path}" + (f" and {path.with_suffix('.png').name}" if args.mode != "phases" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
