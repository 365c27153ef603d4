"""One step's plan: which requests compute which tokens, within the token budget.

schedule() gives every running request its next prefill chunk or one decode token, then admits
waiting requests (prefix-cache hits first taken, then their first chunk), within the token
budget (max_num_batched_tokens) and max_num_seqs; a prompt longer than what is left of the budget
is chunked (enable_chunked_prefill) or waits for a step with room for it whole. A request that
gets no block makes room by preemption (preemption.py). The result is a SchedulerOutput, the
diff the workers apply (see outputs.py).
"""

from __future__ import annotations

from itertools import islice

from raypaged.core.group_tables import attach_group_tables
from raypaged.core.outputs import NewRequestData, SchedulerOutput
from raypaged.core.preemption import Preemption
from raypaged.core.request import Request, RequestStatus

__all__ = ["StepPlanning"]

_RUNNING = RequestStatus.RUNNING
# new_block_ids of every running request whose table did not grow: one shared list, which its
# readers (the workers) never write to; building a fresh one per request per step costs.
_NO_BLOCKS: list[int] = []


class StepPlanning(Preemption):
    """The scheduler's part that plans each step: schedule() and the hooks
    _update_after_schedule and _may_admit."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        # The scheduled requests in num_scheduled_tokens' order: update_from_output walks them.
        self._scheduled = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        kv = self.kv_cache_manager
        out.block_copies, out.kv_transfers = kv.take_block_copies(), kv.take_transfers()
        attach_group_tables(out, kv)
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Hook: the step is scheduled (self._scheduled: its requests in num_scheduled_tokens'
        order). Here it is the step the next update_from_output answers."""
        self._last_output = out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first, in order (the oldest keep their place under memory pressure):
        each gets its next prefill chunk or decode token. Returns the budget left."""
        allocate = self.kv_cache_manager.allocate_slots
        block_size = self.config.block_size
        num_slots, on_workers = self._num_slots, self._on_workers
        num_scheduled = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        ids_append, tokens_append = cached.req_ids.append, cached.new_token_ids.append
        computed_append = cached.num_computed_tokens.append
        running, scheduled = self.running, self._scheduled
        i = 0
        while i < len(running) and budget > 0:
            # The common case, tight: a request the workers hold whose remaining tokens fit the
            # budget and get their slots. This loop schedules a contiguous run of `running` and
            # leaves the list as it is (so it may iterate it directly); it breaks out for the
            # rest: a chunk, the budget spent, a table not counted (after a fork, or unknown to
            # the workers), no free block (preemption). Per request it only appends what
            # differs; the run's bookkeeping is done in bulk after it.
            first = len(num_scheduled)
            grown: list[tuple[int, list[int]]] = []  # (index in the run, blocks appended)
            for request in running if i == 0 else islice(running, i, None):
                computed = request.num_computed_tokens
                tokens = request.all_token_ids
                num_new = len(tokens) - computed
                if not 0 < num_new <= budget:  # 0: it waits for a token in flight (AsyncScheduler)
                    break
                request_id = request.request_id
                slots = num_slots[request_id]
                if computed + num_new > slots:
                    # The table must grow (a decode entering a new block). A table counted
                    # here (slots >= 0) is private, so its growth never copies on write and
                    # the workers get only the new blocks.
                    if slots < 0 or request_id not in on_workers:
                        break
                    new_blocks = allocate(request, num_new)
                    if new_blocks is None:
                        break
                    num_slots[request_id] = slots + len(new_blocks) * block_size
                    grown.append((len(num_scheduled) - first, new_blocks))
                num_scheduled[request_id] = num_new
                ids_append(request_id)
                # A decode's one token, built without a slice (cheaper, and this runs per request).
                tokens_append([tokens[computed]] if num_new == 1 else tokens[computed:])
                computed_append(computed)
                budget -= num_new
            count = len(num_scheduled) - first
            scheduled += running[i:i + count]
            block_ids = cached.new_block_ids
            base = len(block_ids)
            block_ids += [_NO_BLOCKS] * count
            for k, new_blocks in grown:
                block_ids[base + k] = new_blocks
            i += count
            if i >= len(running) or budget <= 0:
                break
            i, budget = self._schedule_running_slow(i, budget, out)
        return budget

    def _schedule_running_slow(self, i: int, budget: int, out: SchedulerOutput) -> tuple[int, int]:
        """running[i] did not take the common path: chunk its prefill to the budget (or skip it,
        unchunked), then get its slots, preempting until they fit or it is the victim itself.
        Returns the index of the next request to schedule and the budget left."""
        request = self.running[i]
        computed = request.num_computed_tokens
        num_new = len(request.all_token_ids) - computed
        if num_new == 0:  # its step in flight samples its next token: it sits this one out
            return i + 1, budget
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return i + 1, budget
            num_new = budget
        new_blocks, i, budget = self._allocate_preempting(i, num_new, budget, out)
        if new_blocks is None:
            return i, budget
        self._schedule_allocated(request, computed, num_new, new_blocks, out)
        self._scheduled.append(request)
        return i + 1, budget - num_new

    def _schedule_allocated(self, request: Request, computed: int, num_new: int, new_blocks: list[int],
                            out: SchedulerOutput) -> None:
        """Schedule num_new tokens of a running request that allocate_slots just gave new_blocks
        (the caller adds it to _scheduled)."""
        request_id = request.request_id
        kv = self.kv_cache_manager
        if self._num_slots[request_id] < 0:  # forced through the manager after a fork
            self._num_slots[request_id] = len(kv.get_block_ids(request_id)) * self.config.block_size
        else:
            self._num_slots[request_id] += len(new_blocks) * self.config.block_size
        out.num_scheduled_tokens[request_id] = num_new
        rewritten = kv.pop_rewritten(request_id)
        if request_id in self._on_workers and not rewritten:
            cached = out.scheduled_cached_reqs
            cached.req_ids.append(request_id)
            cached.new_token_ids.append(request.all_token_ids[computed:computed + num_new])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(computed)
        else:
            self._send_new(request, kv.get_block_ids(request_id), out, rewritten)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Then waiting requests, in queue order; in fcfs they never preempt running ones.
        Returns the budget left."""
        config, kv = self.config, self.kv_cache_manager
        waiting, running = self.waiting, self.running
        while len(waiting) and budget > 0:
            request = waiting.peek()
            if not self._may_admit(request):
                break
            if len(running) >= config.max_num_seqs:
                if waiting.outranks_running(request, running):
                    budget += self._preempt_victim(out)
                    continue
                break
            # Prompt logprobs still to score: every prompt position is computed (no hit).
            hit_blocks, num_hit_tokens = (([], 0) if request.prompt_logprobs_pending
                                          else kv.get_computed_blocks(request))
            num_new = len(request.all_token_ids) - num_hit_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break  # head-of-line: it waits for a step with room for its whole prompt
                num_new = budget
            new_blocks = kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                if not kv.can_fit(len(request.all_token_ids)):
                    waiting.pop()
                    self._finish_unfittable(request, out)
                    continue
                if waiting.outranks_running(request, running):
                    budget += self._preempt_victim(out)
                    continue
                break
            waiting.pop()
            if request.status is RequestStatus.WAITING and not request.num_output_tokens:
                request.num_cached_tokens = num_hit_tokens  # first schedule of a fresh request
            request.status = _RUNNING
            request.num_computed_tokens = num_hit_tokens
            running.append(request)
            self._num_slots[request.request_id] = len(new_blocks) * config.block_size
            out.num_scheduled_tokens[request.request_id] = num_new
            self._scheduled.append(request)
            budget -= num_new
            # A table allocated just now was never rewritten: the workers get it whole anyway.
            self._send_new(request, new_blocks, out, rewritten=False)
        return budget

    def _may_admit(self, request: Request) -> bool:
        """Hook: may the request at the head of the waiting queue be scheduled now? (If not,
        nothing behind it is.) Not while its KV manager loads its prefix from a host tier."""
        return self.kv_cache_manager.may_admit(request)

    def _send_new(self, request: Request, block_ids: list[int], out: SchedulerOutput,
                  rewritten: bool) -> None:
        """Send the request whole (rewritten: copy-on-write changed its table since the workers
        got it)."""
        request_id = request.request_id
        if rewritten and request_id in self._on_workers:
            # Copy-on-write replaced a block of a request the workers hold: drop it there and
            # send it again whole (workers drop before they add).
            out.finished_req_ids.add(request_id)
        self._on_workers.add(request_id)
        out.scheduled_new_reqs.append(NewRequestData(
            req_id=request_id, token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.sampling_params,
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id))

