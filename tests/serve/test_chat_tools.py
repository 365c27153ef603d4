"""Tools and reasoning through the OpenAI front door, in process, over a scripted service: the
model's text is fixed, so the parsers are exercised end to end (streamed and whole answers
agree, openai's types validate them); bad tools are 400s naming the problem; tool calls and
their results round-trip through a Hermes-style chat template and the default one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.validation import RequestLimits
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.chat_template import DEFAULT_CHAT_TEMPLATE, chat_prompt_token_ids
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import build_http_app
from raypaged.text.chat_parsing import ChatParsing
from tests.support.chat_messages import streamed_message, whole_message
from tests.support.checkpoints import checkpoint_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]

# What a Hermes-format model (Qwen2.5 / Qwen3) writes, thinking first.
HERMES_OUTPUT = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')

# A Hermes-style template with tools, as Qwen's tokenizer_config.json ships one (shortened).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    '{%- for call in message.tool_calls %}\n<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _ScriptedService:
    """What OpenAIFrontDoor reads of a GenerationService; every sample's answer is `script`, in
    pieces of 3 characters, finishing with "stop"."""

    def __init__(self, tokenizer: Any, script: str) -> None:
        self.model_name = "demo"
        self.engine = SimpleNamespace(is_alive=True, model_info={"model_dir": "/m", "max_model_len": 4096})
        self.accepting = True
        self.tokenizer = tokenizer
        self.model = SimpleNamespace(max_model_len=4096)
        self.limits = RequestLimits()
        self.script = script
        self.requests: list[pb.GenerateRequest] = []

    async def generate(self, message: pb.GenerateRequest,
                       timeout_s: float | None = None, tenant: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(message)
        n = message.sampling_params.n or 1
        pieces = [self.script[i:i + 3] for i in range(0, len(self.script), 3)]
        for step, piece in enumerate(pieces):
            last = step == len(pieces) - 1
            for index in range(n):
                response = pb.GenerateResponse(request_id=message.request_id, outputs=[pb.CompletionDelta(
                    index=index, token_ids=[step], text=piece,
                    finish_reason=pb.FINISH_REASON_STOP if last else pb.FINISH_REASON_UNSPECIFIED)])
                if last and index == n - 1:
                    response.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=len(pieces) * n))
                yield response


@pytest.fixture(scope="module")
def hermes_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir("llama")))
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def _api(service: _ScriptedService, parsing: ChatParsing) -> openai.OpenAI:
    front = OpenAIFrontDoor(service, FrontendMetrics("demo", 4096), parsing=parsing)  # type: ignore[arg-type]
    http = TestClient(build_http_app(front))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_hermes_and_qwen3_end_to_end_streamed_equals_whole(hermes_tokenizer):
    service = _ScriptedService(hermes_tokenizer, HERMES_OUTPUT)
    api = _api(service, ChatParsing("hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3"))
    response = api.chat.completions.create(model="demo", messages=USER, tools=[WEATHER, NOW], n=2)
    ChatCompletion.model_validate(response.model_dump())
    whole = whole_message(response)
    assert whole["calls"] == [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")]
    assert whole["content"] == "Let me check." and whole["reasoning"] == "The user wants weather."
    assert whole["finish"] == "tool_calls" and all(i.startswith("call_") for i in whole["ids"])
    assert whole_message(response, 1)["calls"] == whole["calls"]
    chunks = [ChatCompletionChunk.model_validate(c.model_dump()) for c in api.chat.completions.create(
        model="demo", messages=USER, tools=[WEATHER, NOW], n=2, stream=True)]
    for index in (0, 1):
        streamed = streamed_message(chunks, index)
        assert {k: v for k, v in streamed.items() if k != "ids"} == {k: v for k, v in whole.items() if k != "ids"}
        assert len(set(streamed["ids"])) == 2
    # The tools reached the model's own template.
    prompt = hermes_tokenizer.decode(list(service.requests[0].prompt_token_ids))
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


def test_parallel_tool_calls_false_keeps_the_first_call(hermes_tokenizer):
    api = _api(_ScriptedService(hermes_tokenizer, HERMES_OUTPUT), ChatParsing("hermes", True))
    response = api.chat.completions.create(model="demo", messages=USER, tools=[WEATHER, NOW],
                                           parallel_tool_calls=False)
    assert [c.function.name for c in response.choices[0].message.tool_calls or []] == ["get_weather"]


def test_tool_choice_none_answers_content(hermes_tokenizer):
    api = _api(_ScriptedService(hermes_tokenizer, HERMES_OUTPUT), ChatParsing("hermes", True))
    response = api.chat.completions.create(model="demo", messages=USER, tools=[WEATHER], tool_choice="none")
    assert response.choices[0].message.content == HERMES_OUTPUT and not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


def test_reasoning_without_tools_streams_reasoning_content(hermes_tokenizer):
    service = _ScriptedService(hermes_tokenizer, "hmm</think>The answer.")
    api = _api(service, ChatParsing(reasoning_parser="deepseek_r1"))
    whole = whole_message(api.chat.completions.create(model="demo", messages=USER))
    assert (whole["reasoning"], whole["content"], whole["finish"]) == ("hmm", "The answer.", "stop")
    streamed = streamed_message(list(api.chat.completions.create(model="demo", messages=USER, stream=True)))
    assert streamed == whole


def test_a_constrained_answer_may_reason_first(hermes_tokenizer):
    """With a reasoning parser, response_format's grammar starts after `</think>` (the request
    carries the gate) and the reasoning is split off as for any answer; a prompt whose template
    already closed the reasoning gets no gate, and its output is the content whole."""
    service = _ScriptedService(hermes_tokenizer, 'plan the JSON</think>{"a": 1}')
    api = _api(service, ChatParsing(reasoning_parser="deepseek_r1"))
    json_mode = {"type": "json_object"}
    whole = whole_message(api.chat.completions.create(model="demo", messages=USER, response_format=json_mode))
    assert (whole["reasoning"], whole["content"]) == ("plan the JSON", '{"a": 1}')
    gate = service.requests[-1].sampling_params.structured_output.reasoning_end_token_ids
    assert list(gate) == hermes_tokenizer.encode("</think>", add_special_tokens=False)
    streamed = streamed_message(list(api.chat.completions.create(
        model="demo", messages=USER, response_format=json_mode, stream=True)))
    assert streamed == whole

    closed = [*USER, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    service.script = '{"a": 1}'
    answer = whole_message(api.chat.completions.create(model="demo", messages=closed, response_format=json_mode))
    assert not service.requests[-1].sampling_params.structured_output.reasoning_end_token_ids
    assert (answer["reasoning"], answer["content"]) == (None, '{"a": 1}')


def test_mistral_keeps_special_tokens_and_required_is_a_grammar(hermes_tokenizer):
    service = _ScriptedService(hermes_tokenizer, '[{"name": "now", "parameters": {}}]')
    api = _api(service, ChatParsing("mistral", True))
    api.chat.completions.create(model="demo", messages=USER, tools=[NOW])
    assert service.requests[-1].sampling_params.skip_special_tokens is False
    response = api.chat.completions.create(model="demo", messages=USER, tools=[WEATHER, NOW], tool_choice="required",
                                           parallel_tool_calls=False)
    schema = json.loads(service.requests[-1].sampling_params.structured_output.json_schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["get_weather", "now"]
    assert whole_message(response)["calls"] == [("now", "{}")]


def test_named_tool_choice_enforces_the_functions_parameters(hermes_tokenizer):
    service = _ScriptedService(hermes_tokenizer, '{"city": "Rome"}')
    api = _api(service, ChatParsing())  # no parser: named choices work for any model
    response = api.chat.completions.create(
        model="demo", messages=USER, tools=[WEATHER, NOW],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = json.loads(service.requests[-1].sampling_params.structured_output.json_schema)
    assert schema == WEATHER["function"]["parameters"]
    assert whole_message(response)["calls"] == [("get_weather", '{"city": "Rome"}')]
    assert response.choices[0].finish_reason == "tool_calls" and response.choices[0].message.content is None


def _400(api: openai.OpenAI, says: str, **body: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="demo", **{"messages": USER, **body})
    assert refused.value.status_code == 400 and says in refused.value.message, refused.value.message


def test_bad_tools_are_400s_naming_the_problem(hermes_tokenizer):
    service = _ScriptedService(hermes_tokenizer, "x")
    api = _api(service, ChatParsing("hermes", True))
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    _400(api, "tools[0].function.name", tools=[{"type": "function", "function": {"description": "no name"}}])
    _400(api, "tools[1].function.parameters must be a JSON schema of an object", tools=[NOW, bad_params])
    _400(api, "tools[0] must be an object of type 'function'", tools=[{"type": "retrieval"}])
    _400(api, "more than once", tools=[NOW, NOW])
    _400(api, "tool_choice names the function 'nope'", tools=[NOW],
         tool_choice={"type": "function", "function": {"name": "nope"}})
    _400(api, "tool_choice 'required' needs a non-empty tools list", tool_choice="required")
    _400(api, "tool_choice must be", tools=[NOW], tool_choice="sometimes")
    _400(api, "without its tool_call_id", messages=[*USER, {"role": "tool", "content": "sunny"}])
    _400(api, "arguments is not valid JSON", messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    _400(api, "cannot be combined with response_format", tools=[NOW], tool_choice="required",
         response_format={"type": "json_object"})
    _400(api, "deprecated", functions=[{"name": "f"}])
    no_auto = _api(service, ChatParsing())
    _400(no_auto, "--enable-auto-tool-choice", tools=[NOW])
    assert not service.requests  # refused before anything reached the engine


SECOND_TURN = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24 C"}]


def test_tool_calls_and_results_round_trip_through_the_templates(hermes_tokenizer):
    from raypaged.serve.openai_protocol import ChatCompletionRequest

    messages = ChatCompletionRequest.model_validate({"messages": SECOND_TURN}).message_dicts()
    ids = chat_prompt_token_ids(hermes_tokenizer, messages, 10**6, tools=[WEATHER])
    prompt = hermes_tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    plain = hermes_tokenizer.apply_chat_template(messages, tools=[WEATHER], chat_template=DEFAULT_CHAT_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=True)
    assert plain == (
        'tool get_weather: The weather in a city {"type": "object", "properties": {"city": {"type": "string"}, '
        '"days": {"type": "integer"}}, "required": ["city"]}\n'
        "user: Weather in Paris?\n"
        'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "tool (call_abc): sunny, 24 C\nassistant:")
    # Without tools the default template reads as it always has.
    assert hermes_tokenizer.apply_chat_template(USER, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True) == "user: Weather in Paris?\nassistant:"


def test_parser_flags_of_raypaged_serve_and_the_serve_app(capsys):
    from raypaged.cli import build_parser, main
    from raypaged.commands.serve import chat_parsing_from_args
    from raypaged.config import ConfigError
    from raypaged.serve.args import ServeAppArgs

    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice",
                                      "--reasoning-parser", "deepseek_r1"])
    assert chat_parsing_from_args(args) == ChatParsing("llama3_json", True, "deepseek_r1")
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "enable_auto_tool_choice needs a tool_call_parser" in capsys.readouterr().err
    served = ServeAppArgs.from_dict({"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                     "reasoning_parser": "qwen3"})
    assert served.chat_parsing == ChatParsing("hermes", True, "qwen3")
    with pytest.raises(ConfigError, match="unknown tool_call_parser 'nope'"):
        ServeAppArgs.from_dict({"tool_call_parser": "nope"})
