"""The client side of bench_serving: one request streamed and timed as the client sees it, the
Poisson process of arrivals, and a Load — what one rate of a trace sends. Two loads: independent
requests (the ShareGPT-like trace, here) and multi-turn conversations (serving_chat.py)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchmarks.lib.sharegpt import FIRST_ID, BenchRequest
from benchmarks.serving_report import Timing
from raypaged.client import AsyncClient, RequestError

T = TypeVar("T")


def poisson_offsets(count: int, rate: float, seed: str) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of `rate` arrivals per second:
    the first at 0, then exponential gaps of mean 1 / rate."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"request rate must be a positive number, got {rate}")
    rng = random.Random(seed)
    offsets, clock = [], 0.0
    for i in range(count):
        if i:
            clock += rng.expovariate(rate)
        offsets.append(clock)
    return offsets


def fresh_prompts(requests: list[BenchRequest], vocab_size: int, seed: str) -> list[list[int]]:
    """Random ids of each request's prompt length, drawn anew per rate (seeded): the same prompts
    again would hit the prefix cache the previous rate filled and shorten every prefill."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in r.prompt_token_ids] for r in requests]


async def send(client: AsyncClient, prompt: list[int], output_len: int, due: float,
               reply: list[int] | None = None) -> Timing:
    """Streams one greedy request of exactly `output_len` tokens (ignore_eos) and times it; `due`
    is when it should have been sent. The streamed token ids are appended to `reply` if given
    (a conversation's next turn sends them back). A failed call or a short stream is the
    Timing's error, never an exception."""
    sent = time.perf_counter()
    timing = Timing(late_s=sent - due, prompt_tokens=len(prompt))
    last = sent
    try:
        async for chunk in client.stream(prompt, max_tokens=output_len, ignore_eos=True,
                                         temperature=0.0):
            if chunk.usage is not None:  # on the last message: the server's count of cache hits
                timing.cached_tokens = chunk.usage.cached_tokens
            now = time.perf_counter()
            count = sum(len(out.token_ids) for out in chunk.outputs)
            if reply is not None:
                for out in chunk.outputs:
                    reply.extend(out.token_ids)
            if not count:
                continue
            if timing.output_tokens == 0:
                timing.ttft_s = now - sent
            else:
                # Tokens that arrive together shared the gap: one latency per token, as the
                # per-token figure (TPOT) would count them.
                timing.gaps_s += [(now - last) / count] * count
            timing.output_tokens += count
            last = now
    except RequestError as e:
        timing.error = f"{e.code.name}: {e.message}"
        timing.error_s, timing.retry_after_s = time.perf_counter() - sent, e.retry_after_s
        return timing
    timing.e2e_s = last - sent
    if timing.output_tokens != output_len:
        timing.error = f"{timing.output_tokens} tokens streamed for max_tokens {output_len}"
    return timing


@dataclass
class LoadResult:
    """One rate of a load: every request's Timing (in send order), the wall time from the first
    send to the last token, and the load's own figures for the rate's record."""

    timings: list[Timing]
    wall_s: float
    extra: dict = field(default_factory=dict)


class Load(ABC):
    """A trace's requests against one server. Each rate draws fresh token ids and arrival times
    from the seed and the rate; the lengths are the trace's, the same at every rate."""

    unit = "requests"  # what arrives at the swept rate

    @abstractmethod
    def arrival_span_s(self, rate: float) -> float:
        """About how long the arrivals of one rate take."""

    @abstractmethod
    def summary(self) -> dict:
        """The trace's shape, for the JSON."""

    @abstractmethod
    async def run(self, address: str, rate: float, channels: int) -> LoadResult:
        """Sends one rate's load over `channels` gRPC connections and waits for all of it."""

    @abstractmethod
    def tail_s(self, previous: dict) -> float:
        """About how long a rate goes on after its last arrival, judged from the previous rate's
        record: the mode budget starts no rate that would end past it."""


class RequestLoad(Load):
    """Independent requests (the ShareGPT-like trace): request i sent at the i-th Poisson time."""

    def __init__(self, requests: list[BenchRequest], vocab_size: int, seed: int) -> None:
        self.requests, self.vocab_size, self.seed = requests, vocab_size, seed

    def arrival_span_s(self, rate: float) -> float:
        return len(self.requests) / rate

    def summary(self) -> dict:
        prompt_lens = [len(r.prompt_token_ids) for r in self.requests]
        return {"requests": len(self.requests),
                "mean_prompt_len": sum(prompt_lens) / len(self.requests),
                "mean_output_len": sum(r.output_len for r in self.requests) / len(self.requests),
                "max_total_len": max(p + r.output_len for p, r in zip(prompt_lens, self.requests))}

    async def run(self, address: str, rate: float, channels: int) -> LoadResult:
        prompts = fresh_prompts(self.requests, self.vocab_size, f"prompts:{self.seed}:{rate}")
        offsets = poisson_offsets(len(self.requests), rate, f"arrivals:{self.seed}:{rate}")
        lens = [r.output_len for r in self.requests]
        timings, wall_s = await drive(address, offsets, channels,
                                      lambda client, i, due: send(client, prompts[i], lens[i], due))
        return LoadResult(timings, wall_s)

    def tail_s(self, previous: dict) -> float:
        return previous["e2e"]["p99_ms"] / 1e3  # about the slowest request's time to drain


async def drive(address: str, offsets: list[float], channels: int,
                start: Callable[[AsyncClient, int, float], Coroutine[Any, Any, T]]) -> tuple[list[T], float]:
    """Awaits start(client, i, due) for every i, each begun at its offset from now (due: that
    time on the perf_counter clock); returns the results in order and the wall time from the
    first start to the last one's end. Arrival i goes over channel i % channels: several
    connections, so that no HTTP/2 stream limit of one connection queues requests on the
    client side."""
    clients = [AsyncClient(address) for _ in range(channels)]
    try:
        begun = time.perf_counter()
        tasks: list[asyncio.Task[T]] = []
        for i, offset in enumerate(offsets):
            delay = begun + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(start(clients[i % channels], i, begun + offset)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - begun
    finally:
        for client in clients:
            await client.close()
