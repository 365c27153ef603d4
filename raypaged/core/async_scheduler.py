"""Asynchronous scheduling: plan step N+1 while the workers run step N.

The engine (EngineCore.step_with_batch_queue) schedules step N+1 before step N's sampled tokens
are back, and hands step N's tokens to update_from_output after that. So a step's tokens count as
computed as soon as it is scheduled, and each request the step will sample for gets a
PLACEHOLDER_TOKEN_ID as its next token, which step N+1 may already schedule (the workers put the
sampled token in its place). A request whose next token may end it for length, or that forks
(n > 1) on it, gets no placeholder: it sits out step N+1. A request with a structured output
gets one too, though step N+1's grammar mask needs the token step N samples: that step's
sampling is deferred (SchedulerOutput.grammar_deferred) until step N+2 brings the mask, computed
once step N's tokens are back, so its forward still overlaps the host's work
(raypaged/structured/manager.py). A stop token ends a request one step late: the token step N+1
computed for it is dropped.

Everything else is the Scheduler's: this class only overrides its hooks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.outputs import EngineCoreOutputs, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request
from raypaged.core.scheduler import Scheduler
from raypaged.core.scheduler_config import SchedulerConfig

__all__ = ["AsyncScheduler", "make_scheduler"]


def make_scheduler(config: SchedulerConfig,
                   kv_cache_manager: KVCacheManagerInterface | None = None) -> Scheduler:
    """The scheduler config.async_scheduling asks for."""
    scheduler_class = AsyncScheduler if config.async_scheduling else Scheduler
    return scheduler_class(config, kv_cache_manager)


class AsyncScheduler(Scheduler):
    """update_from_output answers the oldest step in flight; several may be (a step that
    scheduled nothing is never in flight)."""

    async_scheduling: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerInterface | None = None) -> None:
        super().__init__(config, kv_cache_manager)
        # The steps scheduled and not yet answered, oldest first, with the requests each
        # scheduled and where each one's tokens end.
        self._in_flight: deque[tuple[SchedulerOutput, list[Request], list[int]]] = deque()
        # Preempted while a step holding them is in flight: they stay at the head of waiting
        # until that step is answered (its answer still names them).
        self._held_back: set[str] = set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._in_flight)

    def oldest_in_flight(self) -> SchedulerOutput | None:
        """The step the next update_from_output answers, if any."""
        return self._in_flight[0][0] if self._in_flight else None

    def take_pending_outputs(self) -> EngineCoreOutputs:
        """Records made inside schedule() (requests that outgrew the cache) when no step's
        answer will carry them: nothing was in flight before the step just scheduled."""
        outputs, self._pending_outputs = self._pending_outputs, EngineCoreOutputs()
        return outputs

    # ---- the Scheduler's hooks -------------------------------------------------------------------
    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Count the step's tokens as computed and give each request it samples for a
        placeholder. The diff already holds the tokens before it: the workers get those."""
        scheduled = self._scheduled
        if scheduled:
            ends: list[int] = []
            ends_append = ends.append
            for request, num_new in zip(scheduled, out.num_scheduled_tokens.values()):
                end = request.num_computed_tokens + num_new
                request.num_computed_tokens = end
                ends_append(end)
                tokens = request.all_token_ids
                if end == len(tokens) and end < request.max_num_tokens - 1 and (
                        request.sampling_params.n == 1 or end > len(request.prompt_token_ids)):
                    tokens.append(PLACEHOLDER_TOKEN_ID)
            self._in_flight.append((out, scheduled, ends))
        elif not self._in_flight:
            self._held_back.clear()  # no answer will come to release them

    def _take_answered(self, scheduler_output: SchedulerOutput
                       ) -> tuple[Sequence[Request], list[int] | None]:
        if not self._in_flight or self._in_flight[0][0] is not scheduler_output:
            raise ValueError("update_from_output must answer the oldest step in flight")
        _, scheduled, ends = self._in_flight.popleft()
        self._held_back.clear()  # what schedule() preempted meanwhile has had its answer now
        return scheduled, ends

    def _may_admit(self, request: Request) -> bool:
        held_back = self._held_back and request.request_id in self._held_back
        return not held_back and super()._may_admit(request)

    def _preempt(self, index: int, out: SchedulerOutput) -> int:
        request = self.running[index]
        refund = super()._preempt(index, out)
        # Its tokens still to come (two once the next step was scheduled too, as when the
        # workers fail) are sampled again when it recomputes.
        _drop_placeholders(request)
        self._held_back.add(request.request_id)
        return refund

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None,
                dropped_ids: set[str]) -> None:
        _drop_placeholders(request)  # its next tokens, never to come
        super()._finish(request, reason, stop_reason, dropped_ids)

    def reset_workers(self) -> None:
        super().reset_workers()
        self._in_flight.clear()  # their answers died with the workers
        self._held_back.clear()


def _drop_placeholders(request: Request) -> None:
    tokens = request.all_token_ids
    while tokens and tokens[-1] == PLACEHOLDER_TOKEN_ID:
        tokens.pop()
