"""Prompt logprobs on the worker: score the prompt positions a step's prefill chunks compute.

The logits at position j predict token j + 1, so a chunk covering positions [start, start + n)
of a prompt of P tokens scores prompt tokens start + 1 .. min(start + n, P - 1). Each chunk
contributes its own positions; the scheduler stitches them together (core/prompt_logprobs.py).
Only requests that asked and still hold only their prompt are scored: one recomputing after a
preemption with outputs already sent them.

Every rank computes the logits (under tensor parallelism compute_logits gathers the vocabulary
shards: a collective all ranks join); rank 0 takes them to the host. The logits are those of the
raw model output, in float32, SCORE_ROWS positions at a time: a request with prompt logprobs
costs a full-vocabulary LM head over its prompt, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from raypaged.core.outputs import Logprobs

if TYPE_CHECKING:
    from raypaged.worker.request_state import CachedRequestState


SCORE_ROWS = 1024  # prompt positions scored at once: 1024 x 128k float32 logits is 0.5 GiB


class _ComputesLogits(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def wants_prompt_logprobs(state: CachedRequestState) -> bool:
    return (state.sampling_params.prompt_logprobs is not None
            and len(state.token_ids) == state.num_prompt_tokens)


def score_prompts(model: _ComputesLogits, hidden: torch.Tensor, states: Sequence[CachedRequestState],
                  counts: Sequence[int], is_driver: bool) -> dict[str, tuple[int, list[Logprobs]]]:
    """By request id: (first prompt token scored, one {token: logprob, top-k…} per token) for
    the step whose requests are `states` with `counts` tokens each, in the order of `hidden`'s
    rows. Empty where nobody asked; non-driver ranks join the collective and return {}."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[CachedRequestState, int, int]] = []  # (state, first token, how many)
    cursor = 0
    for state, n in zip(states, counts):
        if wants_prompt_logprobs(state):
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)  # the last position scores nothing
            if end > start:
                rows.extend(range(cursor, cursor + end - start))
                targets.extend(state.token_ids[start + 1 : end + 1])
                spans.append((state, start + 1, end - start))
        cursor += n
    if not spans:
        return {}
    k = max(int(state.sampling_params.prompt_logprobs or 0) for state, _, _ in spans)
    target_lp: list[float] = []
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    device = hidden.device
    # Slices of rows bound the [rows, V] float32 temporaries whatever the chunk size.
    for begin in range(0, len(rows), SCORE_ROWS):
        index = torch.tensor(rows[begin : begin + SCORE_ROWS], device=device)
        logits = model.compute_logits(hidden[index])
        if not is_driver:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target_t = torch.tensor(targets[begin : begin + SCORE_ROWS], dtype=torch.int64, device=device)
        target_lp.extend(logprobs.gather(1, target_t.unsqueeze(1)).squeeze(1).tolist())
        if k:
            values, ids = torch.topk(logprobs, k, dim=-1)
            top_lp.extend(values.tolist())
            top_ids.extend(ids.tolist())
        else:
            top_lp.extend([] for _ in range(len(index)))
            top_ids.extend([] for _ in range(len(index)))
    if not is_driver:
        return {}
    answer: dict[str, tuple[int, list[Logprobs]]] = {}
    at = 0
    for state, first, count in spans:
        own_k = int(state.sampling_params.prompt_logprobs or 0)
        entries: list[Logprobs] = []
        for i in range(at, at + count):
            entry = dict(zip(top_ids[i][:own_k], top_lp[i][:own_k]))
            entry[targets[i]] = target_lp[i]
            entries.append(entry)
        answer[state.req_id] = (first, entries)
        at += count
    return answer
