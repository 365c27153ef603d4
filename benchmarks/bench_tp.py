"""Tensor parallelism over Ray (issue 10): the same random-weights model at every --tp-sizes.

    python -m benchmarks.bench_tp --tp-sizes 1,2          # CPU: tiny Llama, fp32, gloo
    bash scripts/gpu.sh tp                                # two H200s: 8B (and 70B), bf16, NCCL

Every TP size runs on the Ray executor with load_format "dummy", whose tensors are generated
whole from (seed, name) and then sliced per rank (model/loader.py): one model at every TP size.
Per TP size, the JSON records
  - greedy tokens of 4 fixed prompts and, against the smallest TP size, the first diverging
    position per prompt. fp32 over gloo must match (--require-identical exits 1 if not); in bf16
    another all-reduce order can flip a near-tie, so on the GPU divergence is reported;
  - decode step time at each --batch-sizes and --context (benchmarks.lib.decode.decode_step_ms);
  - the collectives' share of that step, measured: all ranks replay, alone, one decode step's
    collectives, counted from the loaded model (an all-reduce of [batch padded to its CUDA
    graph, hidden] per row-parallel linear and for the vocab-parallel embedding, from a CUDA
    graph as in the decode forward; the LM head's all-gather of [batch, vocab / tp]; with async
    scheduling, rank 0's broadcast of the sampled ids), timed on rank 0 by CUDA events
    (perf_counter on CPU), median of --probe-iters. A replay rather than a profile of live steps
    because it works alike on CPU (the profiler sees CPU ops of its own thread only, and a Ray
    worker runs compiled-graph steps on another) and GPU, and it isolates the communication.
    It misses waiting for the slower rank inside real steps: on CUDA, --profile-steps N traces
    N live steps per rank and sums the NCCL kernels (waits included; a `busy` well below the
    step time would mean the trace missed the CUDA graphs' kernels);
  - offline throughput (benchmarks.lib.decode.throughput).
A TP size is skipped, with the reason recorded, when the host has fewer GPUs than ranks or the
rank's weights (the model built on the meta device) exceed --gpu-memory-utilization x its GPU.
Writes benchmarks/results/tp_<shape>_<device>.json after every TP size, and a PNG.
"""

from __future__ import annotations

import os

# NVLink multicast can take the host's GPUs out of service (issue 10): off before anything starts
# NCCL, here and in the Ray workers (runtime_env below; they report what they saw).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _key, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_key, _value)

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib import tp_probes
from benchmarks.lib.common import (
    SHAPES,
    decode_setup,
    device_tag,
    environment,
    release_memory,
    write_config,
    write_json,
)
from benchmarks.lib.decode import (
    check_batch_kept,
    decode_output_tokens,
    decode_step_ms,
    prompts,
    start_decoding,
    throughput,
)
from raypaged import LLM, SamplingParams

GREEDY_PROMPT_LENS = (7, 19, 45, 100)


def start_ray(device: torch.device) -> None:
    import ray

    # The rank-side functions go by value: the workers cannot import the benchmarks package.
    ray.cloudpickle.register_pickle_by_value(tp_probes)
    if not ray.is_initialized():
        ray.init(num_cpus=None if device.type == "cuda" else 4, include_dashboard=False,
                 log_to_driver=False,
                 runtime_env={"env_vars": {k: os.environ[k] for k in MULTICAST_OFF}})


def skip_reason(model_dir: Path, tp: int, dtype: torch.dtype, fraction: float) -> str | None:
    if not torch.cuda.is_available():
        return None
    if torch.cuda.device_count() < tp:
        return f"{tp} ranks need {tp} GPUs; this machine has {torch.cuda.device_count()}"
    from raypaged.model import parallel
    from raypaged.model.config import ModelConfig
    from raypaged.model.registry import MODEL_REGISTRY

    config = ModelConfig.from_pretrained(model_dir)
    parallel.init_tensor_parallel(rank=0, world_size=tp)  # rank 0 holds the most (vocab padding)
    try:
        with torch.device("meta"):
            model = MODEL_REGISTRY[config.architecture](config)
    finally:
        parallel.reset_tensor_parallel()
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    total = torch.cuda.get_device_properties(0).total_memory
    if need > fraction * total:
        return f"weights {need / 1e9:.1f} GB per GPU > {fraction} x {total / 1e9:.1f} GB of memory"
    return None


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if index == len(a) == len(b) else index


def profiled_steps(llm: LLM, batch: int, context: int, steps: int, vocab: int) -> list[dict]:
    engine = llm.engine
    ids = start_decoding(engine, batch, context, vocab, steps, "profile")
    for _ in range(3):
        engine.step()
    engine.executor.collective_rpc(tp_probes.profile_start)
    for _ in range(steps):
        engine.step()
    ranks = engine.executor.collective_rpc(tp_probes.profile_stop, (steps,))
    check_batch_kept(engine, batch)
    engine.abort_requests(ids)
    drain(engine)
    return ranks


def measure(run: dict, args, model_dir: Path, tp: int, dtype_name: str, vocab: int,
            batch_sizes: list[int], device: torch.device, eager: bool) -> None:
    """Fills `run` as it goes, so a failure part-way keeps what was measured."""
    start = time.perf_counter()
    batched_tokens = 8192 if device.type == "cuda" else 1024
    max_len = max(args.context + decode_output_tokens(max(batch_sizes), args.context, args.decode_steps,
                                                      batched_tokens),
                  args.prompt_len + args.output_len + 8, max(GREEDY_PROMPT_LENS) + args.greedy_tokens + 8)
    llm = LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
              tensor_parallel_size=tp, distributed_executor_backend="ray", max_model_len=max_len,
              max_num_seqs=max(batch_sizes + [args.throughput_batch]),
              max_num_batched_tokens=batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=2**28,
              async_scheduling=args.scheduling == "async", enforce_eager=eager,
              piecewise_cuda_graph=args.piecewise_cuda_graph)
    executor = llm.engine.executor
    try:
        run.update(start_s=time.perf_counter() - start, enforce_eager=eager,
                   num_kv_blocks=llm.engine.num_blocks)
        run["workers"] = executor.collective_rpc(tp_probes.worker_env, (sorted(MULTICAST_OFF),))
        if device.type == "cuda" and any(w[k] != v for w in run["workers"]
                                         for k, v in MULTICAST_OFF.items()):
            raise RuntimeError(f"NVLink multicast is not off in a worker: {run['workers']}")
        params = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
        fixed = [prompts(1, n, vocab, seed=100 + n)[0] for n in GREEDY_PROMPT_LENS]
        run["greedy"] = [list(r.outputs[0].token_ids) for r in llm.generate(fixed, params)]
        run["decode"] = []
        for batch in batch_sizes:
            # "cpu": the driver runs nothing on a GPU, and a device sync would only open a CUDA
            # context beside rank 0's.
            step_ms, _ = decode_step_ms(llm, batch, args.context, args.decode_steps, vocab,
                                     torch.device("cpu"))
            row = {"batch": batch, "context": args.context, "step_ms": step_ms}
            run["decode"].append(row)
            drain(llm.engine)  # the probe must not meet a step in flight
            line = f"[tp {tp}] decode B={batch}: {step_ms:.2f} ms/step"
            if tp > 1:
                c = executor.collective_rpc(tp_probes.step_collectives, (batch, args.probe_iters))[0]
                row.update(collectives=c, collectives_share=c["total_ms"] / step_ms,
                           all_reduce_share=c["all_reduce_ms"] / step_ms)
                line += f", collectives {c['total_ms']:.3f} ms ({row['collectives_share']:.1%})"
            print(line, flush=True)
        run["throughput"] = throughput(llm, args.throughput_batch, args.prompt_len, args.output_len,
                                       vocab)
        print(f"[tp {tp}] {run['throughput']['output_tokens_per_s']:.0f} output tok/s", flush=True)
        for row in run["decode"] if args.profile_steps and tp > 1 else []:
            # Last: should the profiler break the group, only this is lost.
            row["profiled"] = p = profiled_steps(llm, row["batch"], args.context,
                                                 args.profile_steps, vocab)
            print(f"[tp {tp}] live steps B={row['batch']}, rank 0: NCCL kernels "
                  f"{p[0]['nccl_ms']:.3f} ms of {p[0]['busy_ms']:.2f} ms busy", flush=True)
    finally:
        llm.shutdown()
        del llm, executor
        release_memory(device)
        run["seconds"] = time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,8")
    for flag, default in [("--context", 128), ("--decode-steps", 10), ("--greedy-tokens", 32),
                          ("--throughput-batch", 16), ("--prompt-len", 64), ("--output-len", 32),
                          ("--probe-iters", 20), ("--profile-steps", 0)]:
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--scheduling", choices=["sync", "async"], default="async")
    parser.add_argument("--dtype", default=None,
                        help="weights' dtype (default bfloat16 on CUDA, float32 on CPU); float32 "
                             "on the GPU makes greedy tokens comparable across TP sizes")
    parser.add_argument("--piecewise-cuda-graph", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--require-identical", action="store_true",
                        help="exit 1 unless every TP size not skipped ran and matched")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    device, dtype_name, vocab, batch_sizes = decode_setup(args.shape, args.batch_sizes)
    dtype_name = args.dtype or dtype_name
    if device.type == "cuda" and any(os.environ[k] != v for k, v in MULTICAST_OFF.items()):
        print(f"refusing to run: NVLink multicast must stay off ({MULTICAST_OFF})")
        return 2
    result = {"env": environment(), "shape": args.shape, "dtype": dtype_name, "args": vars(args),
              "driver_env": {k: os.environ[k] for k in MULTICAST_OFF}, "runs": {}}
    start_ray(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        for tp in sorted({int(t) for t in args.tp_sizes.split(",")}):
            run = result["runs"][str(tp)] = {"tp": tp}
            run["skipped"] = skip_reason(model_dir, tp, getattr(torch, dtype_name),
                                         args.gpu_memory_utilization)
            if run["skipped"]:
                print(f"[tp {tp}] skipped: {run['skipped']}", flush=True)
            # A group that cannot start with CUDA graphs (NCCL inside a capture has never run
            # here) gets one eager try, so that the device call still yields figures.
            for eager in [] if run["skipped"] else [False, True]:
                try:
                    measure(run, args, model_dir, tp, dtype_name, vocab, batch_sizes, device, eager)
                    break
                except Exception as e:  # noqa: BLE001 - recorded; the other TP sizes still run
                    run["error" if eager else "error_with_cuda_graphs"] = f"{type(e).__name__}: {e}"
                    print(f"[tp {tp}] failed: {type(e).__name__}: {e}", flush=True)
                    import ray

                    ray.shutdown()  # a group that failed part-way may still hold actors and GPUs
                    start_ray(device)
                    if device.type != "cuda" or "greedy" in run:
                        break
            compare(result)
            name = f"tp_{args.shape}_{device_tag()}" + ("" if args.dtype is None else f"_{args.dtype}")
            path = write_json(name, result, args.out)
    report(result)
    save_plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    ran = [r for r in result["runs"].values() if not r["skipped"]]
    failed = not ran or any(not r.get("identical_to_reference") for r in ran)
    return 1 if args.require_identical and failed else 0


def compare(result: dict) -> None:
    """Each run's greedy tokens against those of the smallest TP size that produced any."""
    runs = [r for r in result["runs"].values() if "greedy" in r]
    for run in runs:
        positions = [first_divergence(a, b) for a, b in zip(runs[0]["greedy"], run["greedy"])]
        run.update(reference_tp=runs[0]["tp"], first_divergence=positions,
                   identical_to_reference=all(p is None for p in positions))


def report(result: dict) -> None:
    print("\n| TP | batch | decode step | collectives replayed (share) | of which all-reduce | live "
          "steps, rank 0: NCCL of busy |\n| --- | --- | --- | --- | --- | --- |")
    for tp, run in result["runs"].items():
        for row in run.get("decode", []):
            c, p = row.get("collectives"), (row.get("profiled") or [None])[0]
            print(f"| {tp} | {row['batch']} | {row['step_ms']:.2f} ms | " + (
                f"{c['total_ms']:.3f} ms ({row['collectives_share']:.1%}) | {c['all_reduce_ms']:.3f}"
                f" ms ({row['all_reduce_share']:.1%}) | " if c else "- | - | ")
                + (f"{p['nccl_ms']:.3f} of {p['busy_ms']:.2f} ms |" if p else "- |"))
    for tp, run in result["runs"].items():
        if "greedy" not in run:
            why = run["skipped"] or run.get("error") or run.get("error_with_cuda_graphs")
            print(f"TP {tp}: not run: {why}")
            continue
        same = ("identical" if run["identical_to_reference"]
                else f"first divergence per prompt at {run['first_divergence']}")
        print(f"TP {tp}: {run.get('throughput', {}).get('output_tokens_per_s', 0):,.0f} output tok/s;"
              f" started in {run['start_s']:.0f} s{' (eager)' if run['enforce_eager'] else ''}; "
              f"greedy tokens vs TP {run['reference_tp']}: {same}")


def save_plot(result: dict, path: Path) -> None:
    """Left: decode step time and its collectives' time against TP size, per batch. Right:
    offline throughput against TP size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"].values() if r.get("decode")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, batch in enumerate(sorted({row["batch"] for r in runs for row in r["decode"]})):
        points = [(r["tp"], row) for r in runs for row in r["decode"] if row["batch"] == batch]
        left.plot(*zip(*[(tp, row["step_ms"]) for tp, row in points]), "o-", color=f"C{i}",
                  label=f"decode step, batch {batch}")
        coll = [(tp, row["collectives"]["total_ms"]) for tp, row in points if "collectives" in row]
        if coll:
            left.plot(*zip(*coll), "s--", color=f"C{i}", label=f"its collectives, batch {batch}")
    left.set_xscale("log", base=2)
    left.set_xticks([r["tp"] for r in runs], [str(r["tp"]) for r in runs])
    left.set(ylim=(0, None), xlabel="tensor-parallel size", ylabel="ms",
             title=f"{result['shape']}, context {result['args']['context']}")
    left.legend(fontsize=7)
    done = [r for r in runs if "throughput" in r]
    right.bar([str(r["tp"]) for r in done], [r["throughput"]["output_tokens_per_s"] for r in done])
    a = result["args"]
    right.set(xlabel="tensor-parallel size", ylabel="output tokens/s",
              title=f"{a['throughput_batch']} x ({a['prompt_len']} + {a['output_len']}) tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
