"""Asynchronous scheduling, the worker's side: a step whose sampled tokens are on their way.

The ModelRunner answers each step one call late (see model_runner.py). Between the two calls an
InFlightTokens holds what the step sampled: the tokens on the device (the next step's placeholder
inputs are taken from them), their copy to the host (an event marks it done, so the wait covers
that step alone, not the forward queued after it), and rank 0's answer, which gets the tokens once
they are on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from raypaged.core.outputs import ModelRunnerOutput
from raypaged.core.request import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from raypaged.worker.request_state import CachedRequestState


@dataclass
class SampledStep:
    row_states: list[CachedRequestState]
    token_ids: torch.Tensor  # [rows] on the device
    host_token_ids: torch.Tensor  # [rows] on the host once `ready` has passed
    ready: torch.cuda.Event | None  # None on the CPU
    # request id -> (its first sampled row, the position that row's token takes in its tokens)
    rows: dict[str, tuple[int, int]]
    result: ModelRunnerOutput | None  # rank 0's answer, tokens added once they are on the host
    logprobs: list | None  # per row (rows that asked for them), already on the host


class InFlightTokens:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._step: SampledStep | None = None
        self._pinned: torch.Tensor | None = None  # the host buffer of its tokens (CUDA)

    def clear(self) -> None:
        self._step = None

    def keep(self, row_states: list[CachedRequestState], token_ids: torch.Tensor,
             result: ModelRunnerOutput | None, logprobs: list | None) -> None:
        """Start a step's tokens (one per sampled row) on their way to the host."""
        ready = None
        host = token_ids
        if token_ids.is_cuda:
            n = token_ids.shape[0]
            if self._pinned is None or self._pinned.shape[0] < n:
                self._pinned = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
            host = self._pinned[:n]
            host.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        rows: dict[str, tuple[int, int]] = {}
        for row, state in enumerate(row_states):
            if state.req_id not in rows:  # n > 1: sample 0 continues the request
                rows[state.req_id] = (row, len(state.token_ids))
        self._step = SampledStep(row_states, token_ids, host, ready, rows, result, logprobs)

    def fill_placeholders(self, input_ids: torch.Tensor,
                          placeholders: list[tuple[int, str]]) -> None:
        """input_ids[index] = the token the kept step sampled for the request, on the device, for
        each (index, request id); the scheduler sends a placeholder only for such a token."""
        step = self._step
        if step is None:
            raise RuntimeError("a placeholder input, but no step before it sampled")
        try:
            src = [step.rows[req_id][0] for _, req_id in placeholders]
        except KeyError as e:
            raise RuntimeError(f"a placeholder input for {e}, which the previous step did not "
                               "sample for") from None
        dst = [index for index, _ in placeholders]
        input_ids[self._index(dst)] = step.token_ids[self._index(src)]

    def take(self, requests: dict[str, CachedRequestState]) -> ModelRunnerOutput | None:
        """The kept step's answer (None if no step is kept, or on ranks > 0), once its tokens are
        on the host; they also replace the placeholders in the requests' token histories."""
        step, self._step = self._step, None
        if step is None:
            return None
        if step.ready is not None:
            step.ready.synchronize()
        token_ids = step.host_token_ids.tolist()
        for req_id, (row, position) in step.rows.items():
            state = requests.get(req_id)  # by id: it may have been dropped or sent anew since
            if state is not None and position < len(state.token_ids) \
                    and state.token_ids[position] == PLACEHOLDER_TOKEN_ID:
                state.token_ids[position] = token_ids[row]
        if step.result is not None:
            add_sampled_tokens(step.result, step.row_states, token_ids, step.logprobs)
        return step.result

    def _index(self, values: list[int]) -> torch.Tensor:
        tensor = torch.from_numpy(np.array(values, dtype=np.int64))
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)


def add_sampled_tokens(result: ModelRunnerOutput, row_states: list[CachedRequestState],
                       token_ids: list[int], row_logprobs: list | None) -> None:
    """Append each sampled row's token (and logprobs, where asked) to its request's entry."""
    position = {req_id: i for i, req_id in enumerate(result.req_ids)}
    for row, state in enumerate(row_states):
        i = position[state.req_id]
        result.sampled_token_ids[i].append(token_ids[row])
        if row_logprobs is not None and state.sampling_params.logprobs is not None:
            entry = result.logprobs[i]
            if entry is None:
                entry = result.logprobs[i] = []
            entry.append(row_logprobs[row])
