"""Continuous-batching scheduler: which requests compute which tokens each step.

Each step, schedule() gives every running request its next prefill chunk or one decode token,
then admits waiting requests (prefix-cache hits first taken, then their first chunk), within the
token budget (max_num_batched_tokens) and max_num_seqs. When a running request cannot get a
block, the newest (fcfs) or lowest-priority running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, to be prefilled again later (prompt
and outputs so far, with prefix-cache hits). The result is a SchedulerOutput, the diff the workers
apply (see outputs.py). update_from_output() takes the sampled tokens, checks stop conditions,
forks n > 1 requests once their prompt is done, and frees finished requests' blocks at once.

Who the workers hold: every request that went out as NewRequestData and has not been dropped since
(finished_req_ids / preempted_req_ids). A running request the workers do not hold (a sample just
forked, or one whose block table copy-on-write changed) goes out whole as NewRequestData, a held
one as a CachedRequestData entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

from raypaged.core.admission import check_new_request
from raypaged.core.errors import NoFreeBlocksError, UnknownRequestError
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.kv_cache_manager import KVCacheManager, KVCacheStats
from raypaged.core.outputs import (EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)
from raypaged.core.request import FinishReason, Request, RequestStatus
from raypaged.core.request_queue import make_request_queue
from raypaged.core.scheduler_config import SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING = RequestStatus.RUNNING
_STOP = FinishReason.STOP
_LENGTH = FinishReason.LENGTH


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # since the scheduler started
    kv_cache: KVCacheStats


class Scheduler:
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
        self._pending_outputs: list[EngineCoreOutput] = []  # finished inside schedule()
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
        request_id = request.request_id
        self.requests[request_id] = request
        self._groups.setdefault(request.group_id, set()).add(request_id)
        self.waiting.add(request)

    def abort_requests(self, group_or_request_ids: str | list[str]) -> list[EngineCoreOutput]:
        """Abort requests in any state. A group id aborts every sample of the group; a sample id
        (f"{group}#{i}", i >= 0) that one. UnknownRequestError, before anything changes, for an id that
        names no unfinished request or group."""
        ids = [group_or_request_ids] if isinstance(group_or_request_ids, str) else list(group_or_request_ids)
        targets: dict[str, Request] = {}
        for id_ in ids:
            members = self._groups.get(id_)
            if members is not None:
                targets.update((rid, self.requests[rid]) for rid in sorted(members))
            elif id_ in self.requests:
                targets[id_] = self.requests[id_]
            elif id_.endswith("#0") and id_[:-2] in self.requests:
                # Sample 0 alone: its request id is the group id, which names the whole group.
                targets[id_[:-2]] = self.requests[id_[:-2]]
            else:
                raise UnknownRequestError(f"no unfinished request or group {id_!r}")
        outputs = []
        dropped = set()
        for request in targets.values():
            if request.status is _RUNNING:
                dropped.add(request.request_id)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT, None, self._finished_req_ids)
            outputs.append(self._output(request, [], None))
        if dropped:
            self.running = [r for r in self.running if r.request_id not in dropped]
        return outputs

    def has_unfinished_requests(self) -> bool:
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
        config = self.config
        kv = self.kv_cache_manager
        out = SchedulerOutput()
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        num_scheduled = out.num_scheduled_tokens
        # The scheduled requests in num_scheduled's order: update_from_output walks them directly.
        scheduled = self._scheduled = []
        cached = out.scheduled_cached_reqs
        cached_ids, cached_tokens = cached.req_ids, cached.new_token_ids
        cached_blocks, cached_computed = cached.new_block_ids, cached.num_computed_tokens
        budget = config.max_num_batched_tokens
        chunked = config.enable_chunked_prefill
        allocate = kv.allocate_slots
        on_workers, rewritten = self._on_workers, self._rewritten
        running = self.running

        # Running requests first, in order: the oldest keep their place under memory pressure.
        num_slots = self._num_slots
        block_size = config.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            request_id = request.request_id
            computed = request.num_computed_tokens
            tokens = request.all_token_ids
            num_new = len(tokens) - computed
            if num_new > budget:
                if not chunked:
                    i += 1
                    continue
                num_new = budget
            if computed + num_new <= num_slots[request_id]:
                # The common decode step: its table has room, so the manager would hand out
                # nothing; and the workers hold it (anything else forces the slow path).
                num_scheduled[request_id] = num_new
                scheduled.append(request)
                budget -= num_new
                cached_ids.append(request_id)
                cached_tokens.append(tokens[computed:computed + num_new])
                cached_blocks.append([])
                cached_computed.append(computed)
                i += 1
                continue
            new_blocks = allocate(request, num_new)
            while new_blocks is None:  # out of blocks: preempt until it fits or it is the victim
                if not kv.can_fit(len(tokens)):
                    running.pop(i)
                    self._finish_unfittable(request, out)
                    break
                victim_index = self._pick_victim()
                victim = running[victim_index]
                budget += self._preempt(victim_index, out)
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
                new_blocks = allocate(request, num_new)
            if new_blocks is None:
                continue  # it left running: running[i] is already the next request
            if num_slots[request_id] < 0:  # forced through the manager after a fork
                num_slots[request_id] = len(kv.get_block_ids(request_id)) * block_size
            else:
                num_slots[request_id] += len(new_blocks) * block_size
            num_scheduled[request_id] = num_new
            scheduled.append(request)
            budget -= num_new
            if request_id in on_workers and not (rewritten and request_id in rewritten):
                cached_ids.append(request_id)
                cached_tokens.append(tokens[computed:computed + num_new])
                cached_blocks.append(new_blocks)
                cached_computed.append(computed)
            else:
                self._send_new(request, kv.get_block_ids(request_id), out)
            i += 1

        # Then waiting requests, in queue order; in fcfs they never preempt running ones.
        waiting = self.waiting
        while len(waiting) and budget > 0:
            request = waiting.peek()
            if len(running) >= config.max_num_seqs:
                if self._priority and self._outranks_a_running_request(request):
                    budget += self._preempt(self._pick_victim(), out)
                    continue
                break
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = len(request.all_token_ids) - num_hit_tokens
            if num_new > budget:
                if not chunked:
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
            if request.status is RequestStatus.WAITING and not request.output_token_ids:
                request.num_cached_tokens = num_hit_tokens  # first schedule of a fresh request
            request.status = _RUNNING
            request.num_computed_tokens = num_hit_tokens
            running.append(request)
            num_slots[request.request_id] = len(new_blocks) * block_size
            num_scheduled[request.request_id] = num_new
            scheduled.append(request)
            budget -= num_new
            self._send_new(request, new_blocks, out)

        out.total_num_scheduled_tokens = config.max_num_batched_tokens - budget
        out.block_copies = kv.take_block_copies()
        self._last_output = out
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Take one step's sampled tokens. Returns one EngineCoreOutput per request that got a
        token or finished (plus any finished inside schedule())."""
        outputs, self._pending_outputs = self._pending_outputs, []
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = model_runner_output.req_ids
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        if len(sampled_token_ids) != len(req_ids) or (logprobs and len(logprobs) != len(req_ids)):
            raise ValueError("the model runner's output lists differ in length")
        if scheduler_output is self._last_output and req_ids == list(num_scheduled):
            in_order, nums = self._scheduled, num_scheduled.values()  # the usual case: as scheduled
        elif len(req_ids) == len(num_scheduled) and num_scheduled.keys() == set(req_ids):
            in_order = [self.requests.get(request_id) for request_id in req_ids]
            nums = [num_scheduled[request_id] for request_id in req_ids]
        else:
            raise ValueError("the model runner's output does not answer the scheduled requests")
        self._last_output = None
        cache_blocks = self._cache_blocks
        block_size = self.config.block_size
        max_model_len = self.config.max_model_len
        finished = False
        for request, request_id, num_new, sampled, new_logprobs in zip(
                in_order, req_ids, nums, sampled_token_ids, logprobs or repeat(None)):
            if request is None or request.status is not _RUNNING:
                continue  # aborted while the step ran
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            if computed % block_size < num_new and cache_blocks is not None:
                cache_blocks(request, computed)  # the step filled a block: into the prefix cache
            tokens = request.all_token_ids
            if computed != len(tokens):
                if sampled:
                    raise ValueError(f"request {request_id!r} sampled a token mid-prompt")
                continue
            params = request.sampling_params
            if len(sampled) != 1 or params.n > 1:
                if params.n > 1 and not request.output_token_ids:
                    self._fork(request, sampled, new_logprobs, outputs)
                    new_logprobs = new_logprobs[:1] if new_logprobs else new_logprobs
                elif len(sampled) != 1:
                    raise ValueError(f"request {request_id!r}: expected one sampled token, "
                                     f"got {len(sampled)}")
            token = sampled[0]
            outputs_so_far = request.output_token_ids
            outputs_so_far.append(token)
            tokens.append(token)
            # _check_stop, unrolled: this loop runs for every request every step.
            reason = stop_reason = None
            if token == request.eos_token_id or token in params.stop_token_ids:
                reason, stop_reason = self._stop_on_token(request, token)
            if reason is None and (len(outputs_so_far) >= params.max_tokens or len(tokens) >= max_model_len):
                reason = _LENGTH
            if reason is not None:
                self._finish(request, reason, stop_reason, self._finished_req_ids)
                finished = True
            outputs.append(EngineCoreOutput(request_id, request.group_id, request.sample_index, [token],
                                            new_logprobs, reason, stop_reason, len(request.prompt_token_ids),
                                            request.num_cached_tokens))
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

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
        self._pending_outputs.append(self._output(request, [], None))

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None,
                dropped_ids: set[str]) -> None:
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

    def _output(self, request: Request, token_ids: list[int], logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(request.request_id, request.group_id, request.sample_index, token_ids,
                                logprobs, request.finish_reason, request.stop_reason,
                                request.num_prompt_tokens, request.num_cached_tokens)

    def _fork(self, parent: Request, sampled: list[int], logprobs, outputs: list[EngineCoreOutput]) -> None:
        """The group's prompt is done and the worker sampled one token per sample: the parent
        keeps token 0, samples 1..n-1 become requests of their own sharing its blocks. They go
        just before the parent in running, so they are scheduled (and copy the shared partial
        block) first and the parent usually writes into it in place."""
        n = parent.sampling_params.n
        if len(sampled) != n:
            raise ValueError(f"request {parent.request_id!r} with n={n} got {len(sampled)} samples")
        kv = self.kv_cache_manager
        group_id = parent.group_id
        forked = []
        for i in range(1, n):
            child = Request(
                request_id=f"{group_id}#{i}", prompt_token_ids=parent.prompt_token_ids,
                sampling_params=parent.sampling_params.for_sample(i), eos_token_id=parent.eos_token_id,
                arrival_time=parent.arrival_time, priority=parent.priority, cache_salt=parent.cache_salt,
                group_id=group_id, sample_index=i)
            child.num_cached_tokens = parent.num_cached_tokens
            child.append_output_token(sampled[i])
            child_logprobs = [logprobs[i]] if logprobs else None
            reason, stop_reason = self._check_stop(child, sampled[i])
            if reason is not None:  # done at once: it never needs blocks of its own
                child.status, child.finish_reason, child.stop_reason = RequestStatus.FINISHED, reason, stop_reason
                outputs.append(self._output(child, [sampled[i]], child_logprobs))
                continue
            self.requests[child.request_id] = child
            self._groups[group_id].add(child.request_id)
            outputs.append(self._output(child, [sampled[i]], child_logprobs))
            if len(self.running) + len(forked) < self.config.max_num_seqs:
                child.num_computed_tokens = parent.num_computed_tokens
                try:
                    kv.fork(parent, child)
                except NoFreeBlocksError:  # a manager that copies instead of sharing
                    child.num_computed_tokens = 0
                else:
                    child.status = _RUNNING
                    self._num_slots[child.request_id] = -1
                    forked.append(child)
                    continue
            self.waiting.add_preempted(child)  # no room in the batch: it recomputes later
        if forked:
            self._num_slots[parent.request_id] = -1  # its last block may now be shared
            at = self.running.index(parent)
            self.running[at:at] = forked

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        """After `token` was appended: does the request stop, and why."""
        params = request.sampling_params
        if token == request.eos_token_id or token in params.stop_token_ids:
            reason, stop_reason = self._stop_on_token(request, token)
            if reason is not None:
                return reason, stop_reason
        if len(request.output_token_ids) >= params.max_tokens \
                or len(request.all_token_ids) >= self.config.max_model_len:
            return _LENGTH, None
        return None, None

    @staticmethod
    def _stop_on_token(request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        """`token` is EOS or a stop id: it stops the request unless min_tokens are not out yet
        (or it is EOS and EOS is ignored). EOS reports no stop_reason; a stop id reports itself."""
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens:
            return None, None
        if token == request.eos_token_id and not params.ignore_eos:
            return _STOP, None
        if token in params.stop_token_ids:
            return _STOP, token
        return None, None
