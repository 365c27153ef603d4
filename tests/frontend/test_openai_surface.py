"""The OpenAI surface over a real engine: the official openai client against the front door
(uvicorn over one OpenAIFrontDoor, as `raypaged serve` runs it) on a small random llama, with
chunked prefill, prefix caching and asynchronous scheduling on. Every response and every
streamed chunk is validated by the openai package's types; prompt logprobs (echo with logprobs,
vLLM's prompt_logprobs) are checked against transformers' log_softmax (fp32)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
import ray
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from raypaged.config import EngineConfig
from raypaged.serve.openai_api import OpenAIFrontDoor
from raypaged.serve.standalone_http import HTTPServer, build_http_app
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import ServerThread, init_ray
from tests.support.hf_oracle import hf_greedy, hf_prompt_logprobs, random_prompts, vocab_of

pytestmark = pytest.mark.integration

NAME = "llama"
NAMES = ["tiny-llama", "alias"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served():
    init_ray()
    config = EngineConfig(model=str(checkpoint_dir(NAME)), device="cpu", block_size=8,
                          max_num_batched_tokens=16, enable_chunked_prefill=True,
                          enable_prefix_caching=True, async_scheduling=True)
    running = ServerThread(config)
    front = OpenAIFrontDoor(running.server.service, running.server.metrics, model_names=NAMES)

    async def start() -> HTTPServer:
        http = HTTPServer(build_http_app(front), "127.0.0.1", 0)
        await http.start()
        return http

    http = running.call(start())
    try:
        yield running, f"http://127.0.0.1:{http.port}/v1"
    finally:
        running.call(http.stop())
        running.stop()
        ray.shutdown()


@pytest.fixture
def api(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0, timeout=120)


def valid(model):
    """The response as the openai package's types validate it (the client only constructs them).

    Two nulls OpenAI's own API sends that openai's Completion type has no room for are filled
    in for the check only (every other field is validated as it is): the null finish_reason of
    a streamed chunk before the end, and the null logprob and top_logprobs of an echoed
    prompt's first token (nothing before it scores it)."""
    data = model.model_dump()
    if isinstance(model, Completion):
        for choice in data["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
            logprobs = choice.get("logprobs")
            if logprobs and logprobs.get("token_logprobs") and logprobs["token_logprobs"][0] is None:
                logprobs["token_logprobs"][0] = 0.0
                logprobs["top_logprobs"][0] = {}
    type(model).model_validate(data)
    return model


valid_completion_chunk = valid


def assert_scores_prompt(prompt: list[int], token_logprobs: list[float | None],
                         top: list[dict[str, float] | None] | None = None, k: int = 0) -> None:
    expected = hf_prompt_logprobs(NAME, tuple(prompt))
    assert token_logprobs[0] is None and (top is None or top[0] is None)
    for i, value in enumerate(token_logprobs[1:len(prompt)]):
        assert value is not None and abs(value - expected[i, prompt[i + 1]].item()) < TOLERANCE
        if top is not None:
            # Keyed by decoded text: byte-level tokens that decode alike ("\ufffd") share a key.
            entry = top[i + 1] or {}
            assert 1 <= len(entry) <= k
            assert abs(max(entry.values()) - expected[i].max().item()) < TOLERANCE


def test_models_lists_every_served_name_and_other_names_are_404(api):
    models = [valid(m) for m in api.models.list().data]
    assert [m.id for m in models] == NAMES and all(isinstance(m, Model) for m in models)
    answered = valid(api.completions.create(model="alias", prompt="hello", max_tokens=2))
    assert answered.model == "alias"
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="gpt-4", prompt="hello", max_tokens=2)
    body = missing.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert ErrorObject.model_validate(body["error"]).code == "model_not_found"


def test_echo_with_logprobs_scores_the_prompt_like_transformers(api):
    prompt = random_prompts([23], vocab_of(NAME), seed=51)[0]  # two chunks of 16
    response = valid(api.completions.create(model=NAMES[0], prompt=prompt, max_tokens=3,
                                            temperature=0.0, echo=True, logprobs=2))
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert len(logprobs.tokens) == len(prompt) + 3
    assert_scores_prompt(prompt, logprobs.token_logprobs, logprobs.top_logprobs, k=2)
    assert all(1 <= len(t or {}) <= 2 for t in logprobs.top_logprobs[len(prompt):])
    # Streamed: the same logprobs, the prompt's in the first chunk.
    chunks = [valid_completion_chunk(c) for c in api.completions.create(
        model=NAMES[0], prompt=prompt, max_tokens=3, temperature=0.0, echo=True, logprobs=2, stream=True)]
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs or []]
    assert streamed == logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text


def test_vllm_prompt_logprobs_with_and_without_a_cached_prefix(api):
    vocab = vocab_of(NAME)
    prefix = random_prompts([24], vocab, seed=52)[0]
    first, second = random_prompts([5, 7], vocab, seed=53, prefix=prefix)
    api.completions.create(model=NAMES[0], prompt=first, max_tokens=1)  # caches the prefix
    response = valid(api.completions.create(model=NAMES[0], prompt=second, max_tokens=2,
                                            temperature=0.0, extra_body={"prompt_logprobs": 3}))
    scored: list[Any] = (response.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(scored) == len(second) and scored[0] is None
    expected = hf_prompt_logprobs(NAME, tuple(second))
    for i, entry in enumerate(scored[1:]):
        token = second[i + 1]
        assert abs(entry[str(token)]["logprob"] - expected[i, token].item()) < TOLERANCE
        top = expected[i].topk(3).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]
    assert response.usage is not None
    details = response.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0  # asked to score: no hit taken


def test_logit_bias_steers_greedy_completions_and_chat(api, served):
    tokenizer = served[0].tokenizer
    prompt = random_prompts([9], vocab_of(NAME), seed=54)[0]
    plain = hf_greedy(checkpoint_dir(NAME), tuple(prompt), 4)
    forced = (plain[0] + 11) % vocab_of(NAME)
    response = valid(api.completions.create(model=NAMES[0], prompt=prompt, max_tokens=4, temperature=0.0,
                                            logit_bias={str(forced): 100}, logprobs=0))
    assert response.choices[0].logprobs is not None
    assert response.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 4
    unbiased = valid(api.completions.create(model=NAMES[0], prompt=prompt, max_tokens=4, temperature=0.0))
    assert unbiased.choices[0].text == tokenizer.decode(plain)
    word = tokenizer.encode("fox", add_special_tokens=False)[0]
    chat = valid(api.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, temperature=0.0, logit_bias={str(word): 100}))
    assert isinstance(chat, ChatCompletion)
    assert chat.choices[0].message.content == tokenizer.decode([word] * 3)
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=NAMES[0], prompt=prompt, max_tokens=2,
                               logit_bias={str(vocab_of(NAME)): 5})
    assert "logit_bias" in bad.value.response.json()["error"]["message"]


def test_chat_logprobs_stop_usage_seed_user_and_n_streamed_and_whole(api):
    messages = [{"role": "user", "content": "Count with me"}]
    whole = valid(api.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=6, temperature=0.0,
                                              logprobs=True, top_logprobs=3, user="u-7"))
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.bytes is not None for t in content)
    chunks = [valid(c) for c in api.chat.completions.create(
        model=NAMES[0], messages=messages, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3,
        stream=True, stream_options={"include_usage": True})]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Run in other batches, the same logits up to float32 rounding.
    assert all(abs(a.logprob - b.logprob) < TOLERANCE for a, b in zip(streamed, content))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = whole.choices[0].message.content or ""
    stop = text[2:4]
    if stop.strip():
        cut = valid(api.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=6,
                                                temperature=0.0, stop=stop))
        assert cut.choices[0].message.content == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    seeded = [valid(api.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=8,
                                                temperature=1.0, n=2, seed=99)) for _ in range(2)]
    assert [len(s.choices) for s in seeded] == [2, 2]
    assert [c.message.content for c in seeded[0].choices] == [c.message.content for c in seeded[1].choices]


def test_completion_stream_usage_chunk_and_every_chunk_valid(api):
    chunks = list(api.completions.create(model=NAMES[0], prompt="The quick", max_tokens=5, n=2,
                                         temperature=0.7, seed=5, stream=True,
                                         stream_options={"include_usage": True}))
    for chunk in chunks:
        valid_completion_chunk(chunk)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


@pytest.mark.parametrize("path, body, status, says", [
    ("/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias keys"),
    ("/completions", {"prompt": "x", "logit_bias": {"3": 101}}, 400, "[-100, 100]"),
    ("/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/completions", {"prompt": "x", "model": "nope"}, 404, "nope"),
    ("/chat/completions", {"messages": [], "model": NAMES[1]}, 400, "messages"),
    ("/models", None, 405, ""),
])
def test_every_error_is_in_openais_shape(served, path, body, status, says):
    request = urllib.request.Request(served[1] + path, method="POST" if body is not None else "PUT",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == status
    error = json.loads(refused.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in ErrorObject.model_validate(error).message


def test_grpc_carries_logit_bias_and_prompt_logprobs(served):
    """The same engine over raypaged.v1 (the ServerThread's gRPC front door)."""
    import grpc

    from raypaged.client import Client, RequestError

    running = served[0]
    prompt = random_prompts([19], vocab_of(NAME), seed=55)[0]
    plain = hf_greedy(checkpoint_dir(NAME), tuple(prompt), 3)
    with Client(running.address) as client:
        result = client.generate(prompt, max_tokens=3, temperature=0.0, prompt_logprobs=1,
                                 logit_bias={plain[0]: -100.0})
        out = result.outputs[0]
        assert out.token_ids[0] != plain[0]
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) and scored[0] is None
        expected = hf_prompt_logprobs(NAME, tuple(prompt))
        for i, entry in enumerate(scored[1:]):
            assert entry is not None
            assert abs(entry[prompt[i + 1]] - expected[i, prompt[i + 1]].item()) < TOLERANCE
            assert int(expected[i].argmax()) in entry
        for sampling, says in (({"logit_bias": {vocab_of(NAME): 1.0}}, "logit_bias"),
                               ({"prompt_logprobs": 21}, "prompt_logprobs")):
            with pytest.raises(RequestError) as refused:
                client.generate(prompt, max_tokens=2, **sampling)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in refused.value.message


def test_chat_prompt_logprobs_on_the_response_and_its_first_chunk(api):
    messages = [{"role": "user", "content": "Score me"}]
    whole = valid(api.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=2,
                                              temperature=0.0, extra_body={"prompt_logprobs": 1}))
    scored = (whole.model_extra or {})["prompt_logprobs"]
    assert whole.usage is not None and len(scored) == whole.usage.prompt_tokens and scored[0] is None
    assert all(any(v["rank"] == 1 for v in entry.values()) for entry in scored[1:])
    chunks = [valid(c) for c in api.chat.completions.create(
        model=NAMES[0], messages=messages, max_tokens=2, temperature=0.0, stream=True,
        extra_body={"prompt_logprobs": 1})]
    carrying = [c for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    streamed = (carrying[0].model_extra or {})["prompt_logprobs"]
    assert [sorted(e) if e else e for e in streamed] == [sorted(e) if e else e for e in scored]


def test_structured_outputs_through_the_client_validate_streamed_and_whole(api):
    """response_format json_schema for random schemas, and vLLM's structured_outputs (regex,
    choice) in completions: each output conforms; streamed text equals the whole answer."""
    import random
    import re

    import jsonschema

    from tests.support.json_schemas import parse, random_schema

    rng = random.Random(41)
    messages = [{"role": "user", "content": "Fill in the record"}]
    finished = 0
    for i in range(4):
        schema = {"type": "object", "properties": {"k": random_schema(rng)}, "required": ["k"],
                  "additionalProperties": False}
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        whole = valid(api.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=120,
                                                  temperature=0.0, response_format=response_format))
        streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model=NAMES[0], messages=messages, max_tokens=120, temperature=0.0,
            response_format=response_format, stream=True) if c.choices)
        text = whole.choices[0].message.content or ""
        assert streamed == text
        if whole.choices[0].finish_reason == "stop":
            jsonschema.validate(parse(text), schema)
            finished += 1
    assert finished >= 2
    regex = valid(api.completions.create(model=NAMES[0], prompt="Code:", max_tokens=30, temperature=0.0,
                                         extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{2,4}"}}))
    assert re.fullmatch(r"[A-Z]{2}-\d{2,4}", regex.choices[0].text)
    choice = valid(api.completions.create(model=NAMES[0], prompt="Pick:", max_tokens=10, temperature=0.0, n=2,
                                          extra_body={"structured_outputs": {"choice": ["red", "green"]}}))
    assert [c.text in ("red", "green") for c in choice.choices] == [True, True]
