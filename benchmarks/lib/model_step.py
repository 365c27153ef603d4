"""The model alone, without the engine (benchmarks.bench_decode --mode model): an 8B-shaped Llama
with dummy bf16 weights, its decode step (forward + logits) at each batch, eager and replayed
from a CUDA graph, against the floor of reading the weights once at the copy bandwidth measured
in the same run; then one prefill step of 1 x 512 and 8 x 512 tokens. Needs CUDA. Its
correctness against transformers is the GPU tests' (scripts/gpu.sh tests).
"""

from __future__ import annotations

import time

import torch

from benchmarks.lib.common import copy_bandwidth, shape_config
from raypaged.model.attention import AttentionMetadata
from raypaged.model.config import ModelConfig
from raypaged.model.loader import load_model
from raypaged.worker.cuda_graph import capture_graph

BLOCK_SIZE = 16


def model_config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict(shape_config(shape, torch_dtype="bfloat16"))


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
    )
    ids = torch.randint(0, config.vocab_size, (batch * query_len,), device=device)
    last_rows = torch.arange(batch, device=device) * query_len + query_len - 1
    return ids, positions.to(device), meta, last_rows


def print_profile(step, batch: int) -> None:
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


def time_steps(shape: str, batches: list[int], context: int, profile_steps: bool,
               device: torch.device, quantization: str | None = None) -> dict:
    """Decode (eager and CUDA graph) and prefill step times of the `shape` model, in ms.
    quantization "fp8": its linears quantized at load (their bytes, and so the floor, halve)."""
    config = model_config(shape)
    t0 = time.perf_counter()
    model = load_model(config, dtype=torch.bfloat16, device=device, load_format="dummy",
                       quantization=quantization)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    # A decode step reads every weight once except the embedding table, of which it reads only
    # the batch's rows (counted per batch below as part of the KV/activation bytes: negligible).
    embedding = model.model.embed_tokens.weight
    unread = 0 if model.lm_head.weight is embedding else embedding.numel() * embedding.element_size()
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) - unread
    # Products per token: 2 per weight element read (FP8 or not), for the prefill TFLOP/s.
    weight_elements = sum(t.numel() for t in model.parameters()) - (0 if unread == 0 else embedding.numel())

    max_batch = max(batches)
    prefills = ((1, 512), (8, 512))
    num_blocks = max(
        max_batch * -(-context // BLOCK_SIZE), *(b * -(-n // BLOCK_SIZE) for b, n in prefills)
    ) + 64
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads_per_rank(1), config.head_dim)
    caches = [
        (torch.randn(shape, dtype=torch.bfloat16, device=device),
         torch.randn(shape, dtype=torch.bfloat16, device=device))
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    bandwidth = copy_bandwidth(device)
    floor_ms = weight_bytes / bandwidth * 1e3
    kv_token_bytes = 2 * config.num_hidden_layers * shape[2] * shape[3] * 2  # K and V, bf16
    result = {
        "dummy_load_s": load_s, "weight_bytes": weight_bytes,
        "copy_bandwidth_TBps": bandwidth / 1e12, "weight_read_floor_ms": floor_ms,
        "context": context, "decode": [], "prefill": [],
    }  # fmt: skip

    for batch in batches:
        ids, positions, meta, last = step_inputs(config, batch, 1, context, num_blocks, device)

        def step(ids=ids, positions=positions, meta=meta, last=last):
            # As the engine steps: one decode work list a step, every layer reading it.
            meta.plan_decode(shape[2], out=meta.decode_work)
            hidden = model(ids, positions, caches, meta)
            return model.compute_logits(hidden[last])

        if profile_steps:
            print_profile(step, batch)

        with torch.inference_mode():
            eager = median_ms(step)
            graph_ms, graph_error = None, None
            try:
                graph, _ = capture_graph(step)  # the engine's own capture (warm-up included)
                graph_ms = median_ms(graph.replay)
            except Exception as e:  # noqa: BLE001 - reported, not hidden: the eager figure still stands
                graph_error = f"{type(e).__name__}: {e}"[:300]
        # The step's byte floor: every weight once and every request's KV once.
        step_floor_ms = (weight_bytes + batch * context * kv_token_bytes) / bandwidth * 1e3
        row = {"batch": batch, "eager_ms": eager, "cuda_graph_ms": graph_ms, "graph_error": graph_error,
               "floor_ms": step_floor_ms, "eager_vs_floor": eager / step_floor_ms,
               "graph_vs_floor": None if graph_ms is None else graph_ms / step_floor_ms}  # fmt: skip
        result["decode"].append(row)
        print(f"decode B={batch:3d} ctx={context}: eager {eager:.2f} ms, graph "
              f"{graph_ms if graph_ms is None else round(graph_ms, 2)} ms, floor {step_floor_ms:.2f} ms"
              + (f"  ({graph_error})" if graph_error else ""), flush=True)  # fmt: skip

    for batch, length in prefills:
        ids, positions, meta, last = step_inputs(config, batch, length, length, num_blocks, device)
        with torch.inference_mode():
            ms = median_ms(lambda ids=ids, positions=positions, meta=meta, last=last:
                           model.compute_logits(model(ids, positions, caches, meta)[last]))
        tokens = batch * length
        flops = 2 * weight_elements * tokens
        result["prefill"].append({"batch": batch, "prompt": length, "ms": ms,
                                  "tokens_per_s": tokens / ms * 1e3, "TFLOPs": flops / ms / 1e9})
        print(f"prefill {batch}x{length}: {ms:.1f} ms, {tokens / ms * 1e3:,.0f} tok/s, "
              f"~{flops / ms / 1e9:.0f} TFLOP/s (weights GEMMs only)", flush=True)
    return result
