"""The model on a GPU: correctness against transformers first, then one step's time.

1. Check: every tiny test checkpoint (tests/checkpoints.py) through the paged model on the device
   (Triton kernels), fp32, against transformers on the same device: max |Δlogit| and greedy tokens.
2. Time: an 8B-shaped Llama (hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab
   128256) with dummy bf16 weights. Decode step (forward + logits) at batch 1 and 64, eager and
   replayed from a CUDA graph, against the floor of reading the weights once at the measured
   copy bandwidth; and one prefill step.

    python benchmarks/bench_model_step.py [--context 1024] [--skip-check]

Writes benchmarks/results/model_step_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from raypaged.model.attention import AttentionMetadata  # noqa: E402
from raypaged.model.config import ModelConfig  # noqa: E402
from raypaged.model.loader import load_model  # noqa: E402
from raypaged.worker.cuda_graph import capture_graph  # noqa: E402

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rope_theta=500000.0, torch_dtype="bfloat16",
)  # fmt: skip
BLOCK_SIZE = 16


def check_against_transformers(device: torch.device) -> list[dict]:
    from checkpoints import CHECKPOINTS, checkpoint_dir
    from model_harness import PagedHarness, run_mixed_schedule
    from transformers import AutoModelForCausalLM

    rows = []
    for name in CHECKPOINTS:
        path = checkpoint_dir(name)
        config = ModelConfig.from_pretrained(path)
        model = load_model(path, dtype=torch.float32, device=device, progress=False)
        harness = PagedHarness(model, config, block_size=16, num_blocks=48, device=device)
        gen = torch.Generator().manual_seed(0)
        prompts = {
            f"r{i}": torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
            for i, n in enumerate((5, 17, 1, 30))
        }
        generated = run_mixed_schedule(harness, prompts, decode_steps=4, chunk="r3")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        worst, same = 0.0, True
        for req, prompt in prompts.items():
            tokens = harness.tokens[req][: harness.num_computed[req]]
            with torch.no_grad():
                ref = hf(torch.tensor([tokens], device=device)).logits[0].float().cpu()
            worst = max(worst, float((harness.logits_of(req) - ref).abs().max()))
            greedy = ref[len(prompt) - 1 :].argmax(-1).tolist()[: len(generated[req])]
            same &= greedy == generated[req]
        rows.append({"checkpoint": name, "max_abs_logit_diff": worst, "greedy_identical": same})
        print(f"check {name:18s} max|Δlogit| {worst:.2e}  greedy identical: {same}", flush=True)
    return rows


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) / 1e3)


def median_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step_inputs(config, batch: int, query_len: int, context: int, num_blocks: int, device):
    """Random permuted block tables; each sequence has `context` tokens incl. the new ones."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    perm = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    positions = torch.arange(context - query_len, context).repeat(batch)
    rows = torch.arange(batch).repeat_interleave(query_len)
    slots = perm[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    decode = query_len == 1
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=perm.to(torch.int32).to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=(torch.arange(batch + 1, dtype=torch.int32) * query_len).to(device),
        num_decodes=batch if decode else 0,
        num_decode_tokens=batch if decode else 0,
        max_query_len=query_len,
        max_seq_len=context,
    )
    ids = torch.randint(0, config.vocab_size, (batch * query_len,), device=device)
    last_rows = torch.arange(batch, device=device) * query_len + query_len - 1
    return ids, positions.to(device), meta, last_rows


def profile(step, batch: int) -> None:
    """Where an eager decode step's time goes: host-side op time and device kernel time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    print(f"--- profile, decode batch {batch}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))


def time_steps(args, device: torch.device) -> dict:
    config = ModelConfig.from_dict(LLAMA_8B)
    t0 = time.perf_counter()
    model = load_model(config, dtype=torch.bfloat16, device=device, load_format="dummy")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    # A decode step reads every weight once except the embedding table, of which it reads only
    # the batch's rows (counted per batch below as part of the KV/activation bytes: negligible).
    embedding = model.model.embed_tokens.weight
    unread = 0 if model.lm_head.weight is embedding else embedding.numel() * embedding.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - unread

    max_batch = max(args.batches)
    prefills = ((1, 512), (8, 512))
    num_blocks = max(
        max_batch * -(-args.context // BLOCK_SIZE), *(b * -(-n // BLOCK_SIZE) for b, n in prefills)
    ) + 64
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads_per_rank(1), config.head_dim)
    caches = [
        (torch.randn(shape, dtype=torch.bfloat16, device=device),
         torch.randn(shape, dtype=torch.bfloat16, device=device))
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    bandwidth = copy_bandwidth(device)
    floor_ms = weight_bytes / bandwidth * 1e3
    result = {
        "dummy_load_s": load_s, "weight_bytes": weight_bytes,
        "copy_bandwidth_TBps": bandwidth / 1e12, "weight_read_floor_ms": floor_ms,
        "context": args.context, "decode": [], "prefill": [],
    }  # fmt: skip

    for batch in args.batches:
        ids, positions, meta, last = step_inputs(config, batch, 1, args.context, num_blocks, device)

        def step():
            hidden = model(ids, positions, caches, meta)
            return model.compute_logits(hidden[last])

        if args.profile:
            profile(step, batch)

        with torch.inference_mode():
            eager = median_ms(step)
            graph_ms, graph_error = None, None
            try:
                graph, _ = capture_graph(step)  # the engine's own capture (warm-up included)
                graph_ms = median_ms(graph.replay)
            except Exception as e:  # reported, not hidden: the eager figure still stands
                graph_error = f"{type(e).__name__}: {e}"[:300]
        row = {"batch": batch, "eager_ms": eager, "cuda_graph_ms": graph_ms,
               "graph_error": graph_error, "eager_vs_floor": eager / floor_ms}  # fmt: skip
        result["decode"].append(row)
        print(f"decode B={batch:3d} ctx={args.context}: eager {eager:.2f} ms, graph "
              f"{graph_ms if graph_ms is None else round(graph_ms, 2)} ms, floor {floor_ms:.2f} ms"
              + (f"  ({graph_error})" if graph_error else ""), flush=True)  # fmt: skip

    for batch, length in prefills:
        ids, positions, meta, last = step_inputs(config, batch, length, length, num_blocks, device)
        with torch.inference_mode():
            ms = median_ms(lambda: model.compute_logits(model(ids, positions, caches, meta)[last]))
        tokens = batch * length
        flops = 2 * weight_bytes / 2 * tokens
        result["prefill"].append({"batch": batch, "prompt": length, "ms": ms,
                                  "tokens_per_s": tokens / ms * 1e3, "TFLOPs": flops / ms / 1e9})
        print(f"prefill {batch}x{length}: {ms:.1f} ms, {tokens / ms * 1e3:,.0f} tok/s, "
              f"~{flops / ms / 1e9:.0f} TFLOP/s (weights GEMMs only)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a profile of each decode step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(device),
        "commit": subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"],
                                 capture_output=True, text=True, cwd=ROOT).stdout.strip()
        or "unknown (no git checkout on this machine)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__},
    }  # fmt: skip
    if not args.skip_check:
        report["check"] = check_against_transformers(device)
    report["timing"] = time_steps(args, device)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "model_step_" + report["device"].split()[-1].lower() + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
