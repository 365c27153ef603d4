"""Continuous-batching scheduler: which requests compute which tokens each step.

Each step, schedule() gives every running request its next prefill chunk or one decode token,
then admits waiting requests (prefix-cache hits first taken, then their first chunk), within the
token budget (max_num_batched_tokens) and max_num_seqs. When a running request cannot get a
block, the newest (fcfs) or lowest-priority running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, to be prefilled again later (prompt
and outputs so far, with prefix-cache hits). The result is a SchedulerOutput, the diff the workers
apply (see outputs.py). update_from_output() (scheduler_update.py) takes the sampled tokens,
checks stop conditions, forks n > 1 requests once their prompt is done, and frees finished
requests' blocks at once.

With asynchronous scheduling schedule() runs a step ahead of update_from_output (see
scheduler_update.py).

Who the workers hold: every request that went out as NewRequestData and has not been dropped since
(finished_req_ids / preempted_req_ids). A running request the workers do not hold (a sample just
forked, or one whose block table copy-on-write changed) goes out whole as NewRequestData, a held
one as a CachedRequestData entry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from raypaged.core.admission import check_new_request
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.kv_cache_manager import KVCacheManager, KVCacheStats
from raypaged.core.outputs import EngineCoreOutput, EngineCoreOutputs, NewRequestData, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request, RequestStatus
from raypaged.core.request_queue import make_request_queue
from raypaged.core.scheduler_config import SchedulerConfig
from raypaged.core.scheduler_update import SchedulerUpdate
from raypaged.core.stop_checks import prepare_stop_checks

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING = RequestStatus.RUNNING
# new_block_ids of every running request whose table did not grow: one shared list, which its
# readers (the workers) never write to; building a fresh one per request per step costs.
_NO_BLOCKS: list[int] = []
_LENGTH = FinishReason.LENGTH


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # since the scheduler started
    kv_cache: KVCacheStats


class Scheduler(SchedulerUpdate):
    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerInterface | None = None) -> None:
        self.config = config
        if kv_cache_manager is None:
            kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size,
                                              config.enable_prefix_caching)
        elif kv_cache_manager.block_size != config.block_size:
            raise ValueError(f"the KV cache manager's block_size ({kv_cache_manager.block_size}) "
                             f"differs from the config's ({config.block_size})")
        self.kv_cache_manager = kv_cache_manager
        # Optional manager hooks (the paged manager has both; a manager without them never
        # registers prefixes nor rewrites tables).
        self._cache_blocks = getattr(kv_cache_manager, "cache_blocks", None)
        self._rewritten: set[str] = getattr(kv_cache_manager, "rewritten_req_ids", set())
        self._priority = config.policy == "priority"

        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._groups: dict[str, set[str]] = {}  # group id -> ids of its unfinished samples
        self._on_workers: set[str] = set()
        self._finished_req_ids: set[str] = set()  # dropped since the last schedule()
        self._pending_outputs = EngineCoreOutputs()  # finished inside schedule()
        # Running request id -> slots in its block table, from what allocate_slots returned: while
        # a step fits, the scheduler need not ask the manager. -1 forces the next step through
        # allocate_slots (after a fork: copy-on-write, or a copying manager's new table).
        self._num_slots: dict[str, int] = {}
        self._last_output: SchedulerOutput | None = None  # and the requests it scheduled, in order:
        self._scheduled: list[Request] = []
        self.num_preemptions = 0
        # Asynchronous scheduling: the steps scheduled and not yet answered, oldest first, with
        # the requests each scheduled and where each one's tokens end. A request preempted while
        # a step holding it is in flight is held back from waiting until that step is answered.
        self._in_flight: deque[tuple[SchedulerOutput, list[Request], list[int]]] = deque()
        self._held_back: set[str] = set()

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

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (asynchronous scheduling) a step still to be answered."""
        return bool(self.requests) or bool(self._in_flight)

    def oldest_in_flight(self) -> SchedulerOutput | None:
        """Asynchronous scheduling: the step the next update_from_output answers, if any."""
        return self._in_flight[0][0] if self._in_flight else None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              self.kv_cache_manager.stats())

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        if self._held_back and not self._in_flight:
            self._held_back.clear()
        # The scheduled requests in num_scheduled_tokens' order: update_from_output walks them.
        self._scheduled = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.kv_cache_manager.take_block_copies()
        self._last_output = out
        if self.config.async_scheduling and out.total_num_scheduled_tokens:
            # Each scheduled request was advanced as it was scheduled: its count is its end now.
            scheduled = self._scheduled
            self._in_flight.append((out, scheduled, [r.num_computed_tokens for r in scheduled]))
        return out

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
        advance = self.config.async_scheduling
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
                if not 0 < num_new <= budget:  # 0: it waits for its token (async scheduling)
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
                if advance:  # _advance inline (this path's step always reaches the last token)
                    end = computed + num_new
                    request.num_computed_tokens = end
                    if end < request.max_num_tokens - 1 and (
                            request.sampling_params.n == 1 or end > len(request.prompt_token_ids)):
                        tokens.append(PLACEHOLDER_TOKEN_ID)
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
        running, kv = self.running, self.kv_cache_manager
        request = running[i]
        computed = request.num_computed_tokens
        tokens = request.all_token_ids
        num_new = len(tokens) - computed
        if num_new == 0:  # its step in flight samples its next token: it sits this one out
            return i + 1, budget
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return i + 1, budget
            num_new = budget
        new_blocks = kv.allocate_slots(request, num_new)
        while new_blocks is None:  # out of blocks: preempt until it fits or it is the victim
            if not kv.can_fit(len(tokens)):
                if tokens[-1] == PLACEHOLDER_TOKEN_ID:
                    return i + 1, budget  # it ends once the token in flight is here, not before
                running.pop(i)
                self._finish_unfittable(request, out)
                return i, budget  # running[i] is already the next request
            victim_index = self._pick_victim()
            victim = running[victim_index]
            budget += self._preempt(victim_index, out)
            if victim is request:
                return i, budget
            if victim_index < i:
                i -= 1
            new_blocks = kv.allocate_slots(request, num_new)
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
        if request_id in self._on_workers and request_id not in self._rewritten:
            cached = out.scheduled_cached_reqs
            cached.req_ids.append(request_id)
            cached.new_token_ids.append(request.all_token_ids[computed:computed + num_new])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(computed)
        else:
            self._send_new(request, kv.get_block_ids(request_id), out)
        if self.config.async_scheduling:
            self._advance(request, computed + num_new)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Then waiting requests, in queue order; in fcfs they never preempt running ones.
        Returns the budget left."""
        config, kv = self.config, self.kv_cache_manager
        waiting, running = self.waiting, self.running
        held_back = self._held_back
        while len(waiting) and budget > 0:
            request = waiting.peek()
            if held_back and request.request_id in held_back:
                break  # preempted while its step is in flight: it waits for that step's answer
            if len(running) >= config.max_num_seqs:
                if self._priority and self._outranks_a_running_request(request):
                    budget += self._preempt(self._pick_victim(), out)
                    continue
                break
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
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
                if self._priority and self._outranks_a_running_request(request):
                    budget += self._preempt(self._pick_victim(), out)
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
            self._send_new(request, new_blocks, out)
            if config.async_scheduling:
                self._advance(request, num_hit_tokens + num_new)
        return budget

    # ---- helpers ---------------------------------------------------------------------------------
    def _send_new(self, request: Request, block_ids: list[int], out: SchedulerOutput) -> None:
        request_id = request.request_id
        if request_id in self._rewritten:
            # Copy-on-write replaced a block of a request the workers hold: drop it there and
            # send it again whole (workers drop before they add).
            self._rewritten.discard(request_id)
            if request_id in self._on_workers:
                out.finished_req_ids.add(request_id)
        self._on_workers.add(request_id)
        out.scheduled_new_reqs.append(NewRequestData(
            req_id=request_id, token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.sampling_params,
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id))

    def _pick_victim(self) -> int:
        """Index in running of the request to preempt: the newest (fcfs) or the lowest priority,
        newest among equals (priority)."""
        running = self.running
        if not self._priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda k: (running[k].priority, running[k].arrival_time, k))

    def _outranks_a_running_request(self, request: Request) -> bool:
        if not self.running:
            return False
        victim = self.running[self._pick_victim()]
        return (request.priority, request.arrival_time) < (victim.priority, victim.arrival_time)

    def _preempt(self, index: int, out: SchedulerOutput) -> int:
        """Preempt running[index] by recompute. Returns the tokens it had been given in this
        step (now back in the budget)."""
        request = self.running.pop(index)
        request_id = request.request_id
        refund = out.num_scheduled_tokens.pop(request_id, 0)
        if refund:
            self._scheduled.remove(request)
            self._unschedule(request_id, out)
        self.kv_cache_manager.free(request)
        del self._num_slots[request_id]
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if self.config.async_scheduling:
            # Its tokens still to come (two once the next step was scheduled too, as when the
            # workers fail) are sampled again when it recomputes.
            tokens = request.all_token_ids
            while tokens and tokens[-1] == PLACEHOLDER_TOKEN_ID:
                tokens.pop()
            self._held_back.add(request_id)
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
        self._on_workers.clear()
        self._rewritten.clear()
        self._finished_req_ids.clear()
        self._in_flight.clear()  # their answers died with the workers
        self._held_back.clear()
        self.kv_cache_manager.reset_prefix_cache()

    def _unschedule(self, request_id: str, out: SchedulerOutput) -> None:
        """Take a request scheduled earlier in this step back out of the output (priority
        preemption can pick one)."""
        cached = out.scheduled_cached_reqs
        if request_id in cached.req_ids:
            k = cached.req_ids.index(request_id)
            for column in (cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens):
                del column[k]
            return
        out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id != request_id]
        # The workers never got it (or drop it anyway, if it was being resent).
        self._on_workers.discard(request_id)

    def _finish_unfittable(self, request: Request, out: SchedulerOutput) -> None:
        """The request has outgrown the whole KV cache: end it with LENGTH (the cache's length)."""
        self._finish(request, _LENGTH, None, out.finished_req_ids)
        for record in self._end_records(request):
            self._pending_outputs.append(record)
