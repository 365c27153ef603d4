"""An EngineCore behind the AsyncEngineClient interface GenerationService uses, in this process
(no Ray): the front doors' full path (validation, detokenization, the OpenAI routes) over a real
engine, cheaply. Each stream steps the engine while it waits; the asyncio loop is the only
thread, so steps never overlap.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator
from typing import Any

from raypaged.config import EngineConfig
from raypaged.core.errors import RequestTimeoutError
from raypaged.core.group_progress import GroupProgress
from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import Request
from raypaged.engine.core import EngineCore


class InProcessEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        core = self.core
        self.model_info: dict[str, Any] = {
            "model_dir": core.model_dir, "architecture": core.model_config.architecture,
            "max_model_len": core.max_model_len, "vocab_size": core.model_config.vocab_size,
            "block_size": core.config.scheduler.block_size, "num_blocks": core.num_blocks,
            "tensor_parallel_size": core.config.parallel.tensor_parallel_size,
            "eos_token_ids": list(core.eos_token_ids)}
        self.is_alive = True
        self.load: EngineLoad | None = None  # as the actor's client keeps it: after each step
        self._queues: dict[str, collections.deque[EngineCoreOutput]] = {}

    async def generate(self, request: Request,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        """As the real client: past timeout_s the stream raises RequestTimeoutError (the request
        is then aborted in the engine)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        group_id = request.group_id
        self.core.add_request(request)
        queue = self._queues[group_id] = collections.deque()
        progress = GroupProgress(request.sampling_params.n)
        finished = False
        try:
            while True:
                while not queue:
                    if deadline is not None and loop.time() > deadline:
                        raise RequestTimeoutError(f"request {group_id!r} ran past its {timeout_s:g} s timeout")
                    for out in self.core.step():
                        if out.group_id in self._queues:
                            self._queues[out.group_id].append(out)
                    scheduler = self.core.scheduler
                    self.load = EngineLoad(scheduler.num_waiting, scheduler.num_running,
                                           scheduler.kv_cache_manager.usage)
                    await asyncio.sleep(0)  # let the other streams read theirs
                out = queue.popleft()
                yield out
                if out.finished and progress.end(out.sample_index) and progress.complete:
                    finished = True
                    return
        finally:
            self._queues.pop(group_id, None)
            if not finished:
                self.core.abort_requests([group_id])

    async def abort(self, request_id: str) -> None:
        self.core.abort_requests([request_id])

    def shutdown(self) -> None:
        self.core.shutdown()
