"""What bench_tp runs in each rank's process (Executor.collective_rpc): the environment the
worker sees, one decode step's collectives replayed alone, and a profile of live steps.

Ray ships these by value (bench_tp.start_ray registers this module so): they import only the
standard library, torch and raypaged, as the workers cannot import the benchmarks package.
"""

from __future__ import annotations

import itertools
import os
import time


def worker_env(worker, keys: list[str]) -> dict:
    import torch

    info = {k: os.environ.get(k) for k in keys + ["CUDA_VISIBLE_DEVICES"]}
    info["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if worker.device.type == "cuda":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def step_collectives(worker, batch: int, iters: int) -> dict:
    """One decode step's collectives at `batch`, alone, `iters` times: medians in ms."""
    import statistics

    import torch

    from raypaged.model import layers, parallel

    model, device, dtype = worker.model, worker.device, worker.dtype
    cuda = device.type == "cuda"
    reduces = sum(isinstance(m, layers.RowParallelLinear) or type(m) is layers.VocabParallelEmbedding
                  for m in model.modules())
    graphs = worker.runner.decode_graphs
    padded = next(s for s in graphs.sizes if s >= batch) if graphs else batch
    # Not zeros. Summed in place again and again the values grow, which no collective's time sees.
    hidden = torch.rand(padded, worker.model_config.hidden_size, dtype=dtype, device=device)
    logits = torch.rand(batch, model.lm_head.rows, dtype=dtype, device=device)
    sampled = torch.randint(0, model.lm_head.vocab_size, (batch,), device=device)

    def forward() -> None:
        for _ in range(reduces):
            parallel.tp_all_reduce(hidden)

    parts = {"all_reduce": forward, "all_gather": lambda: parallel.tp_all_gather(logits),
             "broadcast": lambda: worker.config.scheduler.async_scheduling and parallel.tp_broadcast(sampled)}
    if graphs is not None:
        from raypaged.worker.cuda_graph import capture_graph

        parts["all_reduce"] = capture_graph(forward)[0].replay

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    rows = []
    for _ in range(iters + 3):  # the first 3 pay first-use costs
        marks = [mark()]
        for fn in parts.values():
            fn()
            marks.append(mark())
        rows.append(marks)
    if cuda:
        torch.cuda.synchronize()
    ms = [[a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in itertools.pairwise(m)] for m in rows[3:]]
    out = {f"{part}_ms": statistics.median(r[i] for r in ms) for i, part in enumerate(parts)}
    return {**out, "total_ms": statistics.median(sum(r) for r in ms), "all_reduces": reduces,
            "padded_batch": padded, "cuda_graph": graphs is not None}


def profile_start(worker) -> None:
    from torch.profiler import ProfilerActivity, profile

    # CUPTI traces the whole process, the compiled graph's thread (which runs the steps) too. On
    # CPU nothing is seen (CPU ops are traced per thread): there it only tests the plumbing.
    cuda = [ProfilerActivity.CUDA] if worker.device.type == "cuda" else []
    worker.bench_tp_profile = profile(activities=[ProfilerActivity.CPU] + cuda)
    worker.bench_tp_profile.__enter__()


def profile_stop(worker, steps: int) -> dict:
    from collections import defaultdict

    import torch

    prof = worker.__dict__.pop("bench_tp_profile")
    if worker.device.type == "cuda":
        torch.cuda.synchronize()  # the step still in flight (async scheduling) ends in the trace
    prof.__exit__(None, None, None)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / steps / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {"nccl_ms": sum(t for name, t in kernels.items() if "nccl" in name.lower()),
            "busy_ms": sum(kernels.values()), "top_kernels_ms": [(n[:80], t) for n, t in top]}
