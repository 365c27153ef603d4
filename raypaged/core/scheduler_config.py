"""The scheduler's limits and policies."""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.core.block_hashing import DEFAULT_HASH_ALGO, HASH_ALGOS

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256  # requests in the running batch at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, over all requests
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "fcfs": arrival order; preemption takes the newest running request.
    # "priority": lower Request.priority first (ties by arrival); preemption takes the lowest
    # priority, and a waiting request may preempt running ones of strictly lower priority.
    policy: str = "fcfs"
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    # Plan step N+1 while step N runs (see Scheduler.schedule): the caller then answers each
    # step one schedule() later, and the workers fill in the tokens they sampled.
    async_scheduling: bool = False
    # The prefix cache's hash chain (core/block_hashing.py HASH_ALGOS).
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO

    def __post_init__(self) -> None:
        positive = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.max_waiting_requests is not None and (
                type(self.max_waiting_requests) is not int or self.max_waiting_requests < 0):
            raise ValueError(f"max_waiting_requests must be None or an integer >= 0, "
                             f"got {self.max_waiting_requests!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt (or a preempted request's recompute) is computed in one
            # step, so the step must be able to hold the longest one.
            raise ValueError(f"without chunked prefill max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")
