"""The whole engine on one device: decode step time and offline throughput, beside transformers.

    python benchmarks/bench_engine.py                       # CPU-sized: a tiny random Llama
    python benchmarks/bench_engine.py --shape 8b --hf       # the H200 run (issue 4)

Model: a Llama of the chosen shape with random weights (load_format "dummy"), run through the
real engine (scheduler, paged KV cache, Triton kernels on CUDA). It reports
  - decode step time at each --batch-sizes with --context tokens of context, against the floor
    of reading the weights and the KV once at the copy bandwidth measured in the same run;
  - output tokens/s for --throughput-batch requests of --prompt-len tokens generating
    --output-len tokens each, and (with --hf) transformers `generate` on the same requests.
Each of --executors (in process, or the worker in a Ray actor) runs with each of --scheduling
(sync: one step at a time; async: step N+1 scheduled while step N runs). A decode step's time is
the wall time of --decode-steps steps over their number, in steady state (with async scheduling
a step call returns the previous step's tokens, so the pipeline's period, not one call's
duration, is the step time). The floor's bandwidth is the higher of two copy measurements, one
before and one after the runs (the card's clocks vary between them by a few percent).
Writes benchmarks/results/engine_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (SHAPES, copy_bandwidth, device_tag, environment,  # noqa: E402
                    hf_random_model, release_memory, sync, write_config, write_json)

from raypaged import LLM, SamplingParams  # noqa: E402

def weight_bytes(shape: str, element: int, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens must read: every layer, the final norm and
    the LM head once, but of the embedding table only the batch's rows (a 1 GB table at 8B)."""
    s = SHAPES[shape]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    head_dim = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return element * (layers * per_layer + v * h + batch * h + h)


def kv_bytes_per_token(shape: str, element: int) -> int:
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * element


def prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(count)]


def decode_output_tokens(batch: int, context: int, steps: int, max_num_batched_tokens: int) -> int:
    """max_tokens for a request of a timed decode window of `steps` steps at `batch`, so that
    none finishes inside it: with chunked prefill the first request admitted starts decoding
    while the others' prompts are still being prefilled, one token a chunk, so it enters the
    window with up to that many tokens already out (a window with requests finishing in it times
    a shrinking batch: before 9ff8d2f batch 256 measured ~1.0x its floor that way)."""
    return -(-batch * context // max_num_batched_tokens) + steps + 16


def start_decoding(engine, batch: int, context: int, vocab: int, steps: int, prefix: str) -> list[str]:
    """Add `batch` greedy requests of `context` prompt tokens and step the engine through their
    prefill (chunked or not) until every one is decoding; each may then decode for `steps` more
    steps and a few of warm-up without finishing (`decode_output_tokens`). Returns their ids."""
    from raypaged.core.request import Request

    max_tokens = decode_output_tokens(batch, context, steps, engine.scheduler.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{prefix}-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts(batch, context, vocab, seed=batch)):
        engine.add_request(Request(request_id, prompt["prompt_token_ids"], params))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    return ids


def check_batch_kept(engine, batch: int) -> None:
    """After a timed window: all `batch` requests must still be running (a window in which some
    finished timed a smaller batch than it reports)."""
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"the batch shrank to {engine.scheduler.num_running} of {batch} in the window")


def decode_step_ms(llm: LLM, batch: int, context: int, steps: int, vocab: int,
                   device: torch.device) -> tuple[float, list[float]]:
    """Steady-state decode step time with `batch` requests all decoding at ~`context` tokens:
    the wall time of `steps` engine steps over their number. Also returns each step call's own
    duration (ms): with async scheduling a call returns the previous step's tokens, so single
    calls alternate long and short around the period and their median is not the step time."""
    engine = llm.engine
    ids = start_decoding(engine, batch, context, vocab, steps, "decode")
    calls = []
    engine.step()  # under async scheduling the first decode step fills the pipeline
    sync(device)
    # No device sync between steps: each returns sampled ids to the host (async: those of the
    # step before), and a sync here would drain the async pipeline.
    start = last = time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        calls.append((now - last) * 1e3)
        last = now
    wall = time.perf_counter() - start
    check_batch_kept(engine, batch)
    engine.abort_requests(ids)
    engine.step()
    return wall / steps * 1e3, calls


def throughput(llm: LLM, count: int, prompt_len: int, output_len: int, vocab: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    batch = prompts(count, prompt_len, vocab, seed=7)
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for r in results for o in r.outputs)
    assert generated == count * output_len, generated
    return {"requests": count, "output_tokens": generated, "seconds": elapsed,
            "output_tokens_per_s": generated / elapsed}


def hf_throughput(model_dir: Path, count: int, prompt_len: int, output_len: int, vocab: int,
                  dtype: torch.dtype, device: torch.device) -> dict:
    """transformers `generate`, static batch of the same requests (all one length: no padding)."""
    model = hf_random_model(model_dir, dtype, device)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts(count, prompt_len, vocab, seed=7)],
                       device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
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


def save_plot(rows: list[dict], path: Path) -> None:
    """Decode step time against batch size, per executor, beside the byte floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=10)
    parser.add_argument("--throughput-batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hf", action="store_true", help="also time transformers generate")
    parser.add_argument("--executors", default="uni",
                        help="comma list of uni,ray: decode step times through each (ray = the "
                             "worker in a Ray actor, the step broadcast over a compiled graph)")
    parser.add_argument("--scheduling", default="sync,async",
                        help="comma list of sync,async: decode step times with asynchronous "
                             "scheduling off and on")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    element = torch.tensor([], dtype=dtype).element_size()
    vocab = SHAPES[args.shape]["vocab_size"]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = {"env": environment(), "shape": args.shape, "dtype": dtype_name, "args": vars(args)}
    bandwidth = copy_bandwidth(device)
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(args.shape, dtype_name, Path(tmp))
        if args.hf:
            result["hf_generate"] = hf_throughput(model_dir, args.throughput_batch, args.prompt_len,
                                                  args.output_len, vocab, dtype, device)
            print(f"transformers generate: {result['hf_generate']['output_tokens_per_s']:.0f} tok/s", flush=True)
        batched_tokens = 8192 if device.type == "cuda" else 1024
        max_len = max(args.context + decode_output_tokens(max(batch_sizes), args.context, args.decode_steps,
                                                          batched_tokens),
                      args.prompt_len + args.output_len + 8)
        rows = []
        runs = [(e, s) for e in args.executors.split(",") for s in args.scheduling.split(",")]
        for executor, scheduling in runs:
            if executor == "ray":
                import ray

                if not ray.is_initialized():
                    ray.init(include_dashboard=False, log_to_driver=False)
            llm = LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
                      max_model_len=max_len, max_num_seqs=max(batch_sizes + [args.throughput_batch]),
                      max_num_batched_tokens=batched_tokens,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      kv_cache_memory_bytes=2**30, distributed_executor_backend=executor,
                      async_scheduling=scheduling == "async")
            result.setdefault("num_kv_blocks", llm.engine.num_blocks)
            for batch in batch_sizes:
                step_ms, calls = decode_step_ms(llm, batch, args.context, args.decode_steps, vocab,
                                                device)
                call_median = statistics.median(calls)
                rows.append({"executor": executor, "scheduling": scheduling, "batch": batch,
                             "context": args.context, "step_ms": step_ms,
                             "call_ms_median": call_median, "call_ms": calls})
                print(f"[{executor}, {scheduling}] decode B={batch}: {step_ms:.2f} ms/step "
                      f"(one call's median {call_median:.2f} ms)", flush=True)
            if executor == "uni" or "raypaged" not in result:
                # Throughput with the last in-process scheduling mode listed (async if asked).
                result["raypaged"] = throughput(llm, args.throughput_batch, args.prompt_len,
                                                args.output_len, vocab)
                result["raypaged"].update(executor=executor, scheduling=scheduling)
            llm.shutdown()
            del llm
            release_memory(device)
        result["decode"] = rows

    # The floor takes the better of the two copy measurements: the stricter bar.
    after = copy_bandwidth(device)
    result["copy_bandwidth_TBps_after"] = after / 1e12
    bandwidth = max(bandwidth, after)
    for row in rows:
        row["floor_ms"] = (weight_bytes(args.shape, element, row["batch"]) + row["batch"] * args.context
                           * kv_bytes_per_token(args.shape, element)) / bandwidth * 1e3
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
        for batch in batch_sizes:
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
    path = write_json(f"engine_{args.shape}_{device_tag()}", result, args.out)
    save_plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
