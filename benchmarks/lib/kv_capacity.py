"""KV capacity: how many blocks the profiled pool holds at a KV dtype, and the largest batch of
long requests that fits in it at once (bench_throughput.py --kv-capacity; issue 22's "KV
capacity", bf16 vs FP8 KV).

For each KV dtype an engine starts as a server would (the pool sized by profiling on CUDA, the
same --num-kv-blocks memory on CPU), and reports its blocks, the bytes a block takes per rank,
and `fits` = blocks // ceil(context / block_size): the requests of `context` tokens whose whole
KV the pool holds at once. Then it checks that figure by running fits + 1 such requests submitted
together (prompt context - OUTPUT_TOKENS tokens, OUTPUT_TOKENS generated): the peak number
running at once is measured from the scheduler, with the preemptions it took. (With
OUTPUT_TOKENS below the block size a prompt already holds all of its request's blocks, so no more
than `fits` can be admitted.)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from raypaged import LLM, SamplingParams
from raypaged.core.request import Request

OUTPUT_TOKENS = 8
FIRST_ID = 3  # ids 0-2 are unk / bos / eos in the benchmark configs


def measure(model_dir: Path, kv_cache_dtype: str, dtype_name: str, context: int, *, block_size: int,
            max_num_seqs: int, gpu_memory_utilization: float, num_kv_blocks: int | None,
            vocab_size: int, run_batch: bool = True) -> dict:
    """One KV dtype's pool and the largest batch of `context`-token requests it holds."""
    start = time.perf_counter()
    memory = {"num_gpu_blocks_override": num_kv_blocks} if num_kv_blocks else {}
    llm = LLM(str(model_dir), load_format="dummy", dtype=dtype_name, skip_tokenizer_init=True,
              max_model_len=context, max_num_seqs=max_num_seqs, block_size=block_size,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
              **memory)
    try:
        engine = llm.engine
        block_bytes, value_bytes = engine.kv_cache_bytes
        per_request = -(-context // block_size)
        result = {
            "kv_cache_dtype": kv_cache_dtype, "num_kv_blocks": engine.num_blocks,
            "kv_bytes_per_block_per_rank": block_bytes, "kv_bytes_per_value": value_bytes,
            "kv_pool_gib_per_rank": engine.num_blocks * block_bytes / 2**30,
            "context": context, "blocks_per_request": per_request,
            "fits": engine.num_blocks // per_request, "init_seconds": time.perf_counter() - start,
        }
        if run_batch:
            result.update(_run_batch(engine, result["fits"] + 1, context, vocab_size))
    finally:
        llm.shutdown()
    return result


def _run_batch(engine, count: int, context: int, vocab_size: int) -> dict:
    """Submit `count` requests of `context` tokens at once and step them to the end: the most
    that ran at once, and the preemptions."""
    generator = torch.Generator().manual_seed(0)
    preemptions_before = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i in range(count):
        prompt = torch.randint(FIRST_ID, vocab_size, (context - OUTPUT_TOKENS,), generator=generator)
        engine.add_request(Request(f"capacity-{i}", prompt.tolist(), params))
    peak = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.req_id} failed: {out.error}")
        steps += 1
        peak = max(peak, engine.scheduler.stats().num_running)
    return {"batch_submitted": count, "peak_running": peak, "batch_seconds": time.perf_counter() - start,
            "batch_steps": steps, "batch_preemptions": engine.scheduler.num_preemptions - preemptions_before}


def print_table(results: list[dict]) -> None:
    print("\n| KV dtype | blocks | bytes / block / rank | pool GiB / rank | requests of "
          f"{results[0]['context']} tokens that fit | peak running (of fits + 1) | preemptions |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['kv_cache_dtype']} | {r['num_kv_blocks']:,} | {r['kv_bytes_per_block_per_rank']:,} | "
              f"{r['kv_pool_gib_per_rank']:.2f} | {r['fits']} | {r.get('peak_running', '-')} | "
              f"{r.get('batch_preemptions', '-')} |")
    if len(results) > 1 and results[0]["fits"]:
        print(f"\n{results[-1]['kv_cache_dtype']} / {results[0]['kv_cache_dtype']}: "
              f"{results[-1]['num_kv_blocks'] / results[0]['num_kv_blocks']:.2f}x the blocks, "
              f"{results[-1]['fits'] / results[0]['fits']:.2f}x the requests")
