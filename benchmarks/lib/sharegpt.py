"""The offline benchmarks' requests: the simulator's seeded ShareGPT-like trace (prompt ≈ 160 and
output ≈ 340 tokens on average, lognormal long tails), its token ids folded into a model's
vocabulary above the special ids. bench_throughput runs them offline, bench_serving sends them."""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.simulator.traces import make_trace

FIRST_ID = 3  # ids 0-2 are unk / bos / eos in the benchmark configs


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def sharegpt_requests(count: int, max_model_len: int, vocab_size: int, seed: int,
                      max_total_len: int | None = None) -> list[BenchRequest]:
    """The simulator's ShareGPT-like trace, its token ids folded into this model's vocabulary.
    With max_total_len, requests whose prompt + output exceed it are skipped (as vLLM's
    benchmark_throughput prunes ShareGPT at 2,048) and the trace drawn longer to keep `count`."""
    drawn = count
    while True:
        trace = make_trace("sharegpt", drawn, max_model_len, seed=seed)
        kept = [r for r in trace.requests
                if max_total_len is None or r.prompt_len + r.output_len <= max_total_len]
        if len(kept) >= count:
            break
        drawn = drawn * 2
    span = vocab_size - FIRST_ID
    return [BenchRequest([FIRST_ID + t % span for t in r.prompt_token_ids], r.output_len)
            for r in kept[:count]]
