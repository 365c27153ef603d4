"""The Serve app's OpenAI HTTP surface, live (tests/serve/conftest.py's instance): the official
openai client and raw HTTP through Serve's HTTP proxy to the ingress. The oracle is the offline
LLM on the same checkpoint: greedy output must match token for token."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tests.serve.serve_harness import APP, MAX_TOKENS, PROMPTS, SWITCH, client, engines_idle, named_call

pytestmark = pytest.mark.integration


def test_models_route(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == ["llama"]


def test_completion_stream_equals_offline_greedy(server, oracle):
    api = client(server)
    for prompt, expected in zip(PROMPTS, oracle["outputs"]):
        chunks = list(api.completions.create(model="llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage  # usage rides on the last chunk
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        assert all(c.usage is None for c in chunks[:-1])
    # Not streamed, as token ids: the same continuation.
    prompt_ids = oracle["tokenizer"].encode(PROMPTS[0])
    response = api.completions.create(model="llama", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    assert response.choices[0].text == oracle["outputs"][0].text
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.total_tokens == len(prompt_ids) + MAX_TOKENS


def test_chat_stream_equals_offline_greedy(server, oracle):
    chunks = list(client(server).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    content = [c.choices[0].delta for c in chunks if c.choices]
    assert content[0].role == "assistant"
    assert "".join(d.content or "" for d in content) == oracle["chat"].text
    # include_usage: OpenAI's own shape, a last chunk with no choices and the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_and_n(server):
    response = client(server).completions.create(
        model="llama", prompt=PROMPTS[1], max_tokens=4, temperature=1.0, n=2, seed=7, logprobs=2)
    assert sorted(c.index for c in response.choices) == [0, 1]
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.top_logprobs[0]) == 2
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    assert response.usage.completion_tokens == 8


BAD_REQUESTS = [
    # (route, body, status, param or a piece of the message)
    ("completions", {"model": "llama"}, 400, "prompt"),
    ("completions", {"model": "llama", "prompt": ""}, 400, "empty"),
    ("completions", {"model": "llama", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "llama", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("completions", {"model": "llama", "prompt": "x", "max_tokens": 1000}, 400, "context length"),
    ("completions", {"model": "llama", "prompt": [5, 10**6]}, 400, "not a token id"),
    ("completions", {"model": "llama", "prompt": "x", "n": 1000}, 400, "n must be"),
    ("completions", {"model": "llama", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"model": "llama", "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"model": "llama", "prompt": "x", "logit_bias": {"1000000": 1.0}}, 400, "logit_bias"),
    ("completions", {"model": "llama", "prompt": ["a", "b"]}, 400, "one prompt"),
    ("completions", {"model": "llama", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": "llama", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "only text"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400,
     "function.name"),
    ("chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 2}, 400, "top_logprobs"),
]


def test_bad_requests_get_openai_shaped_errors(server):
    base = f"{server['base']}/v1"
    with requests.Session() as http:
        for route, body, status, needle in BAD_REQUESTS:
            for stream in (False, True):
                response = http.post(f"{base}/{route}", json={**body, "stream": stream}, timeout=30)
                assert response.status_code == status, (body, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
                assert needle in error["message"] or needle == error["param"], (body, error)
        response = http.post(f"{base}/completions", data=b"{not json",
                             headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400 and "error" in response.json()
        for method, route, status in (("post", "/nowhere", 404), ("get", "/completions", 405)):
            response = getattr(http, method)(f"{base}{route}", timeout=30)
            assert response.status_code == status and set(response.json()["error"]) >= {"message", "type"}
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).completions.create(model="llama", prompt="x", temperature=-1)
    assert raised.value.status_code == 400 and "temperature" in raised.value.body["message"]
    # Nothing reached an engine, and both still serve.
    engines_idle()
    assert client(server).completions.create(model="llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1


LONE = "\ud800"  # a lone UTF-16 surrogate: a valid JSON escape ("\\ud800"), no valid text
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
TEXT = {"model": "llama", "prompt": "x", "max_tokens": 2}
# Every text field a client can send (issue 24: each was a 500), and the param each must name.
BAD_TEXT = [
    ("completions", {**TEXT, "prompt": LONE}, "prompt"),
    ("completions", {**TEXT, "prompt": ["ok " + LONE]}, "prompt.0"),
    ("completions", {**TEXT, "stop": LONE}, "stop"),
    ("completions", {**TEXT, "stop": ["a", LONE]}, "stop.1"),
    ("completions", {**TEXT, "request_id": LONE}, "request_id"),
    ("completions", {**TEXT, "cache_salt": LONE}, "cache_salt"),
    ("completions", {**TEXT, "user": LONE}, "user"),
    ("completions", {**TEXT, "model": LONE}, "model"),
    ("completions", {**TEXT, "suffix": "\udfff"}, "suffix"),
    ("completions", {**TEXT, "an_unknown_field": LONE}, "an_unknown_field"),
    ("chat/completions", {**CHAT, "stop": [LONE]}, "stop.0"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": LONE}]}]}, "messages.0.content.1.text"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": LONE}]},
     "messages.0.name"),
    ("chat/completions", {**CHAT, "model": LONE}, "model"),
]
# Wrong JSON types are refused, not coerced (OpenAI's API is strict).
WRONG_TYPES = [
    ("completions", {**TEXT, "stream": "yes"}, "stream"),
    ("completions", {**TEXT, "max_tokens": "10"}, "max_tokens"),
    ("completions", {**TEXT, "n": True}, "n"),
    ("completions", {**TEXT, "ignore_eos": 1}, "ignore_eos"),
    ("completions", {**TEXT, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ("chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 2.5}, "max_completion_tokens"),
]


def test_bad_text_and_wrong_types_are_400s_naming_the_field(server):
    """Issue 24: lone surrogates gave HTTP 500 (a plain-text one for "model"); wrong types were
    coerced. Each is a 400 in OpenAI's shape whose param names the field, streamed or not."""
    base = f"{server['base']}/v1"
    with requests.Session() as http:
        for route, body, field in BAD_TEXT + WRONG_TYPES:
            for stream in (False, True):
                sent = body if "stream" in body else {**body, "stream": stream}
                # json.dumps writes the surrogate as the escape a client would send.
                response = http.post(f"{base}/{route}", data=json.dumps(sent),
                                     headers={"content-type": "application/json"}, timeout=30)
                assert response.status_code == 400, (route, field, response.text)
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == field, (field, error)
                assert field in error["message"]
        # A body that is not UTF-8 at all is refused too.
        response = http.post(f"{base}/completions", data=b'{"model": "llama", "prompt": "\xff"}',
                             headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        # A wrong method is the client's mistake, in OpenAI's shape, with the methods allowed.
        response = http.get(f"{base}/completions", timeout=30)
        assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
        assert "POST" in response.headers.get("allow", "")
    engines_idle()
    assert client(server).completions.create(model="llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_client_disconnect_aborts(server):
    body = {"model": "llama", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with requests.post(f"{server['base']}/v1/completions", json=body, stream=True, timeout=30) as response:
        replica = response.headers["x-raypaged-replica"]
        first = next(line for line in response.iter_lines() if line)
        assert first.startswith(b"data: ")
    # Leaving the block closes the connection mid-stream.
    engines_idle()  # the engine that ran it aborted it: every pool whole
    metrics = _replica_metrics(replica)
    aborted = metrics[("raypaged_request_success", "abort")]
    assert aborted >= 1


def _replica_metrics(replica: str) -> dict[tuple[str, str], float]:
    handle = serve.get_app_handle(APP)
    for _ in range(100):
        text = handle.metrics_text.remote().result()
        if f'engine="{replica}"' in text:
            values = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[(family.name, sample.labels.get("finished_reason", ""))] = sample.value
            return values
    raise AssertionError(f"replica {replica} never answered")


def test_tool_calls_through_the_serve_app(server):
    """A named choice is enforced (the arguments validate) and streams the same; auto reaches the
    hermes parser the app's args name."""
    whole = named_call(client(server))
    [call] = whole.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SWITCH["function"]["parameters"])
    assert whole.choices[0].finish_reason == "tool_calls"
    auto = client(server).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Lights on?"}], max_tokens=4, temperature=0.0,
        tools=[SWITCH])
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
