"""One planned chaos call (benchmarks/lib/chaos_plan.py) sent through its door — raypaged.v1
gRPC or OpenAI HTTP (SSE) — and what it came to (`CallResult`). A call still open after the
bound is `hung`; an HTTP connection cut under it is an `error`; a client that leaves after its
planned number of messages is `cancelled`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import aiohttp
import grpc

from benchmarks.lib.chaos_plan import (
    BAD_JSON,
    BAD_PARAMS,
    BAD_PROTO,
    CANCELLED,
    COMPLETED,
    DEADLINE,
    ERROR,
    HUNG,
    REFUSED,
    CallResult,
    PlannedCall,
)
from raypaged.client import AsyncClient, RequestError, StreamChunk

GENERATE = "/raypaged.v1.RaypagedService/Generate"
# Bytes no GenerateRequest parses from: a truncated field, a bad varint, a lone UTF-16 surrogate.
BAD_BYTES = (b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x03\xff\xfe\xfd", b"\x0a\x03\xed\xa0\x80", b"\x0f")
SHED_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED,)


class Doors:
    """The server's two doors, one connection each, shared by every call of a run."""

    def __init__(self, address: str, http_url: str | None, model: str, vocab_size: int) -> None:
        self.grpc = AsyncClient(address)
        self.raw = grpc.aio.insecure_channel(address)  # for bytes that are no message
        self.http_url = http_url
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.model = model
        self.vocab_size = vocab_size

    async def close(self) -> None:
        await self.grpc.close()
        await self.raw.close()
        await self.http.close()


async def run_call(doors: Doors, call: PlannedCall, bound_s: float) -> CallResult:
    started = time.monotonic()
    result = CallResult(call.index, HUNG, 0.0, tokens=[[] for _ in range(call.n)], text=[""] * call.n,
                        finish=[None] * call.n)
    send = {"grpc": _grpc, "http": _http}[call.door]
    try:
        result.outcome = await asyncio.wait_for(send(doors, call, result), bound_s)
    except TimeoutError:
        result.outcome, result.detail = HUNG, f"still open after {bound_s:.0f} s"
    except aiohttp.ClientError as e:  # the connection cut mid-stream: a lost call, not the soak's end
        result.outcome, result.detail = ERROR, f"HTTP connection failed: {e!r}"[:300]
    result.seconds = time.monotonic() - started
    return result


def _refusal(call: PlannedCall, result: CallResult, code: str, message: str, deadline: bool, shed: bool) -> str:
    result.detail = f"{code}: {message[:200]}"
    if call.malformed:
        return REFUSED if code in ("INVALID_ARGUMENT", "400") else ERROR
    if deadline and call.deadline_s is not None:
        return DEADLINE
    return REFUSED if shed else ERROR


async def _grpc(doors: Doors, call: PlannedCall, result: CallResult) -> str:
    if call.kind == BAD_PROTO:
        payload = BAD_BYTES[call.index % len(BAD_BYTES)]
        try:
            async for _ in doors.raw.unary_stream(GENERATE)(payload, timeout=60):
                pass
        except grpc.aio.AioRpcError as e:
            return _refusal(call, result, e.code().name, e.details() or "", False, False)
        result.detail = "bytes that are no message were served"
        return ERROR
    params: dict[str, Any] = dict(max_tokens=call.max_tokens, n=call.n, temperature=call.temperature, seed=call.seed,
                  ignore_eos=True)
    prompt = call.prompt_token_ids
    if call.kind == BAD_PARAMS:
        # Out of range, each one the validation must catch: a token the model does not have, a
        # negative temperature, top_p above 1.
        bad = call.index % 3
        prompt = prompt + [doors.vocab_size + 7] if bad == 0 else prompt
        params.update({1: {"temperature": -1.0}, 2: {"top_p": 2.0}}.get(bad, {}))
    messages = 0
    stream = cast(AsyncGenerator[StreamChunk, None], doors.grpc.stream(prompt, timeout=call.deadline_s, **params))
    try:
        async for chunk in stream:
            messages += 1
            for out in chunk.outputs:
                result.tokens[out.index] += out.token_ids
                result.text[out.index] += out.text
                result.finish[out.index] = out.finish_reason or result.finish[out.index]
            if call.cancel_after_chunks is not None and messages >= call.cancel_after_chunks:
                return CANCELLED
    except RequestError as e:
        return _refusal(call, result, e.code.name, e.message, e.code == grpc.StatusCode.DEADLINE_EXCEEDED,
                        e.code in SHED_CODES)
    finally:
        await stream.aclose()  # cancels the call if it is still open
    if call.malformed:
        result.detail = "a malformed call was served"
        return ERROR
    return COMPLETED


async def _http(doors: Doors, call: PlannedCall, result: CallResult) -> str:
    body: dict[str, Any] = {"model": doors.model, "prompt": call.prompt_token_ids, "max_tokens": call.max_tokens,
                  "temperature": call.temperature, "stream": True, "ignore_eos": True}
    if call.seed is not None:
        body["seed"] = call.seed
    headers = {"Content-Type": "application/json"}
    if call.deadline_s is not None:
        headers["X-Request-Timeout"] = f"{call.deadline_s:.3f}"
    content = json.dumps(body).encode()
    if call.kind == BAD_JSON:
        content = content[: len(content) // 2]  # cut mid-way: no JSON
    elif call.kind == BAD_PARAMS:
        bad: dict[int, dict[str, Any]] = {0: {"max_tokens": -3}, 1: {"temperature": -1.0}, 2: {"n": 0}}
        body.update(bad[call.index % 3])
        content = json.dumps(body).encode()
    messages = 0
    async with doors.http.post(f"{doors.http_url}/completions", data=content, headers=headers) as response:
        if response.status != 200:
            text = await response.text(errors="replace")
            return _refusal(call, result, str(response.status), text, response.status == 504,
                            response.status == 429)
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:  # after the 200: the error travels as an event
                error = event["error"]
                message = str(error.get("message"))
                return _refusal(call, result, str(error.get("type")), message, "time" in message.lower(),
                                error.get("type") == "rate_limit_error")
            messages += 1
            for choice in event.get("choices", []):
                result.text[choice["index"]] += choice.get("text") or ""
                result.finish[choice["index"]] = choice.get("finish_reason") or result.finish[choice["index"]]
            if call.cancel_after_chunks is not None and messages >= call.cancel_after_chunks:
                response.close()  # the connection goes: the server aborts the request
                return CANCELLED
    if call.malformed:
        result.detail = "a malformed call was served"
        return ERROR
    return COMPLETED
