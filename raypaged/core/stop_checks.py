"""When a request stops: EOS or a stop token id (once min_tokens are out), or its length.

The scheduler checks every decoding request after every step, so the common "not yet" answer is
made cheap: prepare_stop_checks() folds the request's parameters into two fields once
(Request.stop_token_set, Request.max_num_tokens) and only a token in that set, or the length
reached, goes through check_stop().
"""

from __future__ import annotations

import functools

from raypaged.core.request import FinishReason, Request

_STOP = FinishReason.STOP
_LENGTH = FinishReason.LENGTH


def prepare_stop_checks(request: Request, max_model_len: int) -> None:
    """Call once the request's params and eos_token_id are final (when the scheduler takes it).
    A token outside stop_token_set never stops it; fewer than max_num_tokens tokens (prompt and
    outputs) never end it for length."""
    params = request.sampling_params
    stop_ids = set(params.stop_token_ids)
    if request.eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(request.eos_token_id)
    request.stop_token_set = _shared_set(tuple(sorted(stop_ids)))
    # len(outputs) >= max_tokens  <=>  len(prompt + outputs) >= len(prompt) + max_tokens
    request.max_num_tokens = min(len(request.prompt_token_ids) + params.max_tokens, max_model_len)


@functools.lru_cache(maxsize=1024)
def _shared_set(stop_ids: tuple[int, ...]) -> frozenset[int]:
    """One set object for all requests with the same stop ids (most share {EOS}): the per-step
    check then reads one set that stays in cache, not one per request."""
    return frozenset(stop_ids)


def check_stop(request: Request, token: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """After `token` was added: does the request stop, and why. (With asynchronous scheduling a
    placeholder for its next token may follow it; Request.num_output_tokens does not count it.)"""
    params = request.sampling_params
    if token == request.eos_token_id or token in params.stop_token_ids:
        reason, stop_reason = stop_on_token(request, token)
        if reason is not None:
            return reason, stop_reason
    num_outputs = request.num_output_tokens
    if num_outputs >= params.max_tokens or request.num_prompt_tokens + num_outputs >= max_model_len:
        return _LENGTH, None
    return None, None


def stop_on_token(request: Request, token: int) -> tuple[FinishReason | None, int | None]:
    """`token` is EOS or a stop id: it stops the request unless min_tokens are not out yet (or it
    is EOS and EOS is ignored). EOS reports no stop_reason; a stop id reports itself."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return None, None
    if token == request.eos_token_id and not params.ignore_eos:
        return _STOP, None
    if token in params.stop_token_ids:
        return _STOP, token
    return None, None
