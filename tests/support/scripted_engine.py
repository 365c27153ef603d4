"""Scripted engine clients, without Ray: each request gets a script's records, an
EngineDeadError in the script kills the engine there. For the tests of what the frontend does
when an engine dies mid-stream (replay, data parallelism)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from raypaged.core.errors import EngineDeadError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request

Script = Callable[[Request], list]


class FakeEngine:
    """generate yields the script's records for the request and raises its exceptions; an
    EngineDeadError kills the engine there (wait_dead returns)."""

    def __init__(self, script: Script, model_info: dict | None = None) -> None:
        self.script = script
        self.alive = True
        self.requests: list[Request] = []
        self.aborts: list[str] = []
        self.model_info: dict = model_info or {}
        self.load = None
        self.on_batch = None
        self._dead = asyncio.Event()

    @property
    def is_alive(self) -> bool:
        return self.alive

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return "killed"

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        self.alive = False

    async def generate(self, request: Request, timeout_s: float | None = None):
        self.requests.append(request)
        for item in self.script(request):
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                if isinstance(item, EngineDeadError):
                    self.alive = False
                    self._dead.set()
                raise item
            yield item

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)


def record(group: str, index: int, tokens: list[int], finish: FinishReason | None = None,
           cached: int | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(group, group, index, tokens, finish_reason=finish, num_cached_tokens=cached)


def dies_after(*records: EngineCoreOutput) -> Script:
    return lambda request: [*records, EngineDeadError("the engine is gone: killed")]


def finishes(tokens: list[int]) -> Script:
    """Each request (a resumed sample's too) gets `tokens` and finishes for length."""
    return lambda request: [record(request.group_id, 0, tokens, FinishReason.LENGTH)]
