"""Fixed-length requests: every prompt exactly `input_len` random token ids and every request
exactly `output_len` output tokens (the benchmark runs them with ignore_eos). The workload of
published fixed input / output throughput figures (TensorRT-LLM's `prepare_dataset.py
token-norm-dist` with both deviations 0: random ids from the vocabulary), all submitted at once."""

from __future__ import annotations

import random

from benchmarks.lib.sharegpt import FIRST_ID, BenchRequest


def fixed_requests(count: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """`count` requests of `input_len` prompt tokens drawn uniformly from the ids above the special
    ones, each asking for `output_len` tokens; seeded. Random prompts share no prefix beyond
    chance, so prefix caching saves nothing."""
    if count < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"fixed requests need count, input_len and output_len >= 1, got "
                         f"{count}, {input_len}, {output_len}")
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above the special ones")
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(FIRST_ID, vocab_size) for _ in range(input_len)], output_len)
            for _ in range(count)]
