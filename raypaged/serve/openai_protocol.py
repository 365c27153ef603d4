"""OpenAI request bodies (/v1/completions, /v1/chat/completions) and their raypaged.v1 message.

Field names and defaults are OpenAI's, plus vLLM's extensions (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, skip_special_tokens, priority, cache_salt,
structured_outputs). Structured output is OpenAI's `response_format` (json_object, json_schema) or
vLLM's `structured_outputs` (json, json_object, regex, choice, grammar): both become the message's
SamplingParams.structured_output. Unknown fields are ignored as OpenAI's server ignores them, but
features raypaged does not implement (suffix, logit_bias, best_of > n, echo with logprobs, functions)
are refused rather than silently dropped; `user` is accepted and unused. Range checks on sampling values stay in one
place: frontend/validation.py, reached through the GenerateRequest built here.

Types are strict, as OpenAI's API is: `"stream": "yes"`, `"max_tokens": "10"` or `"n": true` are
400s, never coerced (an int is still a float). Every string of the body, any field, is checked
to be real text first (serve/client_text.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.core.errors import InvalidRequestError
from raypaged.frontend.validation import structured_output_from_proto
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.chat_tools import ToolPlan
from raypaged.serve.client_text import check_client_text
from raypaged.text.chat_parsing import ChatParsing

# The wire limits of raypaged.v1's fields: a larger value is a 400, not an overflow.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int32]


# Strict: no value is coerced from another JSON type. Unknown fields are ignored, as OpenAI does.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share: the sampling fields."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _client_text(cls, body: Any) -> Any:
        # The whole body, before any field (nested or ignored ones too) is read.
        return check_client_text(body)

    model: str | None = None
    max_tokens: Int32 | None = None
    n: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (not both).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported")

    def _generate_request(self, max_tokens: int | None, logprobs: int | None) -> pb.GenerateRequest:
        self._refuse_unsupported()
        params = pb.SamplingParams()
        values = dict(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      seed=self.seed, top_k=self.top_k, min_p=self.min_p,
                      repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                      logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)
        for name, value in values.items():
            if value is not None:
                setattr(params, name, value)
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params.stop.extend(stop)
        params.stop_token_ids.extend(self.stop_token_ids or [])
        params.ignore_eos = self.ignore_eos
        structured = self._structured_output()
        if structured is not None:
            params.structured_output.CopyFrom(structured)
        return pb.GenerateRequest(request_id=self.request_id or uuid.uuid4().hex,
                                  sampling_params=params, priority=self.priority,
                                  cache_salt=self.cache_salt or "")


    def _structured_output(self) -> pb.StructuredOutput | None:
        fmt = self.response_format
        if fmt is not None and fmt.get("type") == "text":
            fmt = None
        if fmt is not None and self.structured_outputs is not None:
            raise InvalidRequestError("give response_format or structured_outputs, not both")
        if fmt is not None:
            message = _from_response_format(fmt)
        elif self.structured_outputs is not None:
            message = _from_structured_outputs(self.structured_outputs)
        else:
            return None
        # What can be checked without the grammar engine is checked here, as the gRPC door
        # checks it; whether xgrammar accepts the spec, the engine checks when it takes it.
        structured_output_from_proto(message)
        return message


def _from_response_format(fmt: dict[str, Any]) -> pb.StructuredOutput:
    kind = fmt.get("type")
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format json_schema needs a json_schema object "
                                      "with name and schema")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("response_format json_schema.schema must be a JSON schema object")
        return pb.StructuredOutput(json_schema=json.dumps(schema, sort_keys=True))
    raise InvalidRequestError(f"response_format type {kind!r} is not supported: text, json_object "
                              "or json_schema")


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _from_structured_outputs(spec: dict[str, Any]) -> pb.StructuredOutput:
    unknown = sorted(set(spec) - set(_STRUCTURED_KINDS))
    if unknown:
        raise InvalidRequestError(f"unknown structured_outputs field(s) {unknown}: one of "
                                  f"{', '.join(_STRUCTURED_KINDS)}")
    given = [k for k in _STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs must set exactly one of "
                                  f"{', '.join(_STRUCTURED_KINDS)}; got {given or 'none'}")
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        if isinstance(value, str):
            return pb.StructuredOutput(json_schema=value)
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError("structured_outputs json must be a JSON schema (object or text)")
        return pb.StructuredOutput(json_schema=json.dumps(value, sort_keys=True))
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError("structured_outputs json_object must be true")
        return pb.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError("structured_outputs choice must be a list of strings")
        return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choice=value))
    if not isinstance(value, str):
        raise InvalidRequestError(f"structured_outputs {kind} must be a string")
    return pb.StructuredOutput(regex=value) if kind == "regex" else pb.StructuredOutput(grammar=value)


class CompletionRequest(OpenAIRequest):
    # A text, token ids, or a batch of one of either (what the openai client sends for one prompt).
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Int32 | None = None  # top logprobs per token, 0..20
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None

    def to_generate_request(self) -> pb.GenerateRequest:
        if self.echo and self.logprobs is not None:
            # OpenAI's echo then scores the prompt too: prompt logprobs the engine does not compute.
            raise InvalidRequestError("echo with logprobs is not supported (no prompt logprobs)")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequestError("best_of is not supported (other than best_of == n)")
        message = self._generate_request(self.max_tokens, self.logprobs)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    f"one prompt per request is supported, got a batch of {len(prompt)}: send "
                    "them as separate requests (they are batched in the engine all the same)")
            prompt = prompt[0]
        if isinstance(prompt, str):
            message.prompt = prompt
        else:
            message.prompt_token_ids.extend(prompt)
        return message


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    tool_calls: list[Any] | None = None  # assistant messages: the calls it made

    def text(self) -> str:
        """Content parts other than text (images, audio) cannot reach a text-only model."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"content part {i} of a {self.role} message is of type {kind!r}: only text "
                    "parts are supported")
            texts.append(part["text"])
        return "".join(texts)

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention, vLLM's too): a tool result
        with its tool_call_id, an assistant's calls with their arguments as objects."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.role == "tool":
            if not self.tool_call_id:
                raise InvalidRequestError(f"messages[{index}] is a tool message without its tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError(f"messages[{index}] is a {self.role} message: only "
                                          "assistant messages carry tool_calls")
            out["tool_calls"] = [_template_call(call, f"messages[{index}].tool_calls[{i}]")
                                 for i, call in enumerate(self.tool_calls)]
            if self.content is None:
                out["content"] = None
        return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                                  "{\"name\", \"arguments\"}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidRequestError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's deprecated function calling: refused
    function_call: Any = None

    def tool_plan(self, parsing: ChatParsing) -> ToolPlan:
        if self.functions or self.function_call is not None:
            raise InvalidRequestError("functions / function_call are deprecated and not supported: "
                                      "send tools and tool_choice")
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, parsing)

    def to_generate_request(self, prompt_token_ids: list[int], plan: ToolPlan | None = None) -> pb.GenerateRequest:
        """plan: tool_plan()'s, with the server's parsers; None: as a server without any."""
        plan = plan if plan is not None else self.tool_plan(ChatParsing())
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        message = self._generate_request(max_tokens, logprobs)
        message.prompt_token_ids.extend(prompt_token_ids)
        if plan.enforced:
            # The grammar writes the call: the request's own structured output cannot apply too.
            if message.sampling_params.HasField("structured_output"):
                raise InvalidRequestError(f"tool_choice {plan.kind!r} is enforced with a grammar and "
                                          "cannot be combined with response_format or structured_outputs")
            structured = pb.StructuredOutput(json_schema=plan.schema_text())
            structured_output_from_proto(structured)
            message.sampling_params.structured_output.CopyFrom(structured)
        if plan.keeps_special_tokens and self.skip_special_tokens is None:
            message.sampling_params.skip_special_tokens = False
        return message

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]
