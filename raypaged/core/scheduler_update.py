"""The Scheduler's other half: update_from_output() takes one step's sampled tokens.

For every request the step answered it advances the computed tokens (registering a block that
filled into the prefix cache), appends the token, checks stop conditions, and returns the step's
records as one EngineCoreOutputs batch: a plain record (the request's next token) costs two list
entries, and only the rare ones (a first token, a finish, a sample, logprobs) are built whole.
An n > 1 request forks here once its prompt is done; a finished request's blocks are freed at once.
Aborts (abort_requests) finish requests through the same path.

Asynchronous scheduling (SchedulerConfig.async_scheduling): the engine plans step N+1 while the
workers run step N, and hands step N's tokens to update_from_output after that. So schedule()
counts its tokens as computed as it schedules them (_advance), and each request the step will sample for gets a
PLACEHOLDER_TOKEN_ID as its next token, which step N+1 may already schedule (the workers put the
sampled token in its place). A request whose next token may end it for length, or that forks
(n > 1) on it, gets no placeholder: it sits out step N+1. A stop token ends a request one step
late: the token step N+1 computed for it is dropped.

Split from scheduler.py for size: SchedulerUpdate holds no state of its own; Scheduler (which
derives from it) sets up the attributes annotated below.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from types import SimpleNamespace
from typing import Callable

from raypaged.core.errors import NoFreeBlocksError, UnknownRequestError
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.outputs import EngineCoreOutput, EngineCoreOutputs, Logprobs, ModelRunnerOutput, SchedulerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request, RequestStatus
from raypaged.core.request_queue import RequestQueue
from raypaged.core.scheduler_config import SchedulerConfig
from raypaged.core.stop_checks import check_stop, prepare_stop_checks

_RUNNING = RequestStatus.RUNNING
# What update_from_output finds for a runner's request id the scheduler no longer holds (aborted
# while the step ran): anything not running is skipped, so one check serves both cases.
_GONE = SimpleNamespace(status=RequestStatus.FINISHED)


class SchedulerUpdate:
    """update_from_output, the n > 1 fork, aborts and finishing a request (base class of
    Scheduler)."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManagerInterface
    waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    _groups: dict[str, set[str]]
    _on_workers: set[str]
    _finished_req_ids: set[str]
    _pending_outputs: EngineCoreOutputs
    _num_slots: dict[str, int]
    _last_output: SchedulerOutput | None
    _scheduled: list[Request]
    _cache_blocks: Callable[[Request, int], None] | None
    _in_flight: deque[tuple[SchedulerOutput, list[Request], list[int]]]
    _held_back: set[str]

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Take one step's sampled tokens. Returns a record for each request that got a token or
        finished (after any that finished inside schedule()).

        One step at a time, the step's tokens count as computed here. With asynchronous
        scheduling the step answered is the oldest in flight: schedule() already counted its
        tokens (`ends`: where each request's tokens ended) and put a placeholder where each
        sampled token goes; the token replaces it (or is appended, where none was made)."""
        outputs, self._pending_outputs = self._pending_outputs, EngineCoreOutputs()
        num_scheduled = scheduler_output.num_scheduled_tokens
        ends: list[int] | None = None
        if self.config.async_scheduling:
            if not self._in_flight or self._in_flight[0][0] is not scheduler_output:
                raise ValueError("update_from_output must answer the oldest step in flight")
            _, scheduled, ends = self._in_flight.popleft()
            self._held_back.clear()  # what schedule() preempted meanwhile has had its answer now
        elif scheduler_output is self._last_output:
            scheduled = self._scheduled  # the usual case: the step just scheduled
        else:
            scheduled = [self.requests.get(request_id, _GONE) for request_id in num_scheduled]
        self._last_output = None
        sampled_token_ids, logprobs = _in_scheduled_order(num_scheduled, model_runner_output)
        cache_blocks = self._cache_blocks
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
            if end % block_size < num_new and cache_blocks is not None:
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
                    outputs.append(self._output(request, sampled, None))
                    continue
            # The plain record: the request's next token and nothing else.
            ids_append(request.request_id)
            tokens_append(sampled)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _advance(self, request: Request, end: int) -> None:
        """Asynchronous scheduling, as schedule() takes a request: its tokens up to `end` count as
        computed now, and if the step samples for it, a placeholder is its next token (see the
        module docstring). Called after the step's diff for it is built: the workers get the
        tokens before the placeholder. The tight decode loop in schedule() does this inline."""
        request.num_computed_tokens = end
        tokens = request.all_token_ids
        if end == len(tokens) and end < request.max_num_tokens - 1 and (
                request.sampling_params.n == 1 or end > len(request.prompt_token_ids)):
            tokens.append(PLACEHOLDER_TOKEN_ID)

    def take_pending_outputs(self) -> EngineCoreOutputs:
        """Records made inside schedule() (requests that outgrew the cache) when no step's
        answer will carry them: asynchronous scheduling with nothing in flight."""
        outputs, self._pending_outputs = self._pending_outputs, EngineCoreOutputs()
        return outputs

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
        tokens = request.all_token_ids
        if position == len(tokens):
            tokens.append(token)
        else:
            tokens[position] = token
        request.whole_records = request.sample_index != 0 or params.logprobs is not None
        reason, stop_reason = check_stop(request, token, self.config.max_model_len)
        if reason is not None:
            self._finish(request, reason, stop_reason, self._finished_req_ids)
        outputs.append(self._output(request, [token], logprobs))
        return reason is not None

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
            outputs.extend(self._end_records(request))
        if dropped:
            self.running = [r for r in self.running if r.request_id not in dropped]
        return outputs

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None,
                dropped_ids: set[str]) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        tokens = request.all_token_ids
        while tokens and tokens[-1] == PLACEHOLDER_TOKEN_ID:  # its next tokens, never to come
            tokens.pop()
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

    def _end_records(self, request: Request) -> list[EngineCoreOutput]:
        """The records of a request finished without a token (aborted, failed, or outgrown the
        cache): its own, and for an n > 1 parent that has not forked yet one per sample it now
        never will, with the same reason.

        The contract every consumer counts on: each sample index 0..n-1 of a group gets exactly
        one finishing record, whatever the moment the group ends (waiting, mid-prefill, with
        its forking step in flight). A parent forks on its first token, so one with none has
        no samples of its own yet."""
        records = [self._output(request, [], None)]
        n = request.sampling_params.n
        if n > 1 and request.sample_index == 0 and not request.num_output_tokens:
            for i in range(1, n):
                records.append(EngineCoreOutput(
                    f"{request.group_id}#{i}", request.group_id, i, [], None, request.finish_reason,
                    None, request.num_prompt_tokens, request.num_cached_tokens))
        return records

    def _output(self, request: Request, token_ids: list[int], logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(request.request_id, request.group_id, request.sample_index, token_ids,
                                logprobs, request.finish_reason, request.stop_reason,
                                request.num_prompt_tokens, request.num_cached_tokens)

    def _fork(self, parent: Request, sampled: list[int], logprobs: list[Logprobs] | None,
              outputs: EngineCoreOutputs) -> None:
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
            prepare_stop_checks(child, self.config.max_model_len)
            child.num_cached_tokens = parent.num_cached_tokens
            child.append_output_token(sampled[i])
            child_logprobs = [logprobs[i]] if logprobs else None
            reason, stop_reason = check_stop(child, sampled[i], self.config.max_model_len)
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


def _in_scheduled_order(num_scheduled: dict[str, int], output: ModelRunnerOutput
                        ) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
    """The runner's sampled tokens and logprobs in the step's scheduled order (a runner may
    answer in its own order: decodes first)."""
    req_ids, sampled, logprobs = output.req_ids, output.sampled_token_ids, output.logprobs
    if len(sampled) != len(req_ids) or (logprobs and len(logprobs) != len(req_ids)):
        raise ValueError("the model runner's output lists differ in length")
    if req_ids == list(num_scheduled):
        return sampled, logprobs
    if len(req_ids) != len(num_scheduled) or num_scheduled.keys() != set(req_ids):
        raise ValueError("the model runner's output does not answer the scheduled requests")
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    order = [index[req_id] for req_id in num_scheduled]
    return [sampled[i] for i in order], [logprobs[i] for i in order] if logprobs else logprobs
