"""From a GenerateRequest message to an engine Request, refusing anything the engine cannot serve.

Every check raises InvalidRequestError with a message that names the field and the limit; nothing
reaches the engine unless all pass. Unset optional fields take vLLM's defaults.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raypaged.core.errors import InvalidRequestError
from raypaged.core.request import Request
from raypaged.core.sample_ids import SEPARATOR
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.structured_output import StructuredOutput
from raypaged.proto.v1 import raypaged_pb2 as pb

DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for (beyond the model's own: context, vocabulary)."""

    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # OpenAI's limit on logit_bias entries
    max_request_id_chars: int = 128
    max_cache_salt_chars: int = 256
    # A text prompt is refused before tokenizing when it has more characters than this many per
    # token of context: it could not fit, and tokenizing megabytes would stall the server.
    max_prompt_chars_per_token: int = 64


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int

    @classmethod
    def from_model_info(cls, info: dict) -> ModelLimits:
        return cls(max_model_len=int(info["max_model_len"]), vocab_size=int(info["vocab_size"]))


@dataclass
class PreparedRequest:
    request: Request
    skip_special_tokens: bool


def prepare_request(message: pb.GenerateRequest, tokenizer: Any, model: ModelLimits,
                    limits: RequestLimits = RequestLimits()) -> PreparedRequest:
    request_id = _request_id(message.request_id, limits)
    prompt_ids = _prompt_token_ids(message, tokenizer, model, limits)
    params_message = message.sampling_params
    params = sampling_params_from_proto(params_message, len(prompt_ids), model, limits)
    _check(len(message.cache_salt) <= limits.max_cache_salt_chars,
           f"cache_salt has {len(message.cache_salt)} characters; the limit is {limits.max_cache_salt_chars}")
    request = Request(request_id, prompt_ids, params, priority=message.priority,
                      cache_salt=message.cache_salt or None)
    skip = params_message.skip_special_tokens if params_message.HasField("skip_special_tokens") else True
    return PreparedRequest(request, skip)


def sampling_params_from_proto(message: pb.SamplingParams, num_prompt_tokens: int, model: ModelLimits,
                               limits: RequestLimits = RequestLimits()) -> SamplingParams:
    values: dict[str, Any] = {}
    for field in ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
                  "prompt_logprobs"):
        if message.HasField(field):
            values[field] = getattr(message, field)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in values:
            _check(math.isfinite(values[name]), f"{name} must be a finite number, got {values[name]}")

    n = values.get("n", 1)
    _check(1 <= n <= limits.max_n, f"n must be in [1, {limits.max_n}], got {n}")
    room = model.max_model_len - num_prompt_tokens
    if "max_tokens" in values:
        max_tokens = values["max_tokens"]
        _check(max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}")
        _check(max_tokens <= room,
               f"this model's maximum context length is {model.max_model_len} tokens; the request "
               f"asks for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
               f"{max_tokens} to generate)")
    else:
        values["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)

    stop = list(message.stop)
    _check(len(stop) <= limits.max_stop_strings,
           f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        _check(0 < len(text) <= limits.max_stop_string_chars,
               f"stop[{i}] must have 1 to {limits.max_stop_string_chars} characters, got {len(text)}")
    stop_ids = list(message.stop_token_ids)
    _check(len(stop_ids) <= limits.max_stop_token_ids,
           f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(stop_ids)}")
    _check_token_ids("stop_token_ids", stop_ids, model.vocab_size)
    bias = dict(message.logit_bias)
    _check(len(bias) <= limits.max_logit_bias,
           f"logit_bias has {len(bias)} entries; the limit is {limits.max_logit_bias}")
    _check_token_ids("logit_bias", sorted(bias), model.vocab_size, keys=True)
    if bias:
        values["logit_bias"] = bias
    # SamplingParams checks the rest (ranges, min_tokens <= max_tokens, logprobs <= 20, biases in
    # [-100, 100]) with messages of its own.
    if message.HasField("structured_output"):
        values["structured_output"] = structured_output_from_proto(message.structured_output)
    return SamplingParams(**values, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                          ignore_eos=message.ignore_eos)


def structured_output_from_proto(message: pb.StructuredOutput) -> StructuredOutput:
    """The spec, checked as far as it can be without the grammar engine (StructuredOutput's own
    checks); whether xgrammar accepts it is checked when the engine takes the request."""
    kind = message.WhichOneof("kind")
    _check(kind is not None, "structured_output must set one of json_schema, json_object, regex, "
                             "choice, grammar")
    gate = tuple(message.reasoning_end_token_ids)
    if kind == "json_schema":
        return StructuredOutput(json=message.json_schema, reasoning_end_token_ids=gate)
    if kind == "json_object":
        _check(message.json_object, "structured_output json_object must be true when set")
        return StructuredOutput(json_object=True, reasoning_end_token_ids=gate)
    if kind == "choice":
        return StructuredOutput(choice=tuple(message.choice.choice), reasoning_end_token_ids=gate)
    return StructuredOutput(**{kind: getattr(message, kind)}, reasoning_end_token_ids=gate)


def _request_id(request_id: str, limits: RequestLimits) -> str:
    if not request_id:
        return uuid.uuid4().hex
    _check(len(request_id) <= limits.max_request_id_chars,
           f"request_id has {len(request_id)} characters; the limit is {limits.max_request_id_chars}")
    _check(request_id.isprintable() and not request_id.isspace(),
           "request_id must be printable characters, not only spaces")
    _check(SEPARATOR not in request_id,
           f"request_id must not contain {SEPARATOR!r} (reserved for sample ids)")
    return request_id


def _prompt_token_ids(message: pb.GenerateRequest, tokenizer: Any, model: ModelLimits,
                      limits: RequestLimits) -> list[int]:
    text, ids = message.prompt, list(message.prompt_token_ids)
    _check(not (text and ids), "give the prompt as text or as token ids, not both")
    _check(bool(text or ids), "the prompt is empty")
    if text:
        max_chars = model.max_model_len * limits.max_prompt_chars_per_token
        _check(len(text) <= max_chars,
               f"the prompt has {len(text)} characters; at most {max_chars} can fit this model's "
               f"context of {model.max_model_len} tokens")
        ids = tokenizer.encode(text)
        _check(bool(ids), "the prompt is empty after tokenization")
    _check(len(ids) < model.max_model_len,
           f"the prompt has {len(ids)} tokens; this model's maximum context length is "
           f"{model.max_model_len}, which leaves no room to generate")
    if not text:  # after the length check: a message can carry a million ids, each one looked at
        _check_token_ids("prompt_token_ids", ids, model.vocab_size)
    return ids


def _check_token_ids(name: str, ids: Sequence[int], vocab_size: int, keys: bool = False) -> None:
    """keys: the ids are a map's keys, named as such in the message."""
    for i, token_id in enumerate(ids):
        where = f"{name} key {token_id}" if keys else f"{name}[{i}] = {token_id}"
        _check(0 <= token_id < vocab_size,
               f"{where} is not a token id of this model (0 to {vocab_size - 1})")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
