"""Where one decode step's time goes, phase by phase (benchmarks.bench_decode --mode phases).

Every phase is timed on the host with time.monotonic_ns (one system-wide clock, so the engine's
and a Ray worker's stamps compare): the engine's schedule / execute / update, and inside the
worker its diff apply, input prep, forward launch, logits, sampling-metadata build, sampler launch
and the wait for the sampled ids (`.tolist()`, where the host meets the GPU). For the Ray path,
`dispatch` is engine's execute call -> worker's execute_model starting and `return` is the worker
returning -> the engine holding the result: Ray's own cost, apart from the work. Medians over the
steps; nothing here synchronizes the device beyond what the engine does itself. With async
scheduling each execute call also waits on, and returns, the step before, and `other` is that
wait (the phases read best with sync scheduling).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

from benchmarks.lib.decode import prompts, start_decoding
from raypaged import LLM, SamplingParams

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


def ray_worker_steps() -> list:
    """The worker steps every Ray worker process has dumped so far (ray_worker_setup_hook)."""
    steps: list = []
    for path in glob.glob(WORKER_STAMPS.format(pid="*")):
        with open(path) as f:
            steps += json.load(f)
    return steps


def install_in_process_timers() -> Callable[[], list]:
    """Timers on this process's ModelRunner; returns the source of its recorded steps."""
    store = _install_worker_timers()
    return lambda: store["steps"]


def profile_batch(llm: LLM, batch: int, context: int, steps: int, vocab: int,
                  worker_steps_source: Callable[[], list], mixed_prompt_len: int = 0) -> dict[str, float]:
    """Median µs per phase over `steps` decode steps of `batch` requests at ~`context` tokens
    (with `mixed_prompt_len`, a new prompt of that length joins before every step)."""
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
