"""Prompt logprobs on the worker: score the prompt positions a step's prefill chunks compute.

The logits at position j predict token j + 1, so a chunk covering positions [start, start + n)
of a prompt of P tokens scores prompt tokens start + 1 .. min(start + n, P - 1). Each chunk
contributes its own positions; the scheduler stitches them together (core/prompt_logprobs.py).
Only requests that asked and still hold only their prompt are scored: one recomputing after a
preemption with outputs already sent them.

Every rank computes the logits (under tensor parallelism compute_logits gathers the vocabulary
shards: a collective all ranks join); rank 0 takes them to the host. The logits are those of the
raw model output, [chunk tokens, V] in float32 for the step: a request with prompt logprobs
costs a full-vocabulary LM head over its prompt, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from raypaged.core.outputs import Logprobs

if TYPE_CHECKING:
    from raypaged.worker.model_runner import CachedRequestState


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
    device = hidden.device
    logits = model.compute_logits(hidden[torch.tensor(rows, device=device)])
    if not is_driver:
        return {}
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_t = torch.tensor(targets, dtype=torch.int64, device=device).unsqueeze(1)
    target_lp = logprobs.gather(1, target_t).squeeze(1).tolist()
    k = max(int(state.sampling_params.prompt_logprobs or 0) for state, _, _ in spans)
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k:
        values, ids = torch.topk(logprobs, k, dim=-1)
        top_lp, top_ids = values.tolist(), ids.tolist()
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
