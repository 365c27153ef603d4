"""transformers `generate` with static batching: the baseline bench_throughput compares against."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.lib.common import hf_random_model, release_memory, sync
from benchmarks.lib.sharegpt import FIRST_ID, BenchRequest


def hf_static_batching(model_dir: Path, requests: list[BenchRequest], batch_size: int,
                       max_time: float | None, dtype: torch.dtype, device: torch.device) -> dict:
    """transformers `generate` over consecutive batches, prompts left-padded, each batch running
    to its longest request's output length. A request's tokens past its own length are padding
    work and are not counted."""
    model = hf_random_model(model_dir, dtype, device)
    pad = 0
    batches = []
    with torch.inference_mode():
        warm = torch.full((2, 8), FIRST_ID, device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):
                ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids):] = 1
            steps_needed = max(r.output_len for r in batch)
            sync(device)
            start = time.perf_counter()
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=steps_needed, do_sample=False, pad_token_id=pad,
                                 max_time=max_time)
            sync(device)
            seconds = time.perf_counter() - start
            steps_done = out.shape[1] - width
            batches.append({
                "requests": len(batch), "prompt_width": width, "steps_needed": steps_needed,
                "steps_done": steps_done, "seconds": seconds,
                "output_tokens": sum(min(r.output_len, steps_done) for r in batch),
                "asked_tokens": sum(r.output_len for r in batch),
                "computed_rows_x_steps": len(batch) * steps_done,
            })
            del out
    del model
    release_memory(device)
    tokens = sum(b["output_tokens"] for b in batches)
    seconds = sum(b["seconds"] for b in batches)
    # Finishing a cut batch at its measured step rate: a floor on the time it would take, since
    # steps slow down as the cache grows. Still favours transformers.
    full_seconds = sum(b["seconds"] * b["steps_needed"] / max(1, b["steps_done"]) for b in batches)
    asked = sum(b["asked_tokens"] for b in batches)
    return {
        "requests": len(requests), "batch_size": batch_size, "max_time_per_batch_s": max_time,
        "output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
        "truncated": any(b["steps_done"] < b["steps_needed"] for b in batches),
        "projected_uncut_output_tokens_per_s": asked / full_seconds,
        "padding_share_of_rows": 1 - tokens / max(1, sum(b["computed_rows_x_steps"] for b in batches)),
        "batches": batches,
    }
