"""Admission control: whether the scheduler can ever serve a new request.

A request is refused (InvalidRequestError, nothing changed) when it could never be served — bad
ids or tokens, a prompt with no room to generate within max_model_len or larger than the whole KV
cache — or, with QueueFullError, when the waiting queue is at its bound (the frontend maps that to
RESOURCE_EXHAUSTED and the client may retry).
"""

from __future__ import annotations

from raypaged.core.errors import InvalidRequestError, QueueFullError
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.request import Request, RequestStatus
from raypaged.core.sample_ids import parse_sample_id, sample_id
from raypaged.core.scheduler_config import SchedulerConfig


def check_new_request(request: Request, config: SchedulerConfig, kv_cache_manager: KVCacheManagerInterface,
                      requests: dict[str, Request], groups: dict[str, set[str]], num_waiting: int) -> None:
    """Raise if the scheduler holding `requests` (live, by id), `groups` (live group id -> sample
    ids) and num_waiting waiting requests must refuse `request`."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"expected a Request, got {type(request).__name__}")
    request_id, group_id = request.request_id, request.group_id
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id in requests or request_id in groups or group_id in groups:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    # The forked samples of an n > 1 group get ids sample_id(group, i): keep those free both ways.
    owner, index = parse_sample_id(request_id)
    if index is not None and owner in groups:
        raise InvalidRequestError(f"request id {request_id!r} is reserved for a sample of "
                                  f"request {owner!r}")
    params = request.sampling_params
    for i in range(1, params.n):
        if sample_id(group_id, i) in requests:
            raise InvalidRequestError(f"sample id {sample_id(group_id, i)} of request {request_id!r} "
                                      "is already in use")
    resumed = request.resumed_output_token_ids
    if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
            or request.num_tokens != request.num_prompt_tokens + len(resumed)):
        raise InvalidRequestError(f"request {request_id!r} is not new (status {request.status.name})")
    if resumed:
        _check_resumed(request, config)
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
    if not all(type(t) is int and t >= 0 for t in prompt):
        raise InvalidRequestError(f"request {request_id!r}: prompt token ids must be "
                                  "non-negative integers")
    if len(prompt) >= config.max_model_len:
        raise InvalidRequestError(f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no "
                                  f"room to generate within max_model_len={config.max_model_len}")
    if not kv_cache_manager.can_fit(request.num_tokens):
        raise InvalidRequestError(f"request {request_id!r}: prompt of {request.num_tokens} tokens is "
                                  f"larger than the whole KV cache")
    if type(request.priority) is not int:
        raise InvalidRequestError(f"priority must be an integer, got {request.priority!r}")
    bound = config.max_waiting_requests
    if bound is not None and num_waiting >= bound:
        raise QueueFullError(f"the waiting queue is full ({bound} requests)")


def _check_resumed(request: Request, config: SchedulerConfig) -> None:
    """A resumed request (Request.resumed_output_token_ids) carries one sample's outputs, every
    one a real token, with room left to generate."""
    resumed, params = request.resumed_output_token_ids, request.sampling_params
    request_id = request.request_id
    if params.n != 1:
        raise InvalidRequestError(f"request {request_id!r}: a resumed request is one sample (n=1), "
                                  f"not n={params.n}")
    if not all(type(t) is int and t >= 0 for t in resumed):
        raise InvalidRequestError(f"request {request_id!r}: resumed output token ids must be "
                                  "non-negative integers")
    if len(resumed) >= params.max_tokens or request.num_tokens >= config.max_model_len:
        raise InvalidRequestError(f"request {request_id!r}: its {len(resumed)} resumed outputs "
                                  "leave nothing to generate")
