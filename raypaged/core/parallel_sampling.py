"""n > 1: one prefill for the group, then one request per sample.

A request with SamplingParams.n = n is scheduled alone until its prompt is computed; the step
that completes it samples n tokens. Token 0 stays with the request (sample 0, whose id is the
group id); each token i > 0 starts sample i, a request of its own (id "group#i", built by
core/sample_ids.py) that shares the parent's K/V. The scheduler decides where each new sample
runs (forking.py); this module only builds them.
"""

from __future__ import annotations

from raypaged.core.errors import UnknownRequestError
from raypaged.core.outputs import EngineCoreOutput, request_output
from raypaged.core.request import FinishReason, Request, RequestStatus
from raypaged.core.sample_ids import parse_sample_id, sample_request_id
from raypaged.core.stop_checks import check_stop, prepare_stop_checks
from raypaged.core.structured_output import DEAD_END


def requests_named(ids: list[str], requests: dict[str, Request],
                   groups: dict[str, set[str]]) -> dict[str, Request]:
    """The unfinished requests the ids name, by request id: a group id names every sample of
    the group, a sample id ("group#i", i >= 0: core/sample_ids.py) that one. UnknownRequestError for an id that
    names no unfinished request or group (requests: live by id; groups: group id -> ids)."""
    targets: dict[str, Request] = {}
    for id_ in ids:
        members = groups.get(id_)
        if members is not None:
            targets.update((rid, requests[rid]) for rid in sorted(members))
        elif id_ in requests:
            targets[id_] = requests[id_]
        else:
            # Sample 0 alone ("group#0"): its request id is the group id, which names the whole
            # group.
            group_id, index = parse_sample_id(id_)
            if index != 0 or group_id not in requests:
                raise UnknownRequestError(f"no unfinished request or group {id_!r}")
            targets[group_id] = requests[group_id]
    return targets


def new_sample(parent: Request, index: int, token: int, max_model_len: int) -> Request:
    """Sample `index` (> 0) of the parent's group with its first token appended, holding no
    blocks and nothing computed yet. If that token already stops it, it is returned FINISHED
    (with its finish reason): it never needs blocks of its own. A constrained parent (which
    has accepted no output token yet) gives the child a fork of its grammar state; a token that
    grammar rejects finishes the child (abort, DEAD_END) without the token."""
    group_id = parent.group_id
    child = Request(
        request_id=sample_request_id(group_id, index), prompt_token_ids=parent.prompt_token_ids,
        sampling_params=parent.sampling_params.for_sample(index), eos_token_id=parent.eos_token_id,
        arrival_time=parent.arrival_time, priority=parent.priority, cache_salt=parent.cache_salt,
        group_id=group_id, sample_index=index)
    prepare_stop_checks(child, max_model_len)
    child.num_cached_tokens = parent.num_cached_tokens
    if parent.prompt_logprobs is not None:  # complete: the fork follows the prompt's last chunk
        child.prompt_logprobs, child.prompt_logprobs_sent = parent.prompt_logprobs, False
    if parent.constraint is not None:
        child.constraint = parent.constraint.fork()
        if not child.constraint.accept(token):
            child.status, child.finish_reason, child.stop_reason = (
                RequestStatus.FINISHED, FinishReason.ABORT, DEAD_END)
            return child
    child.append_output_token(token)
    reason, stop_reason = check_stop(child, token, max_model_len)
    if reason is None and child.constraint is not None and child.constraint.is_terminated():
        reason, stop_reason = FinishReason.STOP, token
    if reason is not None:
        child.status, child.finish_reason, child.stop_reason = RequestStatus.FINISHED, reason, stop_reason
    return child


def end_records(request: Request) -> list[EngineCoreOutput]:
    """The records of a request finished without a token (aborted, failed, or outgrown the
    cache): its own, and for an n > 1 parent that has not forked yet one per sample it now
    never will, with the same reason.

    The contract every consumer counts on (core/group_progress.py): each sample index 0..n-1
    of a group gets exactly one finishing record, whatever the moment the group ends (waiting,
    mid-prefill, with its forking step in flight). A parent forks on its first token, so one
    with none has no samples of its own yet."""
    records = [request_output(request, [], None)]
    n = request.sampling_params.n
    if n > 1 and request.sample_index == 0 and not request.num_output_tokens:
        for i in range(1, n):
            records.append(EngineCoreOutput(
                sample_request_id(request.group_id, i), request.group_id, i, [], None,
                request.finish_reason, None, request.num_prompt_tokens, request.num_cached_tokens))
    return records
