"""The in-process executor: one Worker in this process (tests, CPU, a single GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor.base import Executor, WorkerCall, call_on_worker
from raypaged.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.worker = Worker(config, model_dir)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.worker.determine_num_blocks(max_model_len, max_num_batched_tokens)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: WorkerCall, args: Sequence[Any] = ()) -> list[Any]:
        return [call_on_worker(self.worker, method, args)]

    def shutdown(self) -> None:
        self.worker.shutdown()
