"""Continuous-batching scheduler: which requests compute which tokens each step.

Each step, schedule() gives every running request its next prefill chunk or one decode token,
then admits waiting requests (prefix-cache hits first taken, then their first chunk), within the
token budget (max_num_batched_tokens) and max_num_seqs. When a running request cannot get a
block, the newest (fcfs) or lowest-priority running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, to be prefilled again later (prompt
and outputs so far, with prefix-cache hits; a host tier may swap its blocks out and back in).
The result is a SchedulerOutput, the diff the workers apply (see outputs.py).

update_from_output() takes the step's sampled tokens: it advances the computed tokens
(registering a block that filled in the prefix cache), appends each token, checks stop
conditions (stop_checks.py), forks an n > 1 request once its prompt is done
(parallel_sampling.py), frees finished requests' blocks at once, and returns the step's records
as one EngineCoreOutputs batch: a plain record (the request's next token) costs two list
entries; only the rare ones (a first token, a finish, a sample, logprobs) are built whole.
Aborts (abort_requests) finish requests through the same path.

This Scheduler answers each step before the next is scheduled. AsyncScheduler
(async_scheduler.py) plans step N+1 while step N runs, through the hooks
_update_after_schedule and _take_answered.

Who the workers hold: every request that went out as NewRequestData and has not been dropped since
(finished_req_ids / preempted_req_ids). A running request the workers do not hold (a sample just
forked, or one whose block table copy-on-write changed) goes out whole as NewRequestData, a held
one as a CachedRequestData entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from types import SimpleNamespace
from typing import ClassVar, cast

from raypaged.core.admission import check_new_request
from raypaged.core.errors import NoFreeBlocksError
from raypaged.core.group_tables import attach_group_tables
from raypaged.core.kv_cache_interface import KVCacheManagerInterface, KVCacheStats
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    in_scheduled_order,
    request_output,
)
from raypaged.core.parallel_sampling import end_records, new_sample, requests_named
from raypaged.core.prompt_logprobs import take_prompt_logprobs
from raypaged.core.request import (
    PLACEHOLDER_TOKEN_ID,
    FinishReason,
    Request,
    RequestStatus,
)
from raypaged.core.request_queue import make_request_queue
from raypaged.core.scheduler_config import SchedulerConfig
from raypaged.core.stop_checks import check_stop, prepare_stop_checks
from raypaged.core.structured_output import DEAD_END

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING = RequestStatus.RUNNING
# What update_from_output finds for a runner's request id the scheduler no longer holds (aborted
# while the step ran): anything not running is skipped, so one check serves both cases.
_GONE = cast(Request, SimpleNamespace(status=RequestStatus.FINISHED))  # read for its status only
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


class Scheduler:
    """Answers each step before it schedules the next: schedule(), then update_from_output() of
    that same step (config.async_scheduling False; AsyncScheduler for True)."""

    async_scheduling: ClassVar[bool] = False  # the config.async_scheduling this class implements

    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerInterface | None = None) -> None:
        if config.async_scheduling != self.async_scheduling:
            raise ValueError(f"{type(self).__name__} does not schedule with async_scheduling="
                             f"{config.async_scheduling}: build it with make_scheduler(config)")
        self.config = config
        if kv_cache_manager is None:
            kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size,
                                              config.enable_prefix_caching, config.prefix_caching_hash_algo)
        elif kv_cache_manager.block_size != config.block_size:
            raise ValueError(f"the KV cache manager's block_size ({kv_cache_manager.block_size}) "
                             f"differs from the config's ({config.block_size})")
        self.kv_cache_manager = kv_cache_manager
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

    # ---- one step --------------------------------------------------------------------------------
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
            victim_index = self.waiting.preemption_victim(running)
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
                    budget += self._preempt(waiting.preemption_victim(running), out)
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
                    budget += self._preempt(waiting.preemption_victim(running), out)
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

    # ---- helpers ---------------------------------------------------------------------------------
    def _send_new(self, request: Request, block_ids: list[int], out: SchedulerOutput,
                  rewritten: bool) -> None:
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
        self._finish(request, _LENGTH, None, out.finished_req_ids)
        for record in end_records(request):
            self._pending_outputs.append(record)

    # ---- the step's answer -----------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take one step's sampled tokens. Returns a record for each request that got a token or
        finished (after any that finished inside schedule()).

        Each answered request's token goes at position `end`, where the step's tokens for it
        end: it replaces a placeholder there (AsyncScheduler) or is appended. `end` is None
        when the step's tokens count as computed only now (this class)."""
        outputs, self._pending_outputs = self._pending_outputs, EngineCoreOutputs()
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled, ends = self._take_answered(scheduler_output)
        sampled_token_ids, logprobs = in_scheduled_order(num_scheduled, model_runner_output)
        if model_runner_output.prompt_logprobs:
            take_prompt_logprobs(self.requests, model_runner_output.prompt_logprobs)
        cache_blocks = self.kv_cache_manager.cache_blocks
        block_size = self.config.block_size
        max_model_len = self.config.max_model_len
        ids_append, tokens_append = outputs.req_ids.append, outputs.new_token_ids.append
        finished = False
        for request, num_new, sampled, new_logprobs, end in zip(
                scheduled, num_scheduled.values(), sampled_token_ids, logprobs or repeat(None),
                ends or repeat(None)):
            if request.status is not _RUNNING:
                continue  # finished, aborted or preempted while the step ran
            if end is None:
                end = request.num_computed_tokens + num_new
                request.num_computed_tokens = end
            if end % block_size < num_new:
                cache_blocks(request, end)  # the step filled a block: into the prefix cache
            tokens = request.all_token_ids
            num_tokens = len(tokens)
            if end < num_tokens and tokens[end] != PLACEHOLDER_TOKEN_ID:
                if sampled:
                    raise ValueError(f"request {request.request_id!r} sampled a token mid-prompt")
                continue  # a prefill chunk short of the prompt's end
            if request.whole_records or len(sampled) != 1:
                # A first token (n > 1: the fork), logprobs, a sample's record: kept whole.
                finished |= self._take_sampled(request, sampled, new_logprobs, outputs, end)
                continue
            token = sampled[0]
            if end < num_tokens:
                tokens[end] = token
            else:
                tokens.append(token)
            if token in request.stop_token_set or end + 1 >= request.max_num_tokens:
                reason, stop_reason = check_stop(request, token, max_model_len)
                if reason is not None:
                    self._finish(request, reason, stop_reason, self._finished_req_ids)
                    finished = True
                    outputs.append(request_output(request, sampled, None))
                    continue
            # The plain record: the request's next token and nothing else.
            ids_append(request.request_id)
            tokens_append(sampled)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _take_answered(self, scheduler_output: SchedulerOutput
                       ) -> tuple[Sequence[Request], list[int] | None]:
        """Hook: the requests the answered step scheduled, in num_scheduled_tokens' order, and
        where each one's tokens end (None: at its num_computed_tokens plus its scheduled ones)."""
        if scheduler_output is self._last_output:
            scheduled: Sequence[Request] = self._scheduled  # the usual case
        else:
            scheduled = [self.requests.get(request_id, _GONE)
                         for request_id in scheduler_output.num_scheduled_tokens]
        self._last_output = None
        return scheduled, None

    def _take_sampled(self, request: Request, sampled: list[int], logprobs: list[Logprobs] | None,
                      outputs: EngineCoreOutputs, position: int) -> bool:
        """update_from_output for a request whose record is kept whole; its token goes to
        `position` (appended, or in a placeholder's place). Returns whether it finished."""
        params = request.sampling_params
        if params.n > 1 and not request.num_output_tokens:
            self._fork(request, sampled, logprobs, outputs)
            sampled = sampled[:1]
            logprobs = logprobs[:1] if logprobs else logprobs
        elif len(sampled) != 1:
            raise ValueError(f"request {request.request_id!r}: expected one sampled token, "
                             f"got {len(sampled)}")
        token = sampled[0]
        constraint = request.constraint
        if constraint is not None and not constraint.accept(token):
            # The grammar allows no token here (or the row sampled outside its mask): end it
            # without the token, never emit an unconstrained one.
            self._finish(request, FinishReason.ABORT, DEAD_END, self._finished_req_ids)
            outputs.append(request_output(request, [], None))
            return True
        tokens = request.all_token_ids
        if position == len(tokens):
            tokens.append(token)
        else:
            tokens[position] = token
        request.whole_records = (request.sample_index != 0 or params.logprobs is not None
                                 or constraint is not None)
        reason, stop_reason = check_stop(request, token, self.config.max_model_len)
        if reason is None and constraint is not None and constraint.is_terminated():
            reason, stop_reason = FinishReason.STOP, token  # the grammar's stop token (ignore_eos)
        if reason is not None:
            self._finish(request, reason, stop_reason, self._finished_req_ids)
        outputs.append(request_output(request, [token], logprobs))
        return reason is not None

    def _fork(self, parent: Request, sampled: list[int], logprobs: list[Logprobs] | None,
              outputs: EngineCoreOutputs) -> None:
        """The group's prompt is done and the worker sampled one token per sample: the parent
        keeps token 0, samples 1..n-1 become requests of their own sharing its blocks. They go
        just before the parent in running, so they are scheduled (and copy the shared partial
        block) first and the parent usually writes into it in place. Samples beyond
        max_num_seqs, or that a copying manager has no room for, wait and recompute."""
        n = parent.sampling_params.n
        if len(sampled) != n:
            raise ValueError(f"request {parent.request_id!r} with n={n} got {len(sampled)} samples")
        kv = self.kv_cache_manager
        forked: list[Request] = []
        for i in range(1, n):
            child = new_sample(parent, i, sampled[i], self.config.max_model_len)
            # A dead end on its first token ends it without the token (parallel_sampling.py).
            first = [sampled[i]] if child.num_output_tokens else []
            outputs.append(request_output(child, first, [logprobs[i]] if logprobs and first else None))
            if child.status is RequestStatus.FINISHED:
                continue
            self.requests[child.request_id] = child
            self._groups[parent.group_id].add(child.request_id)
            if len(self.running) + len(forked) < self.config.max_num_seqs:
                child.num_computed_tokens = parent.num_computed_tokens
                try:
                    kv.fork(parent, child)
                except NoFreeBlocksError:
                    child.num_computed_tokens = 0
                else:
                    child.status = _RUNNING
                    self._num_slots[child.request_id] = -1
                    forked.append(child)
                    continue
            self.waiting.add_preempted(child)
        if forked:
            self._num_slots[parent.request_id] = -1  # its last block may now be shared
            at = self.running.index(parent)
            self.running[at:at] = forked

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
            if request.status is _RUNNING:
                dropped.add(request.request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT, None, self._finished_req_ids)
            outputs.extend(end_records(request))
        if dropped:
            self.running = [r for r in self.running if r.request_id not in dropped]
        return outputs

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None,
                dropped_ids: set[str]) -> None:
        """End the request: free its blocks, forget it, and add its id to dropped_ids if the
        workers hold it (the caller takes it out of running or waiting)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache_manager.free(request)
        request_id = request.request_id
        del self.requests[request_id]
        self._num_slots.pop(request_id, None)
        group = self._groups[request.group_id]
        group.discard(request_id)
        if not group:
            del self._groups[request.group_id]
        if request_id in self._on_workers:
            self._on_workers.discard(request_id)
            dropped_ids.add(request_id)
