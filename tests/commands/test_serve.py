"""`raypaged serve` as a subprocess on the built-in demo model: the official openai client over
HTTP and the raypaged gRPC client reach the same engine in the same process; every response is
validated by the openai package's types; SIGTERM stops both front doors and exits 0."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from raypaged.client import Client
from tests.support.checkpoints import demo_model_missing
from tests.support.processes import Launched

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(demo_model_missing(), reason="the demo model is not built")]

READY = re.compile(r"raypaged ready: serving (\S+) .* on (\S+):(\d+), OpenAI API on http://\S+:(\d+)/v1")
PROMPT = "def fib(n):"
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def served():
    launched = Launched("--device", "cpu", "--port", "0", "--grpc-port", "0",
                        "--num-gpu-blocks-override", "64", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", ready=READY, command="serve")
    try:
        launched.wait_ready()
        yield launched
    finally:
        launched.kill_session()


def api(served: Launched) -> openai.OpenAI:
    assert served.match is not None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.match[4]}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def grpc_address(served: Launched) -> str:
    assert served.match is not None
    return f"{served.match[2]}:{served.match[3]}"


def valid(model):
    """The response as the openai package's types validate it (the client only constructs them)."""
    return type(model).model_validate(model.model_dump())


def test_models_lists_the_served_name(served):
    models = [valid(m) for m in api(served).models.list().data]
    assert [m.id for m in models] == ["demo"] and isinstance(models[0], Model)


def test_completion_over_http_equals_grpc_on_the_same_process(served):
    response = valid(api(served).completions.create(model="demo", prompt=PROMPT, max_tokens=8,
                                                    temperature=0.0, user="test-user"))
    assert isinstance(response, Completion)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 8
    with Client(grpc_address(served)) as client:
        assert client.model_info().name == "demo"
        assert client.generate(PROMPT, max_tokens=8, temperature=0.0).outputs[0].text == response.choices[0].text
    echoed = valid(api(served).completions.create(model="demo", prompt=PROMPT, max_tokens=8,
                                                  temperature=0.0, echo=True))
    assert echoed.choices[0].text == PROMPT + response.choices[0].text


def test_streamed_chat_equals_the_whole_response(served):
    whole = valid(api(served).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=10,
                                                      temperature=0.0, logprobs=True, top_logprobs=2))
    assert isinstance(whole, ChatCompletion)
    assert len(whole.choices[0].logprobs.content) == 10
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    chunks = [valid(c) for c in api(served).chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True})]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_stop_strings_n_and_seed(served):
    full = api(served).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12,
                                               temperature=0.0).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"no stop string to cut {full!r} at"
    cut = valid(api(served).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12,
                                                    temperature=0.0, stop=[stop]))
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = [valid(api(served).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=6,
                                                         temperature=1.0, n=2, seed=1234)) for _ in range(2)]
    assert [len(s.choices) for s in sampled] == [2, 2]
    assert ([c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices])


def test_errors_in_openais_shape(served):
    with pytest.raises(openai.NotFoundError) as missing:
        api(served).completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert missing.value.body["type"] == "invalid_request_error" and missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        api(served).completions.create(model="demo", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert "echo with logprobs" in bad.value.body["message"]


def test_tool_calls_named_enforced_and_auto_parsed(served):
    """The demo model has no tool template: a named choice is the grammar's, so it parses all the
    same; auto reads the model's text with the hermes parser (--tool-call-parser)."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}
    named = valid(api(served).chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=40, temperature=0.0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "pick"}}))
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["color"] in ("red", "blue")
    assert named.choices[0].finish_reason == "tool_calls"
    auto = valid(api(served).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8,
                                                     temperature=0.0, tools=[tool]))
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_sigterm_stops_both_front_doors(served):
    """Last of the tests on the served process: the server is gone after it. A stream in flight
gets to finish (launch's grace period, 30 s)."""
    stream = iter(api(served).chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=300, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    chunks = [valid(next(stream))]
    with Client(grpc_address(served)) as client:
        assert client.health() == "SERVING"
        served.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120  # a liveness bound, generous for a loaded machine
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.02)
    chunks += [valid(c) for c in stream]  # the HTTP stream in flight runs to its end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 300
    assert served.process.wait(timeout=120) == 0
    output = "".join(served.lines)
    assert "SIGTERM: shutting down" in output and "raypaged stopped" in output
    assert "Traceback" not in output
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=api(served).base_url, api_key="x", max_retries=0, timeout=5).models.list()


def test_serve_refuses_an_http_port_in_use_before_starting_anything():
    """As launch does for its gRPC port (tests/commands/test_launch.py): Ray's address leads
    nowhere and the model does not exist, so only the port check can be what failed."""
    with socket.create_server(("127.0.0.1", 0)) as taken, socket.create_server(("127.0.0.1", 0)) as dead:
        port = taken.getsockname()[1]
        dead_ray = f"127.0.0.1:{dead.getsockname()[1]}"
        dead.close()
        result = subprocess.run([sys.executable, "-m", "raypaged.cli", "serve", "/nonexistent-model-dir",
                                 "--port", str(port), "--grpc-port", "0", "--address", dead_ray],
                                capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr
    assert f"raypaged serve: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
