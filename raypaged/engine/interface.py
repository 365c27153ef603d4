"""EngineClient: what a front door needs of an engine, whatever stands behind it.

`AsyncEngineClient` (engine/client.py) is one engine actor; `ReplayingEngine`
(frontend/replay.py) is the supervisor's current one, whose streams survive the actor's death.
GenerationService (frontend/service.py) and the OpenAI front door read only this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import Any

from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import Request


class EngineClient(ABC):
    @property
    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """What the engine serves: model_dir, max_model_len, block_size, num_blocks, ..."""

    @property
    @abstractmethod
    def load(self) -> EngineLoad | None:
        """The engine's load as of its last batch of outputs (None before the first)."""

    @property
    @abstractmethod
    def is_alive(self) -> bool:
        """Whether a new request can be served (now, or once a restarting engine is back)."""

    @abstractmethod
    def generate(self, request: Request,
                 timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        """The request's outputs, every sample's, as the engine produces them; ending the
        iteration early aborts what is left in the engine. timeout_s: past it,
        RequestTimeoutError in place of the next output. A dead engine raises EngineDeadError."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a group (its id) or one sample (sample_id(group, i)); an id not streaming is
        ignored."""
