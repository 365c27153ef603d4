"""Executor: what the engine asks of its workers, whether they run in this process or in Ray.

EngineCore calls, in order: the constructor (start the workers and load the model),
determine_num_blocks, initialize_cache, then execute_model once per step; shutdown at the end,
or after a WorkerGroupError before a new executor replaces this one. Anything else a caller
needs from the workers goes through collective_rpc, not through the executor's internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput

# A Worker method's name, or fn(worker, *args) shipped to each worker's process.
WorkerCall = str | Callable[..., Any]


def call_on_worker(worker: Any, method: WorkerCall, args: Sequence[Any]) -> Any:
    """What collective_rpc runs on one worker: the named method, or the function given it."""
    if isinstance(method, str):
        return getattr(worker, method)(*args)
    return method(worker, *args)


class Executor(ABC):
    @abstractmethod
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        """Start the workers (every rank's device and process group) and load the model."""

    @abstractmethod
    def determine_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """KV blocks every rank can hold (the minimum over ranks), profiling a step of
        `max_num_batched_tokens` tokens where there is device memory to profile."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV pool and build the model runners (capturing CUDA graphs)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step on every rank; rank 0's output. Raises WorkerGroupError when a rank
        died, hung or raised: the group must then be replaced whole."""

    @abstractmethod
    def collective_rpc(self, method: WorkerCall, args: Sequence[Any] = ()) -> list[Any]:
        """`method` on every rank at once, so that collectives inside it pair up across ranks;
        results in rank order. Call it between steps, from the thread that steps: a step's
        collectives and the call's must not interleave."""

    def check_health(self) -> None:
        """Raise WorkerGroupError when a rank died or does not answer; called between steps,
        from the thread that steps. Workers in this process cannot die apart from it: no-op."""
        return None

    def worker_pids(self) -> list[int]:
        """The processes the workers run in, other than this one: none for workers in process."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release what they hold (devices, process group, Ray actors)."""
