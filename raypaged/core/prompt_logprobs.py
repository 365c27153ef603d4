"""Prompt logprobs (SamplingParams.prompt_logprobs): gathered chunk by chunk, sent once.

The worker scores the prompt positions each prefill chunk computes and answers them in
ModelRunnerOutput.prompt_logprobs as (index of the first prompt token scored, one Logprobs per
token). The scheduler appends them to the request in prompt order; a chunk answered again (the
request was preempted and recomputed) adds nothing new. The first record of each sample carries
the whole list, once (a forked sample inherits its parent's, complete by the fork).

A request still waiting for some of its prompt to be scored takes no prefix-cache hit (as vLLM
v1 does): the hit's positions would never be computed, so they could not be scored.
"""

from __future__ import annotations

from raypaged.core.outputs import Logprobs
from raypaged.core.request import Request


def take_prompt_logprobs(requests: dict[str, Request],
                         answered: dict[str, tuple[int, list[Logprobs]]]) -> None:
    """Append each answered chunk's entries to its request (requests: live, by id)."""
    for req_id, (first, entries) in answered.items():
        request = requests.get(req_id)
        if request is None or request.prompt_logprobs is None:
            continue
        scored = request.prompt_logprobs
        # scored[i] is prompt token i + 1; the chunk's entries start at prompt token `first`.
        offset = len(scored) - (first - 1)
        if 0 <= offset < len(entries):
            scored.extend(entries[offset:])

