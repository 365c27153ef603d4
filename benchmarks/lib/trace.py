"""How busy the GPU is during decode (benchmarks.bench_decode --mode trace).

A decode step's distance from the byte floor is either kernels slower than the floor (busy ~
wall) or the GPU waiting between steps (busy < wall): the trace tells which, and lists the
kernels by time. Steps are traced with torch.profiler after the batch is decoding; busy = the sum
of the CUDA kernels' and copies' durations in the traced steps (kernels do not overlap within one
stream; if busy reads 0, the profiler's events were not parsed as expected: it says so). Under
programmatic dependent launch a kernel's traced duration includes its wait for the one before:
per-kernel durations are read with it off, what each kernel adds (`layer_profile`) with it on.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib.common import sync
from benchmarks.lib.decode import check_batch_kept, start_decoding
from raypaged import LLM


def trace_steps(llm: LLM, batch: int, context: int, steps: int, vocab: int,
                device: torch.device) -> dict:
    """Wall and GPU-busy ms per step over `steps` traced decode steps of `batch` requests, the
    top kernels (ms a step) and the per-layer profile."""
    engine = llm.engine
    ids = start_decoding(engine, batch, context, vocab, steps, "idle")
    for _ in range(3):  # fill the async pipeline, settle the allocator
        engine.step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    check_batch_kept(engine, batch)
    engine.abort_requests(ids)
    engine.step()
    engine.step()
    kernels, timeline = cuda_kernels(prof)
    busy_us = sum(kernels.values()) / steps
    if device.type == "cuda" and not kernels:
        print("warning: no CUDA kernel events in the trace: busy time unknown", flush=True)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": wall / steps * 1e3, "busy_ms": busy_us / 1e3,
            "idle_share": 1 - busy_us / 1e3 / (wall / steps * 1e3),
            "top_kernels_ms": [(name[:90], total / steps / 1e3) for name, total in top],
            "per_layer_us": layer_profile(sorted(timeline))}


def cuda_kernels(prof: profile) -> tuple[dict[str, float], list[tuple[float, float, str]]]:
    """A trace's CUDA kernels: µs by kernel name (summed), and each launch's (start, end, name)."""
    kernels: dict[str, float] = defaultdict(float)
    timeline = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total
            timeline.append((event.time_range.start, event.time_range.end, event.name))
    return kernels, timeline


def layer_profile(timeline: list[tuple[float, float, str]]) -> dict[str, list[float]]:
    """Per kernel of a decoder layer: [its mean duration, the mean time it adds to the stream]
    in µs over the traced layers.

    timeline: the traced GPU events (start, end, name) in start order. A layer's kernels are
    those from one attention kernel ("decode_split") up to the next, each labelled by its name
    and its occurrence in the layer ("_gemv_kernel#2": the layer's third GEMM). What a kernel
    adds is its end minus the previous kernel's end: with programmatic dependent launch a kernel
    starts while its predecessor runs, so its duration overlaps it, but this does not.

    Only the layers whose kernel names are the most common sequence count: the one spanning two
    steps (the last layer's MLP, final norm, LM head, sampling, the next step's embedding and
    first QKV) would otherwise pass its LM head off as a QKV."""
    segments: list[list[tuple[str, float, float]]] = [[]]
    previous_end = None
    for start, end, name in timeline:
        adds = end - previous_end if previous_end is not None else end - start
        previous_end = end if previous_end is None else max(previous_end, end)
        if "decode_split" in name and segments[-1]:
            segments.append([])
        segments[-1].append((name, end - start, adds))
    # The first segment starts mid-step and the last one ends there: neither is a whole layer.
    whole = segments[1:-1]
    if not whole:
        return {}
    shapes = Counter(tuple(name for name, _, _ in segment) for segment in whole)
    common, count = shapes.most_common(1)[0]
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for segment in whole:
        if tuple(name for name, _, _ in segment) != common:
            continue
        seen: dict[str, int] = defaultdict(int)
        for name, duration, adds in segment:
            label = f"{name[:40]}#{seen[name]}"
            seen[name] += 1
            sums[label][0] += duration
            sums[label][1] += adds
    return {label: [duration / count, adds / count] for label, (duration, adds) in sums.items()}


def kernel_family(name: str) -> str:
    """A kernel's name as the plot groups it."""
    # The FP8 keys first: an FP8 GEMM's name may also hold a generic GEMM key below.
    for key, family in [("w8a8", "fused W8A8 GEMM"), ("f8f8", "FP8 GEMM (scaled_mm)"),
                        ("fp8_quant", "FP8 activation quantization"), ("quantize", "FP8 activation quantization"),
                        ("_one_row_kernel", "FP8 skinny GEMM"),
                        ("nvjet", "cuBLAS GEMM"), ("gemv", "skinny GEMM"), ("Kernel2", "cuBLAS GEMM"),
                        ("splitKreduce", "cuBLAS GEMM"), ("cutlass", "CUTLASS GEMM"), ("gemm", "GEMM (other)"),
                        ("decode", "attention"), ("_merge_kernel", "attention"), ("_plan_kernel", "attention"),
                        ("prefill", "attention"), ("attention", "attention"),
                        ("rms_norm", "RMSNorm"), ("rope", "rope"), ("silu", "SwiGLU"),
                        ("write_kv", "KV write")]:
        if key in name:
            return family
    return "other"


def plot(result: dict, path: Path) -> None:
    """Per case, the GPU's time a step by kernel family (of the top kernels; the rest of the busy
    time as "other kernels"), then the idle time up to the wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["runs"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    families = ["cuBLAS GEMM", "skinny GEMM", "attention", "RMSNorm", "rope", "SwiGLU", "KV write",
                "other", "other kernels", "idle"]
    colors = dict(zip(families, plt.get_cmap("tab10").colors))
    bottoms = [0.0] * len(cases)
    for family in families:
        heights = []
        for case in cases:
            run = result["runs"][case]
            top = [(kernel_family(n), ms) for n, ms in run["top_kernels_ms"]]
            if family == "other kernels":
                heights.append(run["busy_ms"] - sum(ms for _, ms in top))
            elif family == "idle":
                heights.append(max(0.0, run["wall_ms"] - run["busy_ms"]))
            else:
                heights.append(sum(ms for f, ms in top if f == family))
        if any(h > 0 for h in heights):
            ax.bar(cases, heights, bottom=bottoms, color=colors[family], label=family)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['args']['shape']}, context {result['args']['context']}: GPU time by "
                 f"kernel, and idle ({str(result['env']['commit'])[:7]})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
