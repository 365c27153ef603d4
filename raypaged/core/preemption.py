"""Preemption: making room in the KV cache for the requests the step schedules.

When a running request cannot get a block, a victim is preempted: the newest running request
(fcfs), or the lowest-priority one (the waiting queue's preemption_victim chooses). Preemption is
by recompute: the victim's blocks are freed (or swapped out to a host tier, if the KV manager has
one) and it goes back to the front of the waiting queue, to be prefilled again later (prompt and
outputs so far, with prefix-cache hits). A request that has outgrown the whole KV cache is not
given room: it ends with LENGTH.
"""

from __future__ import annotations

from raypaged.core.outputs import SchedulerOutput
from raypaged.core.parallel_sampling import end_records
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request, RequestStatus
from raypaged.core.scheduler_state import SchedulerState

__all__ = ["Preemption"]


class Preemption(SchedulerState):
    """The scheduler's part that preempts running requests and ends the ones that cannot fit."""

    def _allocate_preempting(self, i: int, num_new: int, budget: int, out: SchedulerOutput
                             ) -> tuple[list[int] | None, int, int]:
        """Slots for num_new tokens of running[i], preempting running requests until they fit or
        running[i] is the victim itself. Returns its new blocks, the index it has now and the
        budget left, or, when it is not scheduled this step (preempted, ended, or its token in
        flight still to come), None, the index of the next request to schedule and the budget."""
        running, kv = self.running, self.kv_cache_manager
        request = running[i]
        tokens = request.all_token_ids
        new_blocks = kv.allocate_slots(request, num_new)
        while new_blocks is None:
            if not kv.can_fit(len(tokens)):
                if tokens[-1] == PLACEHOLDER_TOKEN_ID:
                    return None, i + 1, budget  # it ends once the token in flight is here, not before
                running.pop(i)
                self._finish_unfittable(request, out)
                return None, i, budget  # running[i] is already the next request
            victim_index = self.waiting.preemption_victim(running)
            victim = running[victim_index]
            budget += self._preempt(victim_index, out)
            if victim is request:
                return None, i, budget
            if victim_index < i:
                i -= 1
            new_blocks = kv.allocate_slots(request, num_new)
        return new_blocks, i, budget

    def _preempt_victim(self, out: SchedulerOutput) -> int:
        """Preempt the waiting queue's choice of victim among the running requests (for a waiting
        request that outranks it). Returns the tokens it gave back to the budget."""
        return self._preempt(self.waiting.preemption_victim(self.running), out)

    def _preempt(self, index: int, out: SchedulerOutput) -> int:
        """Preempt running[index] (by recompute, unless the manager swaps). Returns the tokens it
        had been given in this step (now back in the budget)."""
        request = self.running.pop(index)
        request_id = request.request_id
        refund = out.num_scheduled_tokens.pop(request_id, 0)
        if refund:
            self._scheduled.remove(request)
            if not out.unschedule(request_id):
                self._on_workers.discard(request_id)  # never got it, or drops it anyway (resent)
        self.kv_cache_manager.free_preempted(request)  # swapped out to the host tier, if asked
        del self._num_slots[request_id]
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        if request_id in self._on_workers:
            self._on_workers.discard(request_id)
            if request_id not in out.finished_req_ids:
                out.preempted_req_ids.add(request_id)
        return refund

    def reset_workers(self) -> None:
        """The workers were replaced (their group failed) and hold nothing now. Every running
        request goes back to waiting and recomputes its prompt plus the tokens it already
        produced, as after a preemption, in its original order; the prefix cache is emptied,
        since its blocks' contents died with the old workers' KV pools."""
        scratch = SchedulerOutput()
        while self.running:  # newest first: each goes to the front, so the oldest ends first
            self._preempt(len(self.running) - 1, scratch)
        self._on_workers.clear()  # (freeing every table dropped its rewritten mark too)
        self._finished_req_ids.clear()
        self.kv_cache_manager.reset_prefix_cache()

    def _finish_unfittable(self, request: Request, out: SchedulerOutput) -> None:
        """The request has outgrown the whole KV cache: end it with LENGTH (the cache's length)."""
        self._finish(request, FinishReason.LENGTH, None, out.finished_req_ids)
        for record in end_records(request):
            self._pending_outputs.append(record)

