"""Overload: refuse a new request early and cheaply, before it reaches the engine.

A burst of several times what the engine sustains would otherwise pile up in the engine's
waiting queue: memory grows and every accepted request's latency with it. The front door sheds
instead, answering RESOURCE_EXHAUSTED / HTTP 429 with a Retry-After, by three measures:

- waiting requests: those this frontend sent whose first output has not come back yet (queued
  in the engine, or in their prefill), against max_waiting_requests, the engine's own bound
  (which stays as the backstop for whatever passes here);
- waiting prompt tokens: the same requests' prompt tokens plus the new one's, against
  max_waiting_tokens; a request alone in the queue always passes, or a prompt above the bound
  could never be served;
- KV pressure: the pool's usage in the engine's last load snapshot (core/outputs.py EngineLoad,
  carried on every batch of outputs the engine client pulls: no round trip per request), at or
  above shed_kv_usage while requests are already waiting.

The waiting counts are this frontend's own, exact the moment a request is admitted (the
engine's snapshot lags a burst by the requests sent since); one frontend serves each engine.

Retry-After: retry_after_s when set; otherwise the waiting requests over the recent completion
rate (completions in the last COMPLETION_WINDOW_S), rounded up and held to [1, 60] s — 1 s when
nothing has completed in the window yet.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from raypaged.config import EngineConfig
from raypaged.core.errors import QueueFullError
from raypaged.core.outputs import EngineLoad

COMPLETION_WINDOW_S = 30.0
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1.0, 60.0
SHED_REASONS = ("waiting_requests", "waiting_tokens", "kv_cache")


@dataclass(frozen=True)
class OverloadPolicy:
    """The thresholds; None turns a measure off. request_timeout_s is the server's default
    timeout (frontend/service.py applies it)."""

    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    shed_kv_usage: float | None = None
    retry_after_s: float | None = None  # None: estimated (see the module's docstring)
    request_timeout_s: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> OverloadPolicy:
        serving = config.serving
        return cls(max_waiting_requests=config.scheduler.max_waiting_requests,
                   max_waiting_tokens=serving.max_waiting_tokens, shed_kv_usage=serving.shed_kv_usage,
                   retry_after_s=serving.retry_after_s, request_timeout_s=serving.request_timeout_s)


class ShedError(QueueFullError):
    """A request the front door shed; reason is one of SHED_REASONS."""

    # Defaults: Ray rebuilds an exception that crossed processes from its message alone.
    def __init__(self, message: str, reason: str = "waiting_requests",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason


class Admission:
    """One admitted request's place in the waiting counts, until first_output() or close()
    (both idempotent; close() after a full run also counts a completion)."""

    def __init__(self, shedder: LoadShedder, num_prompt_tokens: int) -> None:
        self._shedder = shedder
        self.num_prompt_tokens = num_prompt_tokens
        self._waiting = True

    def first_output(self) -> None:
        if self._waiting:
            self._waiting = False
            self._shedder._leave_queue(self.num_prompt_tokens)

    def close(self, completed: bool) -> None:
        self.first_output()
        if completed:
            self._shedder._completed()


class LoadShedder:
    def __init__(self, policy: OverloadPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.num_waiting = 0
        self.num_waiting_tokens = 0
        self._clock = clock
        # Completion times inside the window; bounded, so a flood of completions costs nothing.
        self._completions: deque[float] = deque(maxlen=1024)

    def check(self, load: EngineLoad | None) -> None:
        """ShedError when a request would be shed whatever its prompt: called before the
        prompt is tokenized, so a flood costs no tokenizing."""
        self._raise_if_shed(None, load)

    def admit(self, num_prompt_tokens: int, load: EngineLoad | None) -> Admission:
        """An Admission for the request, or ShedError (nothing counted) when it must wait its
        turn elsewhere. load: the engine's last snapshot (None: not known yet)."""
        self._raise_if_shed(num_prompt_tokens, load)
        self.num_waiting += 1
        self.num_waiting_tokens += num_prompt_tokens
        return Admission(self, num_prompt_tokens)

    def _raise_if_shed(self, num_prompt_tokens: int | None, load: EngineLoad | None) -> None:
        shed = self._shed_reason(num_prompt_tokens, load)
        if shed is not None:
            reason, why = shed
            raise ShedError(f"the server is overloaded ({why}); try again later", reason,
                            self.retry_after_s())

    def _shed_reason(self, num_prompt_tokens: int | None,
                     load: EngineLoad | None) -> tuple[str, str] | None:
        """(reason, what the client is told) when the request must be shed; the tokens'
        measure is skipped while num_prompt_tokens is not known (None)."""
        policy = self.policy
        if policy.max_waiting_requests is not None and self.num_waiting >= policy.max_waiting_requests:
            return "waiting_requests", f"{self.num_waiting} requests are waiting"
        if (policy.max_waiting_tokens is not None and num_prompt_tokens is not None
                and self.num_waiting_tokens > 0
                and self.num_waiting_tokens + num_prompt_tokens > policy.max_waiting_tokens):
            return "waiting_tokens", f"{self.num_waiting_tokens} prompt tokens are waiting"
        if (policy.shed_kv_usage is not None and load is not None and load.kv_usage >= policy.shed_kv_usage
                and (self.num_waiting > 0 or load.num_waiting > 0)):
            return "kv_cache", f"the KV cache is {load.kv_usage:.0%} full and requests are waiting"
        return None

    def retry_after_s(self) -> float:
        """What a refused client is told to wait (see the module's docstring)."""
        if self.policy.retry_after_s is not None:
            return self.policy.retry_after_s
        now = self._clock()
        while self._completions and self._completions[0] < now - COMPLETION_WINDOW_S:
            self._completions.popleft()
        if not self._completions:
            return MIN_RETRY_AFTER_S
        span = max(now - self._completions[0], 1.0)
        rate = len(self._completions) / span
        estimate = math.ceil(max(self.num_waiting, 1) / rate)
        return float(min(max(estimate, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S))

    def _leave_queue(self, num_prompt_tokens: int) -> None:
        self.num_waiting -= 1
        self.num_waiting_tokens -= num_prompt_tokens

    def _completed(self) -> None:
        self._completions.append(self._clock())
