"""Where one decode step's time goes: the engine's phases and the worker's, in process and
through a Ray actor, at each batch size.

    python benchmarks/profile_step.py                                  # CPU-sized, tiny model
    python benchmarks/profile_step.py --shape 8b --batch-sizes 1,64 --context 1024 --executors uni,ray

Every phase is timed on the host with time.monotonic_ns (one system-wide clock, so the engine's
and a Ray worker's stamps compare): the engine's schedule / execute / update, and inside the
worker its diff apply, input prep, forward launch, logits, sampling-metadata build, sampler launch
and the wait for the sampled ids (`.tolist()`, where the host meets the GPU). For the Ray path,
`dispatch` is engine's execute call → worker's execute_model starting and `return` is the worker
returning → the engine holding the result: Ray's own cost, apart from the work. Medians over the
steps; nothing here synchronizes the device beyond what the engine does itself. The engine runs
one step at a time unless --async-scheduling (then each execute call also waits on, and returns,
the step before, and `other` is that wait).
Writes benchmarks/results/profile_step_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import decode_output_tokens, prompts, start_decoding  # noqa: E402
from common import (SHAPES, decode_setup, device_tag, environment, release_memory,  # noqa: E402
                    write_config, write_json)

from raypaged import LLM, SamplingParams  # noqa: E402

WORKER_STAMPS = os.path.join(tempfile.gettempdir(), "raypaged_profile_worker_{pid}.json")


def _install_worker_timers(dump_to_file: bool = False) -> dict:
    """Wrap the ModelRunner's phases with timers (in this process). Returns the store:
    {"steps": [[(phase, start_ns, end_ns), ...] per execute_model call]}."""
    from raypaged.model import llama
    from raypaged.worker import model_runner, sampler, sampling_metadata
    from raypaged.worker.cuda_graph import DecodeGraphs
    from raypaged.worker.piecewise_graph import PiecewiseGraphs

    store: dict = {"steps": [], "current": None}

    def timed(owner, name, phase):
        original = getattr(owner, name)
        is_static = isinstance(owner.__dict__.get(name), (classmethod, staticmethod))

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.monotonic_ns()
            try:
                return original(*args, **kwargs)
            finally:
                if store["current"] is not None:
                    store["current"].append((phase, start, time.monotonic_ns()))
        setattr(owner, name, staticmethod(wrapper) if is_static else wrapper)

    runner_cls = model_runner.ModelRunner
    original_execute = runner_cls.execute_model

    def execute_model(self, out):
        store["current"] = []
        start = time.monotonic_ns()
        try:
            return original_execute(self, out)
        finally:
            store["current"].append(("worker_total", start, time.monotonic_ns()))
            store["steps"].append((len(out.num_scheduled_tokens), store["current"]))
            store["current"] = None
            if dump_to_file and len(store["steps"]) % 10 == 0:
                with open(WORKER_STAMPS.format(pid=os.getpid()), "w") as f:
                    json.dump(store["steps"], f)
    runner_cls.execute_model = execute_model
    timed(runner_cls, "_update_states", "update_states")
    timed(runner_cls, "_prepare_inputs", "prepare_inputs")
    timed(DecodeGraphs, "run", "forward_graph")
    timed(PiecewiseGraphs, "run", "forward_piecewise")
    timed(sampler.Sampler, "forward", "sampler")
    timed(sampling_metadata.SamplingMetadata, "build", "sampling_metadata")
    timed(llama.LlamaForCausalLM, "forward", "forward_eager")
    timed(llama.LlamaForCausalLM, "compute_logits", "logits")
    return store


def ray_worker_setup_hook() -> None:
    """Runs in every Ray worker process at start (runtime_env worker_process_setup_hook)."""
    _install_worker_timers(dump_to_file=True)


def _install_engine_timers(engine) -> list:
    steps: list = []
    scheduler, executor = engine.scheduler, engine.executor
    for owner, name in ((scheduler, "schedule"), (executor, "execute_model"),
                        (scheduler, "update_from_output")):
        original = getattr(owner, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            start = time.monotonic_ns()
            try:
                return _original(*args, **kwargs)
            finally:
                steps.append((_name, start, time.monotonic_ns()))
        setattr(owner, name, wrapper)
    return steps


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3 if values else float("nan")


def profile_batch(llm: LLM, batch: int, context: int, steps: int, vocab: int,
                  worker_steps_source, mixed_prompt_len: int = 0) -> dict:
    engine = llm.engine
    from raypaged.core.request import Request

    ids = start_decoding(engine, batch, context, vocab, steps, "p")
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)  # arrivals
    for _ in range(3):
        engine.step()
    engine_stamps = _install_engine_timers(engine)
    totals = []
    arrivals = prompts(steps, mixed_prompt_len, vocab, seed=-batch) if mixed_prompt_len else []
    for index in range(steps):
        if arrivals:  # a new prompt joins every step: the step mixes decodes and a prefill
            ids.append(f"p-{batch}-new-{index}")
            engine.add_request(Request(ids[-1], arrivals[index]["prompt_token_ids"], params))
        start = time.monotonic_ns()
        engine.step()
        totals.append((start, time.monotonic_ns()))
    del engine.scheduler.schedule, engine.executor.execute_model, engine.scheduler.update_from_output

    phases: dict[str, list[int]] = defaultdict(list)
    executes = [(s, e) for name, s, e in engine_stamps if name == "execute_model"]
    for name, s, e in engine_stamps:
        phases[f"engine.{name}"].append(e - s)
    phases["engine.step"] = [e - s for s, e in totals]
    for _ in range(11):  # a Ray worker writes its stamps every 10 steps: past the last measured
        engine.step()
    engine.abort_requests(ids)
    engine.step()
    # Each engine execute goes with the worker step that started inside it (one clock for both).
    worker_steps = [(next(s for name, s, _ in stamps if name == "worker_total"), stamps)
                    for n, stamps in worker_steps_source() if n >= batch]
    for exec_start, exec_end in executes:
        stamps = next((st for start, st in worker_steps if exec_start <= start <= exec_end), None)
        if stamps is None:
            continue
        by_phase = defaultdict(int)
        for name, s, e in stamps:
            by_phase[name] += e - s
        for name, ns in by_phase.items():
            phases[f"worker.{name}"].append(ns)
        # What no phase covers: mostly the wait for the sampled ids (.tolist()) — the GPU's time
        # beyond what the host spent launching — plus the output's bookkeeping.
        phases["worker.other"].append(2 * by_phase["worker_total"] - sum(by_phase.values()))
        worker_start, worker_end = next((s, e) for name, s, e in stamps if name == "worker_total")
        phases["ray.dispatch"].append(worker_start - exec_start)
        phases["ray.return"].append(exec_end - worker_end)
    return {name: _median_us(values) for name, values in sorted(phases.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--executors", default="uni,ray")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-piecewise-cuda-graph", action="store_true",
                        help="mixed steps run eagerly (the effect of piecewise graphs)")
    parser.add_argument("--mixed-prompt-len", type=int, default=0,
                        help="add a request with a prompt this long before every measured step, "
                             "so each step mixes the batch's decodes with one prefill (eager)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine's default mode (this profiler's phases read best sync)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device, dtype_name, vocab, batch_sizes = decode_setup(args.shape, args.batch_sizes)
    result = {"env": environment(), "args": vars(args), "phases_us": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        for executor in args.executors.split(","):
            if executor == "ray":
                import ray

                if not ray.is_initialized():
                    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                             log_to_driver=False,
                             runtime_env={"worker_process_setup_hook": ray_worker_setup_hook})

                def worker_steps():
                    import glob

                    steps = []
                    for path in glob.glob(WORKER_STAMPS.format(pid="*")):
                        with open(path) as f:
                            steps += json.load(f)
                    return steps
            else:
                store = _install_worker_timers()

                def worker_steps(store=store):
                    return store["steps"]
            batched_tokens = 8192 if device.type == "cuda" else 2048
            llm = LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
                      max_model_len=max(args.context + decode_output_tokens(
                          max(batch_sizes), args.context, args.steps, batched_tokens),
                          args.mixed_prompt_len + args.steps + 16),
                      max_num_seqs=max(batch_sizes) + (args.steps if args.mixed_prompt_len else 0),
                      max_num_batched_tokens=batched_tokens,
                      gpu_memory_utilization=0.85, kv_cache_memory_bytes=2**30,
                      enforce_eager=args.enforce_eager, distributed_executor_backend=executor,
                      piecewise_cuda_graph=not args.no_piecewise_cuda_graph,
                      async_scheduling=args.async_scheduling)
            for batch in batch_sizes:
                phases = profile_batch(llm, batch, args.context, args.steps, vocab, worker_steps,
                                       args.mixed_prompt_len)
                result["phases_us"][f"{executor}/{batch}"] = phases
                print(f"[{executor}] batch {batch}: " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()),
                      flush=True)
            llm.shutdown()
            del llm
            release_memory(device)
    keys = sorted({k for phases in result["phases_us"].values() for k in phases})
    columns = list(result["phases_us"])
    print("\n| phase (median µs) | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{result['phases_us'][c].get(key, float('nan')):.0f}"
                                         for c in columns) + " |")
    name = (f"profile_step_{args.shape}_{device_tag()}" + ("_mixed" if args.mixed_prompt_len else "")
            + ("_no_piecewise" if args.no_piecewise_cuda_graph else ""))
    print(f"wrote {write_json(name, result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
