"""An engine's steady decode window, shared by the decode and TP benchmarks.

`start_decoding` brings `batch` greedy requests of `context` prompt tokens to the point where all
decode; `decode_step_ms` times `steps` steps of them; `check_batch_kept` refuses a window in
which requests finished (it would time a smaller batch than it reports). `weight_bytes` and
`kv_bytes_per_token` give the byte floor: what one decode step must read at least.
"""

from __future__ import annotations

import random
import time

import torch

from benchmarks.lib.common import shape_config, sync
from raypaged import LLM, SamplingParams
from raypaged.model.config import ModelConfig


def weight_bytes(shape: str, element: int, batch: int) -> int:
    """Weight bytes a decode step of `batch` tokens must read: every layer, the final norm and
    the LM head once, but of the embedding table only the batch's rows (a 1 GB table at 8B)."""
    c = _config(shape)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size + 2 * h
    return element * (c.num_hidden_layers * per_layer + c.vocab_size * h + batch * h + h)


def kv_bytes_per_token(shape: str, element: int) -> int:
    """K and V of one token in every layer (contexts within any sliding window)."""
    c = _config(shape)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * element


def _config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict(shape_config(shape))


def prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(count)]


def decode_output_tokens(batch: int, context: int, steps: int, max_num_batched_tokens: int) -> int:
    """max_tokens for a request of a timed decode window of `steps` steps at `batch`, so that
    none finishes inside it: with chunked prefill the first request admitted starts decoding
    while the others' prompts are still being prefilled, one token a chunk, so it enters the
    window with up to that many tokens already out (a window with requests finishing in it
    would time a shrinking batch)."""
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
    """Output tokens/s of `count` greedy requests of `prompt_len` tokens generating exactly
    `output_len` each, through `llm.generate` after a two-request warm-up."""
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
