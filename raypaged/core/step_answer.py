"""A step's answer: update_from_output() takes the step's sampled tokens.

It advances the computed tokens (registering a block that filled in the prefix cache), appends
each token, checks stop conditions (stop_checks.py), forks an n > 1 request once its prompt is
done (forking.py), frees finished requests' blocks at once, and returns the step's records as one
EngineCoreOutputs batch: a plain record (the request's next token) costs two list entries; only
the rare ones (a first token, a finish, a sample, logprobs) are built whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from types import SimpleNamespace
from typing import cast

from raypaged.core.forking import Forking
from raypaged.core.outputs import (
    EngineCoreOutputs,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
    in_scheduled_order,
    request_output,
)
from raypaged.core.prompt_logprobs import take_prompt_logprobs
from raypaged.core.request import PLACEHOLDER_TOKEN_ID, FinishReason, Request, RequestStatus
from raypaged.core.stop_checks import check_stop
from raypaged.core.structured_output import DEAD_END

__all__ = ["StepAnswer"]

_RUNNING = RequestStatus.RUNNING
# What update_from_output finds for a runner's request id the scheduler no longer holds (aborted
# while the step ran): anything not running is skipped, so one check serves both cases.
_GONE = cast(Request, SimpleNamespace(status=RequestStatus.FINISHED))  # read for its status only


class StepAnswer(Forking):
    """The scheduler's part that takes each step's answer: update_from_output() and the hook
    _take_answered."""

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
