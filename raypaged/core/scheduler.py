"""Continuous-batching scheduler: which requests compute which tokens each step.

Each step, schedule() gives every running request its next prefill chunk or one decode token,
then admits waiting requests, within the token budget and max_num_seqs (step_planning.py). When a
running request cannot get a block, the newest (fcfs) or lowest-priority running request is
preempted by recompute (preemption.py). The result is a SchedulerOutput, the diff the workers
apply (see outputs.py).

update_from_output() takes the step's sampled tokens (step_answer.py): it appends each token,
checks stop conditions, forks an n > 1 request once its prompt is done (forking.py), frees
finished requests' blocks at once, and returns the step's records as one EngineCoreOutputs batch.
Aborts (abort_requests) finish requests through the same path. Requests come in through
add_request, checked by admission.py. The state the parts share, and who the workers hold, is
scheduler_state.py's.

This Scheduler answers each step before the next is scheduled. AsyncScheduler
(async_scheduler.py) plans step N+1 while step N runs, through the hooks
_update_after_schedule and _take_answered.
"""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.core.admission import check_new_request
from raypaged.core.kv_cache_interface import KVCacheStats
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.parallel_sampling import end_records, requests_named
from raypaged.core.request import FinishReason, Request, RequestStatus
from raypaged.core.scheduler_config import SchedulerConfig
from raypaged.core.step_answer import StepAnswer
from raypaged.core.step_planning import StepPlanning
from raypaged.core.stop_checks import prepare_stop_checks

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # since the scheduler started
    kv_cache: KVCacheStats


class Scheduler(StepPlanning, StepAnswer):
    """Answers each step before it schedules the next: schedule(), then update_from_output() of
    that same step (config.async_scheduling False; AsyncScheduler for True)."""

    # ---- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. InvalidRequestError (QueueFullError when the waiting queue is at its
        bound) leaves the scheduler unchanged."""
        check_new_request(request, self.config, self.kv_cache_manager, self.requests, self._groups,
                          len(self.waiting))
        prepare_stop_checks(request, self.config.max_model_len)
        request_id = request.request_id
        self.requests[request_id] = request
        self._groups.setdefault(request.group_id, set()).add(request_id)
        self.waiting.add(request)

    def check_request(self, request: Request) -> None:
        """What add_request would raise for the request, without queueing it (the engine asks
        before it holds a request back while its grammar compiles)."""
        check_new_request(request, self.config, self.kv_cache_manager, self.requests, self._groups,
                          len(self.waiting))

    def has_group(self, group_id: str) -> bool:
        """Whether any sample of the group is unfinished."""
        return group_id in self._groups

    def has_unfinished_requests(self) -> bool:
        """Requests not finished (or, AsyncScheduler, a step still to be answered)."""
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              self.kv_cache_manager.stats())

    # ---- finishing -------------------------------------------------------------------------------
    def abort_requests(self, group_or_request_ids: str | list[str]) -> list[EngineCoreOutput]:
        """Abort requests in any state. A group id aborts every sample of the group; a sample id
        ("group#i", i >= 0: core/sample_ids.py) that one. UnknownRequestError, before anything changes, for an id that
        names no unfinished request or group."""
        ids = [group_or_request_ids] if isinstance(group_or_request_ids, str) else group_or_request_ids
        targets = requests_named(ids, self.requests, self._groups)
        outputs = []
        dropped = set()
        for request in targets.values():
            if request.status is RequestStatus.RUNNING:
                dropped.add(request.request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT, None, self._finished_req_ids)
            outputs.extend(end_records(request))
        if dropped:
            self.running = [r for r in self.running if r.request_id not in dropped]
        return outputs

