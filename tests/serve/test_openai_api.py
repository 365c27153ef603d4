"""The OpenAI front door in process (no Ray, no engine): a fake service behind the standalone
app of `raypaged serve`, driven with FastAPI's TestClient; every response is validated by the
openai package's own types. The live server is tests/commands/test_serve.py."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.validation import RequestLimits
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve import deployment
from raypaged.serve.openai_api import ROUTES, OpenAIFrontDoor, sse
from raypaged.serve.standalone_http import build_http_app

TOKEN = "s3cret-token-of-the-test"


class _Tokenizer:
    chat_template = None

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class _Service:
    """What OpenAIFrontDoor reads of a GenerationService; generate() answers two tokens per
    sample ("He", "llo"), with the logprobs asked for, and records the request it got."""

    def __init__(self) -> None:
        self.model_name = "demo"
        self.engine = SimpleNamespace(is_alive=True, model_info={"model_dir": "/models/demo", "max_model_len": 64})
        self.accepting = True
        self.tokenizer = _Tokenizer()
        self.model = SimpleNamespace(max_model_len=64)
        self.limits = RequestLimits()
        self.requests: list[pb.GenerateRequest] = []
        self.timeouts: list[float | None] = []

    async def generate(self, message: pb.GenerateRequest, timeout_s: float | None = None,
                       tenant: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(message)
        self.timeouts.append(timeout_s)
        params = message.sampling_params
        n = params.n if params.HasField("n") else 1
        logprobs = params.HasField("logprobs")
        for step, (token, text) in enumerate([(5, "He"), (6, "llo")]):
            for index in range(n):
                lp = [pb.TokenLogprobs(token_id=token, logprob=-0.5, top_logprobs=[
                    pb.TopLogprob(token_id=token, logprob=-0.5)] * params.logprobs)] if logprobs else []
                last = step == 1
                response = pb.GenerateResponse(request_id=message.request_id, outputs=[pb.CompletionDelta(
                    index=index, token_ids=[token], text=text, logprobs=lp,
                    finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED)])
                if last and index == n - 1:
                    response.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=2 * n))
                yield response


@pytest.fixture
def service() -> _Service:
    return _Service()


def _client(service: _Service, **options: Any) -> TestClient:
    metrics = FrontendMetrics("demo", 64)
    front = OpenAIFrontDoor(service, metrics)  # type: ignore[arg-type]
    return TestClient(build_http_app(front, **options))


def _events(text: str) -> list[Any]:
    import json

    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_the_standalone_app_serves_the_serve_deployments_routes():
    def routes(app: Any) -> set[tuple[str, str]]:
        return {(method.upper(), path) for path, methods in app.openapi()["paths"].items() for method in methods}

    assert routes(deployment.api) == {(method, path) for method, path, _ in ROUTES}
    assert routes(_client(_Service()).app) == routes(deployment.api)
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'


def test_models_and_health(service):
    client = _client(service)
    [model] = client.get("/v1/models").json()["data"]
    assert Model.model_validate(model).id == "demo"
    assert client.get("/health").json() == {"status": "ok"}
    service.accepting = False
    assert client.get("/health").status_code == 503


def test_completion_with_echo_n_seed_and_user(service):
    body = {"model": "demo", "prompt": "ab", "max_tokens": 2, "echo": True, "n": 2, "seed": 11, "user": "u-1"}
    response = Completion.model_validate(_client(service).post("/v1/completions", json=body).json())
    assert [c.text for c in response.choices] == ["abHello", "abHello"]
    assert response.usage is not None and response.usage.completion_tokens == 4
    params = service.requests[0].sampling_params
    assert params.n == 2 and params.seed == 11


def test_streamed_completion_echoes_the_prompt_once_per_choice(service):
    body = {"prompt": [7, 8], "max_tokens": 2, "echo": True, "stream": True}
    chunks = _events(_client(service).post("/v1/completions", json=body).text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "<7><8>Hello"
    # openai's Completion type has no null finish_reason, which streams (OpenAI's own too)
    # carry until the end: the chunk that finishes validates.
    Completion.model_validate(chunks[-1])


def test_streamed_chat_with_logprobs_usage_and_stop_strings(service):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
            "top_logprobs": 2, "stop": ["\n\n", "END"], "stream_options": {"include_usage": True}}
    chunks = [ChatCompletionChunk.model_validate(c)
              for c in _events(_client(service).post("/v1/chat/completions", json=body).text)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices]
    assert all(lp is not None and lp.content and len(lp.content[0].top_logprobs) == 2 for lp in logprobs)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    assert list(service.requests[0].sampling_params.stop) == ["\n\n", "END"]


def test_chat_response_validates(service):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    response = ChatCompletion.model_validate(_client(service).post("/v1/chat/completions", json=body).json())
    assert response.choices[0].message.content == "Hello"
    assert response.choices[0].logprobs is not None and len(response.choices[0].logprobs.content or []) == 2


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "invalid_request_error"),
    ("/v1/nothing-here", {}, 404, "invalid_request_error"),
])
def test_errors_in_openais_shape(service, path, body, status, kind):
    response = _client(service).post(path, json=body)
    assert response.status_code == status
    error = ErrorObject.model_validate(response.json()["error"])
    assert error.type == kind and error.message


def test_bearer_token_guards_all_but_health(service):
    client = _client(service, auth_token=TOKEN)
    refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert ErrorObject.model_validate(refused.json()["error"]).type == "authentication_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_request_body_bound(service):
    client = _client(service, max_body_bytes=1024)
    response = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413
    assert ErrorObject.model_validate(response.json()["error"]).type == "invalid_request_error"
    # A body of no declared length is counted as it arrives.
    chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),
                          headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_tls_options_for_uvicorn():
    from raypaged.frontend.tls import TLSConfig
    from raypaged.serve.standalone_http import ssl_options

    assert ssl_options(None) == {}
    assert ssl_options(TLSConfig("c.pem", "k.pem")) == {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem"}
    mutual = ssl_options(TLSConfig("c.pem", "k.pem", "ca.pem"))
    assert mutual["ssl_ca_certs"] == "ca.pem" and mutual["ssl_cert_reqs"] == ssl.CERT_REQUIRED


def test_serve_command_line(capsys):
    from raypaged.cli import build_parser, main

    args = build_parser().parse_args(["serve", "/models/x", "--port", "0", "--grpc-port", "7"])
    assert (args.model_path, args.http_port, args.port, args.host) == ("/models/x", 0, 7, "127.0.0.1")
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.model_path, defaults.http_port, defaults.port) == (None, 8000, 50051)
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert "MODEL and --model" in capsys.readouterr().err


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path, extra, expected", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": _SCHEMA, "strict": True}}},
     pb.StructuredOutput(json_schema=json.dumps(_SCHEMA, sort_keys=True))),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-z]+"}}, pb.StructuredOutput(regex="[a-z]+")),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["yes", "no"]}},
     pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choice=["yes", "no"]))),
    ("/v1/completions", {"structured_outputs": {"json": _SCHEMA}},
     pb.StructuredOutput(json_schema=json.dumps(_SCHEMA, sort_keys=True))),
    ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "x"'}},
     pb.StructuredOutput(grammar='root ::= "x"')),
])
def test_structured_output_reaches_the_sampling_params(service, path, extra, expected):
    body = {**(_CHAT if "chat" in path else {"prompt": "hi"}), **extra}
    response = _client(service).post(path, json=body)
    assert response.status_code == 200, response.text
    params = service.requests[-1].sampling_params
    assert params.HasField("structured_output") and params.structured_output == expected


def test_text_response_format_is_no_structured_output(service):
    response = _client(service).post("/v1/chat/completions",
                                     json={**_CHAT, "response_format": {"type": "text"}})
    assert response.status_code == 200
    assert not service.requests[-1].sampling_params.HasField("structured_output")


@pytest.mark.parametrize("extra, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{"}}},
     "json_schema.schema must be a JSON schema object"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not supported"),
    ({"structured_outputs": {"json": "{not json"}}, "json schema is not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "choice must be non-empty strings"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "choice must be non-empty strings"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "exactly one of"),
    ({"structured_outputs": {"whitespace": "x"}}, "unknown structured_outputs field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
])
def test_invalid_structured_output_is_a_400_naming_the_problem(service, extra, says):
    response = _client(service).post("/v1/chat/completions", json={**_CHAT, **extra})
    assert response.status_code == 400
    error = ErrorObject.model_validate(response.json()["error"])
    assert error.type == "invalid_request_error" and says in error.message
    assert not service.requests  # refused before submitting


def test_engine_refusal_of_a_spec_is_a_400(service):
    """A spec the grammar engine rejects (EngineCore.add_request's InvalidRequestError, raised
    from the service's generate) is answered 400 with its message, not a 500."""
    from raypaged.core.errors import InvalidRequestError

    async def refuse(message: pb.GenerateRequest, timeout_s: float | None = None,
                     tenant: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        raise InvalidRequestError("structured output regex is invalid: unbalanced parenthesis")
        yield  # pragma: no cover

    service.generate = refuse
    response = _client(service).post("/v1/completions",
                                     json={"prompt": "hi", "structured_outputs": {"regex": "("}})
    assert response.status_code == 400
    assert "unbalanced parenthesis" in response.json()["error"]["message"]


def test_an_unexpected_error_is_a_500_in_openais_shape(service):
    service.engine = SimpleNamespace(is_alive=True)  # no model_info: /v1/models fails unexpectedly
    client = TestClient(_client(service).app, raise_server_exceptions=False)
    response = client.get("/v1/models")
    assert response.status_code == 500
    error = ErrorObject.model_validate(response.json()["error"])
    assert error.type == "server_error" and error.message


def test_a_shed_request_is_a_429_with_retry_after(service):
    """ShedError (frontend/load_shedding.py) before the first message: 429 in OpenAI's shape
    with Retry-After in whole seconds, rounded up; streamed requests alike (no 200 first)."""
    from raypaged.frontend.load_shedding import ShedError

    async def shed(message: pb.GenerateRequest,
                   timeout_s: float | None = None, tenant: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        raise ShedError("the server is overloaded (3 requests are waiting); try again later",
                        "waiting_requests", 2.2)
        yield  # pragma: no cover

    service.generate = shed
    for stream in (False, True):
        response = _client(service).post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
        error = ErrorObject.model_validate(response.json()["error"])
        assert error.type == "rate_limit_error" and "overloaded" in error.message


def test_request_timeout_header_reaches_the_service_and_is_checked(service):
    client = _client(service)
    assert client.post("/v1/completions", json={"prompt": "hi"},
                       headers={"X-Request-Timeout": "2.5"}).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       headers={"X-Request-Timeout": "7"}).status_code == 200
    client.post("/v1/completions", json={"prompt": "hi"})
    assert service.timeouts == [2.5, 7.0, None]
    for bad in ("0", "-1", "soon", "inf"):
        response = client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Timeout": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(service.requests) == 3  # the refused ones never reached the service


def test_a_timeout_is_a_504_before_the_stream_and_an_error_event_within_it(service):
    from raypaged.core.errors import RequestTimeoutError

    async def times_out(message: pb.GenerateRequest,
                        timeout_s: float | None = None, tenant: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        if message.sampling_params.max_tokens == 1:
            raise RequestTimeoutError(f"request ran past its {timeout_s:g} s timeout")
        yield pb.GenerateResponse(request_id=message.request_id,
                                  outputs=[pb.CompletionDelta(index=0, token_ids=[5], text="He")])
        raise RequestTimeoutError(f"request ran past its {timeout_s:g} s timeout")

    service.generate = times_out
    client = _client(service)
    headers = {"X-Request-Timeout": "0.5"}
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert response.status_code == 504 and "0.5 s timeout" in response.json()["error"]["message"]
    whole = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8}, headers=headers)
    assert whole.status_code == 504  # not streamed: the whole answer is the error
    streamed = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True},
                           headers=headers)
    assert streamed.status_code == 200
    events = _events(streamed.text)
    assert events[0]["choices"][0]["text"] == "He"
    assert "timeout" in ErrorObject.model_validate(events[-1]["error"]).message
