"""OpenAI responses without a cluster: raypaged.v1 messages shaped into stream chunks, usage and
accumulated responses (logprobs too), and exceptions mapped to OpenAI error bodies."""

from __future__ import annotations

import json

import grpc
import pytest

from raypaged.core.errors import InvalidRequestError, QueueFullError
from raypaged.engine.client import EngineDeadError
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.openai_errors import OpenAIError, from_validation_errors, model_not_found
from raypaged.serve.openai_responses import MIN_LOGPROB, ResponseBuilder


# ---- responses -----------------------------------------------------------------------------------
class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _messages() -> list[pb.GenerateResponse]:
    return [
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[5], text="He")]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[6], text="")]),  # held back
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[7], text="llo",
                                                        finish_reason=pb.FINISH_REASON_STOP, stop_string="!")],
                            usage=pb.Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2)),
    ]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_and_usage(chat):
    builder = ResponseBuilder(chat=chat, request_id="r", model="m", tokenizer=_Tokenizer(), n=1,
                              logprobs=False, include_usage=False)
    chunks = [c for m in _messages() for c in builder.chunks(m)]
    assert len(chunks) == 2  # the held-back delta sends nothing
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["id"] == "chatcmpl-r"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
        assert chunks[1]["choices"][0]["delta"] == {"content": "llo"}
    else:
        assert [c["choices"][0]["text"] for c in chunks] == ["He", "llo"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == "!"
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert chunks[0]["usage"] is None


def test_include_usage_sends_openais_usage_chunk():
    builder = ResponseBuilder(chat=True, request_id="r", model="m", tokenizer=_Tokenizer(), n=1,
                              logprobs=False, include_usage=True)
    chunks = [c for m in _messages() for c in builder.chunks(m)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_accumulated_response_with_logprobs():
    lp = [pb.TokenLogprobs(token_id=5, logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=5, logprob=-0.5),
                                                                   pb.TopLogprob(token_id=9, logprob=float("-inf"))])]
    messages = [
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=1, token_ids=[5], text="a", logprobs=lp)]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=0, token_ids=[5], text="b", logprobs=lp,
                                                        finish_reason=pb.FINISH_REASON_LENGTH)]),
        pb.GenerateResponse(outputs=[pb.CompletionDelta(index=1, token_ids=[5], text="c", logprobs=lp,
                                                        finish_reason=pb.FINISH_REASON_STOP, stop_token_id=2)],
                            usage=pb.Usage(prompt_tokens=1, completion_tokens=3)),
    ]
    completion = ResponseBuilder(chat=False, request_id="r", model="m", tokenizer=_Tokenizer(), n=2,
                                 logprobs=True, include_usage=False)
    chat = ResponseBuilder(chat=True, request_id="r", model="m", tokenizer=_Tokenizer(), n=2,
                           logprobs=True, include_usage=False)
    for message in messages:
        completion.add(message)
        chat.add(message)
    body = completion.response()
    assert [c["text"] for c in body["choices"]] == ["b", "ac"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["stop_reason"] == 2
    logprobs = body["choices"][1]["logprobs"]
    assert logprobs["tokens"] == ["<5>", "<5>"] and logprobs["text_offset"] == [0, 3]
    assert logprobs["top_logprobs"][0] == {"<5>": -0.5, "<9>": MIN_LOGPROB}  # JSON has no -inf
    json.dumps(body, allow_nan=False)
    chat_body = chat.response()
    assert chat_body["choices"][1]["message"] == {"role": "assistant", "content": "ac"}
    entry = chat_body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "<5>" and entry["bytes"] == list(b"<5>") and len(entry["top_logprobs"]) == 2


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, status, kind", [
    (InvalidRequestError("bad"), 400, "invalid_request_error"),
    (QueueFullError("full"), 429, "rate_limit_error"),
    (EngineDeadError("gone"), 503, "service_unavailable_error"),
    (RuntimeError("boom"), 500, "server_error"),
])
def test_exceptions_map_to_openai_errors(error, status, kind):
    refusal = OpenAIError.from_exception(error)
    assert refusal.status == status
    body = refusal.body()["error"]
    assert body["type"] == kind and str(error) in body["message"]
    assert set(body) == {"message", "type", "param", "code"}


def test_model_not_found_and_validation_errors():
    missing = model_not_found("gpt-4", "llama")
    assert (missing.status, missing.code, missing.param, missing.grpc_code) == (
        404, "model_not_found", "model", grpc.StatusCode.NOT_FOUND)
    refusal = from_validation_errors([{"loc": ("body", "temperature"), "msg": "not a number"},
                                      {"loc": ("body", "prompt"), "msg": "Field required"}])
    assert refusal.status == 400 and refusal.param == "temperature"
    assert refusal.message == "temperature: not a number; prompt: Field required"
