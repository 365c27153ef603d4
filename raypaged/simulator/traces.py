"""Synthetic request traces for the memory simulator: seeded, deterministic, pure Python.

Three shapes:
- ``sharegpt``: long-tailed prompt and output lengths, lognormal with the means vLLM's paper
  reports for ShareGPT conversations (prompt ≈ 161, output ≈ 338 tokens);
- ``fixed``: every request the same length (no length variance, so no reservation luck);
- ``shared-prefix``: one system prompt of a few hundred tokens in front of a distinct user part,
  the case where prefix sharing saves memory.

Requests set ``ignore_eos=True, max_tokens=output_len`` so each generates exactly its output
length whatever token the fake model returns.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams

TRACE_NAMES = ("sharegpt", "fixed", "shared-prefix")

# ShareGPT means from the vLLM paper (Kwon et al. 2023, table 1 / fig. 11): input 161, output 338.
SHAREGPT_PROMPT_MEAN = 160
SHAREGPT_OUTPUT_MEAN = 340
# Spread of log-length. ShareGPT's lengths span three orders of magnitude; sigma = 1 gives a tail
# where the 99th percentile is ~10x the median, which is the shape of those histograms.
SHAREGPT_LOG_SIGMA = 1.0
SYSTEM_PROMPT_LEN = 300  # not a multiple of the block size on purpose: the last shared block is partial
VOCAB_SIZE = 32000


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_step: int  # the engine step at which the request reaches the scheduler

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len

    def to_request(self) -> Request:
        params = SamplingParams(max_tokens=self.output_len, ignore_eos=True, temperature=0.0)
        return Request(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling_params=params,
            eos_token_id=0,
            arrival_time=float(self.arrival_step),
        )


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    max_model_len: int

    @property
    def mean_prompt_len(self) -> float:
        return sum(r.prompt_len for r in self.requests) / len(self.requests)

    @property
    def mean_output_len(self) -> float:
        return sum(r.output_len for r in self.requests) / len(self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "mean_prompt_len": round(self.mean_prompt_len, 1),
            "mean_output_len": round(self.mean_output_len, 1),
            "max_total_len": max(r.total_len for r in self.requests),
            "total_output_tokens": self.total_output_tokens,
            "last_arrival_step": max(r.arrival_step for r in self.requests),
        }


def lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    """A length drawn from the lognormal whose mean is `mean`, clipped to [low, high]."""
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2/2)
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def poisson_arrival_steps(rng: random.Random, num_requests: int, rate_per_step: float) -> list[int]:
    """Arrival steps of a Poisson process with `rate_per_step` requests per engine step;
    rate 0 means offline: everything is there at step 0."""
    if rate_per_step < 0 or math.isnan(rate_per_step):
        raise ValueError(f"arrival rate must be >= 0 requests per step, got {rate_per_step}")
    if rate_per_step == 0:
        return [0] * num_requests
    steps, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(rate_per_step)
        steps.append(int(clock))
    return steps


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    # Token 0 is the trace's EOS id; keep it out of prompts so nothing could read as a stop.
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def make_trace(
    name: str,
    num_requests: int,
    max_model_len: int,
    seed: int = 0,
    arrival_rate: float = 0.0,
    fixed_prompt_len: int = SHAREGPT_PROMPT_MEAN,
    fixed_output_len: int = SHAREGPT_OUTPUT_MEAN,
    system_prompt_len: int = SYSTEM_PROMPT_LEN,
) -> Trace:
    """Build trace `name` (one of TRACE_NAMES). Same arguments, same trace, on any machine."""
    if name not in TRACE_NAMES:
        raise ValueError(f"unknown trace {name!r}; choose from {', '.join(TRACE_NAMES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    # Each trace gets its own stream, so adding a trace never changes the others.
    rng = random.Random(f"{name}:{seed}")
    arrivals = poisson_arrival_steps(rng, num_requests, arrival_rate)
    shared = _random_tokens(rng, system_prompt_len) if name == "shared-prefix" else ()
    if name == "shared-prefix" and system_prompt_len + 2 > max_model_len:
        raise ValueError(f"system prompt of {system_prompt_len} tokens leaves no room under "
                         f"max_model_len={max_model_len}")
    if name == "fixed" and fixed_prompt_len + fixed_output_len > max_model_len:
        raise ValueError(f"fixed length {fixed_prompt_len}+{fixed_output_len} exceeds "
                         f"max_model_len={max_model_len}")

    requests = []
    for i in range(num_requests):
        if name == "fixed":
            prompt_len, output_len = fixed_prompt_len, fixed_output_len
        else:
            # The prompt leaves room for at least one output token; the output fills at most
            # what is left, as a server capping max_tokens at max_model_len would.
            room = max_model_len - len(shared)
            prompt_len = lognormal_length(rng, SHAREGPT_PROMPT_MEAN, SHAREGPT_LOG_SIGMA, 1, room - 1)
            output_len = lognormal_length(rng, SHAREGPT_OUTPUT_MEAN, SHAREGPT_LOG_SIGMA, 1,
                                          room - prompt_len)
        prompt = shared + _random_tokens(rng, prompt_len)
        requests.append(TraceRequest(f"{name}-{i}", prompt, output_len, arrivals[i]))
    return Trace(name, tuple(requests), max_model_len)
