"""What structured outputs cost: the decode step with constrained requests, and grammar compiles.

    overhead  the whole engine's steady decode window at --batch requests of --context tokens,
              first none constrained, then --constrained-share of them under a JSON schema
              (a list of records at least --min-items long, so no grammar can end inside the
              window): step time, output tokens/s, each kind's tokens per step (1.0: a token
              every step) and inter-token latency, asynchronous scheduling on (the default)
    compile   --schemas distinct random JSON schemas (nested objects, arrays, enums, required
              fields) compiled through the engine's GrammarCompilerPool: p50 / p99 / max compile
              time; then a stream of --stream requests drawing those schemas Zipf-like, through
              the same pool: its cache's hit rate
    -> structured_<shape>_<device>.json, .png

    python -m benchmarks.bench_structured                                 # CPU-sized, tiny shape
    python -m benchmarks.bench_structured --shape 8b --batch 64 --context 512 --steps 50
                                                                          # scripts/gpu.sh structured

The model has random weights; its tokenizer is a synthetic byte-level one of the shape's
vocabulary (benchmarks/lib/synthetic_tokenizer.py), so masks are over real text pieces. Both
windows run in one engine, one after the other, and the overhead is their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.common import (
    SHAPES,
    add_replot_argument,
    device_tag,
    environment,
    log,
    replot,
    sync,
    write_config,
    write_json,
)
from benchmarks.lib.decode import decode_output_tokens, prompts
from benchmarks.lib.synthetic_tokenizer import write_byte_level_tokenizer
from raypaged import LLM, SamplingParams
from raypaged.core.request import Request
from raypaged.core.structured_output import StructuredOutput

MODES = ("overhead", "compile")


def records_schema(min_items: int) -> dict:
    """A list of records, as an extraction or tool-output request asks for."""
    record = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "ok"],
              "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string"}},
                             "ok": {"type": "boolean"}}}
    return {"type": "object", "additionalProperties": False, "required": ["items"],
            "properties": {"items": {"type": "array", "items": record, "minItems": min_items}}}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "number", "boolean", "enum", "string"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample([f"v{i}" for i in range(40)], rng.randint(2, 12))}
    if kind == "string":
        return {"type": "string", **({"maxLength": rng.randint(1, 64)} if rng.random() < 0.5 else {})}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 8)}
    if kind == "object":
        names = rng.sample([f"field_{i}" for i in range(24)], rng.randint(1, 8))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": rng.sample(names, rng.randint(1, len(names))), "additionalProperties": False}
    return {"type": kind}


def _model_dir(shape: str, dtype: str, directory: Path) -> Path:
    write_config(shape, dtype, directory)
    write_byte_level_tokenizer(directory, SHAPES[shape]["vocab_size"])
    # The synthetic vocabulary's last id is its EOS.
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = SHAPES[shape]["vocab_size"] - 1
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def decode_window(llm: LLM, batch: int, share: float, context: int, steps: int, vocab: int,
                  spec: StructuredOutput, device: torch.device, tag: str) -> dict:
    """Time `steps` steps of `batch` decoding requests, round(batch * share) of them under `spec`."""
    engine = llm.engine
    constrained = round(batch * share)
    max_tokens = decode_output_tokens(batch, context, steps + 8, engine.scheduler.config.max_num_batched_tokens)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, (request_id, prompt) in enumerate(zip(ids, prompts(batch, context, vocab, seed=batch))):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                structured_output=spec if i < constrained else None)
        engine.add_request(Request(request_id, prompt["prompt_token_ids"], params))
    scheduler = engine.scheduler

    def outputs() -> list[int]:
        return [scheduler.requests[r].num_output_tokens for r in ids]

    while (len(scheduler.requests) < batch or scheduler.num_waiting
           or any(n == 0 for n in outputs())):
        engine.step()
    for _ in range(4):  # the pipeline full, every request past its first decode
        engine.step()
    sync(device)
    before = outputs()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    after = outputs()
    if len(scheduler.requests) != batch:
        raise RuntimeError(f"the batch shrank to {len(scheduler.requests)} of {batch} in the window")
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    made = [a - b for a, b in zip(after, before)]
    kinds = {"constrained": made[:constrained], "plain": made[constrained:]}
    result = {"batch": batch, "num_constrained": constrained, "steps": steps, "step_ms": wall / steps * 1e3,
              "output_tokens_per_s": sum(made) / wall}
    for kind, tokens in kinds.items():
        if tokens:
            per_step = statistics.mean(tokens) / steps
            result[kind] = {"tokens_per_step": per_step, "itl_ms": wall / steps / per_step * 1e3}
    return result


def run_overhead(args: argparse.Namespace, device: torch.device, dtype: str) -> dict:
    vocab = SHAPES[args.shape]["vocab_size"]
    spec = StructuredOutput(json=records_schema(args.min_items))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.shape, dtype, Path(tmp))
        llm = LLM(str(model_dir), load_format="dummy", dtype=dtype,
                  max_model_len=args.context + 1024, max_num_seqs=args.batch,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  async_scheduling=not args.sync_scheduling)
        try:
            llm.engine._structured_outputs().compiled(spec)  # the compile is not what is timed
            decode_window(llm, min(args.batch, 4), args.share, args.context, 4, vocab, spec, device, "warm")
            runs = {}
            for share in (0.0, args.share):
                runs[f"share_{share:g}"] = decode_window(llm, args.batch, share, args.context, args.steps,
                                                         vocab, spec, device, f"w{share:g}")
                log(f"share {share:g}: {json.dumps(runs[f'share_{share:g}'])}")
        finally:
            llm.shutdown()
    base, mixed = runs["share_0"], runs[f"share_{args.share:g}"]
    return {"runs": runs, "throughput_ratio": mixed["output_tokens_per_s"] / base["output_tokens_per_s"],
            "step_ratio": mixed["step_ms"] / base["step_ms"]}


def run_compile(args: argparse.Namespace, dtype: str) -> dict:
    from raypaged.structured.compiler import GrammarCompilerPool

    rng = random.Random(args.seed)
    schemas = [{"type": "object", "properties": {"root": random_schema(rng)}, "required": ["root"],
                "additionalProperties": False} for _ in range(args.schemas)]
    vocab = SHAPES[args.shape]["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.shape, dtype, Path(tmp))
        pool = GrammarCompilerPool(str(model_dir), vocab, (vocab - 1,), max_workers=1)
        try:
            start = time.perf_counter()
            pool.compile(StructuredOutput(json_object=True)).result()  # tokenizer info + first compile
            setup_s = time.perf_counter() - start
            times = []
            for schema in schemas:
                start = time.perf_counter()
                pool.compile(StructuredOutput(json=schema)).result()
                times.append((time.perf_counter() - start) * 1e3)
            hits_before, misses_before = pool.cache_hits, pool.cache_misses
            weights = [1 / (rank + 1) ** args.zipf for rank in range(args.stream_schemas)]
            stream_rng = random.Random(args.seed + 1)
            fresh = [StructuredOutput(json={**s, "title": f"stream-{i}"})
                     for i, s in enumerate(schemas[:args.stream_schemas])]
            for spec in stream_rng.choices(fresh, weights, k=args.stream):
                pool.compile(spec).result()
            hits, misses = pool.cache_hits - hits_before, pool.cache_misses - misses_before
        finally:
            pool.shutdown()
    ordered = sorted(times)
    return {"tokenizer_and_first_compile_s": setup_s, "compile_ms": times,
            "compile_ms_p50": statistics.median(ordered),
            "compile_ms_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "compile_ms_max": ordered[-1],
            "stream": {"requests": args.stream, "schemas": args.stream_schemas, "zipf": args.zipf,
                       "hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    overhead = result.get("overhead")
    if overhead:
        runs = overhead["runs"]
        names = list(runs)
        axes[0].bar(names, [runs[n]["output_tokens_per_s"] for n in names], color=["#888", "#3a7"])
        axes[0].set_ylabel("output tokens/s")
        axes[0].set_title(f"batch {runs[names[0]]['batch']}: constrained share 0 vs "
                          f"{names[-1].split('_')[1]} ({overhead['throughput_ratio']:.3f}x)")
    compiled = result.get("compile")
    if compiled:
        ordered = sorted(compiled["compile_ms"])
        axes[1].plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        axes[1].set_xscale("log")
        axes[1].set_xlabel("compile time per schema (ms)")
        axes[1].set_ylabel("fraction of schemas")
        axes[1].set_title(f"p50 {compiled['compile_ms_p50']:.1f} ms, p99 {compiled['compile_ms_p99']:.1f} ms; "
                          f"cache hit rate {compiled['stream']['hit_rate']:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.5, help="constrained share of the batch")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--min-items", type=int, default=100)
    parser.add_argument("--sync-scheduling", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--stream", type=int, default=1000)
    parser.add_argument("--stream-schemas", type=int, default=50)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    add_replot_argument(parser)
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot, plot)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    result: dict = {"env": environment(), "args": vars(args) | {"replot": None}}
    if "overhead" in modes:
        result["overhead"] = run_overhead(args, device, dtype)
        log(f"overhead: throughput {result['overhead']['throughput_ratio']:.3f}x, "
            f"step {result['overhead']['step_ratio']:.3f}x")
    if "compile" in modes:
        result["compile"] = run_compile(args, dtype)
        c = result["compile"]
        log(f"compile: p50 {c['compile_ms_p50']:.1f} ms, p99 {c['compile_ms_p99']:.1f} ms, "
            f"hit rate {c['stream']['hit_rate']:.1%}")
    name = f"structured_{args.shape}_{device_tag()}"
    path = write_json(name, result, args.out)
    plot(result, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
