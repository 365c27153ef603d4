"""tool_choice `required` and named on a real model (the built-in demo model, no tool template):
the grammar makes every call's arguments parse and validate against the function's parameters,
whatever the model writes; a second turn with the tool's result goes through; streamed and whole
greedy answers agree; with asynchronous scheduling off and on, n = 2. The engine runs in this
process (no Ray) behind the real GenerationService and front door, reached with the official
openai client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from raypaged.config import EngineConfig
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.service import GenerationService
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import build_http_app
from tests.support.chat_messages import streamed_message, whole_message
from tests.support.checkpoints import demo_model_missing
from tests.support.inprocess_engine import InProcessEngine

pytestmark = pytest.mark.skipif(demo_model_missing(), reason="the demo model is not built")

# Enums and booleans: a random model's greedy walk through them always ends.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}
TOOLS = [WEATHER, ALARM]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def api(request):
    from transformers import AutoTokenizer

    from raypaged.demo import demo_model_path

    model = str(demo_model_path())
    engine = InProcessEngine(EngineConfig(model=model, device="cpu", async_scheduling=request.param))
    service = GenerationService(engine, AutoTokenizer.from_pretrained(model), model_name="demo")  # type: ignore[arg-type]
    front = OpenAIFrontDoor(service, FrontendMetrics("demo", engine.model_info["max_model_len"]))
    with TestClient(build_http_app(front)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    engine.shutdown()


def valid_calls(response: ChatCompletion, may_be_cut: bool = False) -> list[list[tuple[str, dict]]]:
    """Each choice's calls, every one validated against its function's parameters. may_be_cut:
    the grammar let the model go on adding calls until max_tokens, so the last may be partial."""
    ChatCompletion.model_validate(response.model_dump())
    out = []
    for choice in response.choices:
        cut = may_be_cut and choice.finish_reason == "length"
        assert cut or choice.finish_reason == "tool_calls", choice
        calls = []
        for i, call in enumerate(choice.message.tool_calls or []):
            assert call.id.startswith("call_") and call.type == "function"
            if cut and i == len(choice.message.tool_calls or []) - 1:
                continue
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, PARAMETERS[call.function.name])
            calls.append((call.function.name, arguments))
        assert calls
        out.append(calls)
    return out


def _create(api: openai.OpenAI, **body):
    return api.chat.completions.create(model="demo", **{"messages": USER, "max_tokens": 120, "temperature": 0.0,
                                                        "tools": TOOLS, **body})


def test_named_tool_choice_validates_and_streams_the_same(api):
    whole = _create(api, tool_choice=NAMED)
    [[(name, _)]] = valid_calls(whole)
    assert name == "get_weather" and whole.choices[0].message.content is None
    chunks = [ChatCompletionChunk.model_validate(c.model_dump()) for c in _create(api, tool_choice=NAMED, stream=True)]
    streamed = streamed_message(chunks)
    assert {k: v for k, v in streamed.items() if k != "ids"} == {k: v for k, v in whole_message(whole).items()
                                                                  if k != "ids"}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_validates_with_n_2(api, parallel):
    response = _create(api, tool_choice="required", parallel_tool_calls=parallel, n=2, temperature=1.0, seed=5,
                       max_tokens=120)
    calls = valid_calls(response, may_be_cut=parallel)
    assert len(calls) == 2
    if not parallel:
        assert all(len(c) == 1 for c in calls)
    streamed = streamed_message(list(_create(api, tool_choice="required", parallel_tool_calls=parallel,
                                             stream=True, max_tokens=120)))
    whole = whole_message(_create(api, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120))
    assert (streamed["calls"], streamed["finish"]) == (whole["calls"], whole["finish"])


def test_second_turn_with_the_tool_result(api):
    first = _create(api, tool_choice=NAMED)
    call = first.choices[0].message.tool_calls[0]
    messages = [*USER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = _create(api, messages=messages, tool_choice="none", max_tokens=8)
    ChatCompletion.model_validate(second.model_dump())
    assert second.choices[0].finish_reason == "length" and second.usage.prompt_tokens > first.usage.prompt_tokens
    again = valid_calls(_create(api, messages=messages, tool_choice="required", parallel_tool_calls=False))
    assert len(again[0]) == 1


def test_a_request_past_its_timeout_is_a_504_and_the_engine_serves_on(api):
    """X-Request-Timeout reaches the engine (the in-process one keeps it as the real client
    does): a request given far less time than its 120 tokens take is answered 504."""
    with pytest.raises(openai.APIStatusError) as raised:
        api.chat.completions.create(model="demo", messages=USER, max_tokens=120, temperature=0.0,
                                    extra_body={"ignore_eos": True},
                                    extra_headers={"X-Request-Timeout": "0.001"})
    assert raised.value.status_code == 504 and "timeout" in raised.value.message
    after = api.chat.completions.create(model="demo", messages=USER, max_tokens=4, temperature=0.0)
    assert after.choices[0].finish_reason in ("stop", "length")
