"""The OpenAI HTTP API's logic, one object per engine: both front doors answer through it.

`OpenAIFrontDoor` turns an OpenAI body into a raypaged.v1 GenerateRequest, runs it through the
GenerationService (validation, detokenization, stop strings, metrics: the gRPC code) and answers
a JSON response or an SSE stream. The Ray Serve deployment (serve/deployment.py) routes to it
from its ingress methods; `raypaged serve` (serve/standalone_http.py) from a FastAPI app of its
own. Errors leave as OpenAIError, which `install_error_handlers` answers in OpenAI's shape.

With API keys (a TenantRegistry, frontend/tenants.py) every route but /health needs
`Authorization: Bearer <key>` of a known key (401 otherwise), and a request runs as its key's
tenant: its limits (429 with Retry-After), cache salt and priority.
"""

# No `from __future__ import annotations`: the route methods' body models must be real classes.
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.service import GenerationService
from raypaged.frontend.tenants import Tenant, TenantRegistry
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.chat_output import ChatChoiceParser
from raypaged.serve.chat_template import chat_prompt_token_ids
from raypaged.serve.chat_tools import ToolPlan
from raypaged.serve.openai_errors import OpenAIError, from_validation_errors, model_not_found, unauthenticated
from raypaged.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from raypaged.serve.openai_responses import ResponseBuilder
from raypaged.serve.reasoning_gate import reasoning_gate
from raypaged.text.chat_parsing import ChatParsing

ParserFactory = Callable[[], ChatChoiceParser]  # one parser per chat choice
# A request's own timeout in seconds, in place of the server's request_timeout_s: past it the
# request is aborted and answered 504 (an error event once a stream has begun). A header, not a
# body field, so that any OpenAI client can send it (extra_headers) without a schema change.
RequestTimeout = Annotated[float | None, Header(alias="X-Request-Timeout")]
# The API key, read by the routes themselves: the Serve app has no middleware of its own.
Authorization = Annotated[str | None, Header(alias="Authorization")]

# The routes, by the OpenAIFrontDoor method that answers each: what every front door serves.
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("GET", "/v1/models", "models"),
    ("GET", "/health", "health"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAIError, FastAPI's body validation errors (422 → 400), unknown routes / methods
    (404 / 405) and anything unexpected (500, the exception still logged by the server) all
    answered as `{"error": {...}}`."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return await _openai_error(request, from_validation_errors(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        return await _openai_error(request, OpenAIError(error.status_code, str(error.detail),
                                                        headers=dict(error.headers or {}) or None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        return await _openai_error(request, OpenAIError.from_exception(error))


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIFrontDoor:
    """/v1/models, /health, /v1/completions and /v1/chat/completions over one service.

    headers: added to every answer (Serve names the replica that answered). model_names: the
    names it answers to (vLLM's --served-model-name, several allowed); default the service's
    model name. A request naming another model is a 404; a response names the model as the
    request did (the first name when it did not). parsing: the tool-call and reasoning parsers
    chat answers are read with (serve/chat_tools.py). tenants: the API keys (None: no
    authentication here). The engine is read from the service each time, so an engine the
    supervisor swapped in is the one described."""

    def __init__(self, service: GenerationService, metrics: FrontendMetrics,
                 headers: dict[str, str] | None = None, model_names: Sequence[str] | None = None,
                 parsing: ChatParsing | None = None, tenants: TenantRegistry | None = None) -> None:
        self.service = service
        self.tenants = tenants
        self.metrics = metrics
        self.headers = headers or {}
        self._model_names = tuple(model_names or ())
        self.parsing = parsing or ChatParsing()

    @property
    def model_names(self) -> tuple[str, ...]:
        return self._model_names or (self.service.model_name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant (None without keys); an unknown or missing key is a 401."""
        if self.tenants is None:
            return None
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise self.refused(unauthenticated())
        return tenant

    async def models(self, authorization: Authorization = None) -> dict[str, Any]:
        self.tenant(authorization)
        info = self.service.engine.model_info
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "raypaged",
            "root": info["model_dir"], "max_model_len": info["max_model_len"]} for name in self.model_names]}

    async def health(self) -> JSONResponse:
        alive = self.service.engine.is_alive and self.service.accepting
        return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)

    async def completions(self, body: CompletionRequest, timeout: RequestTimeout = None,
                          authorization: Authorization = None) -> Any:
        tenant = self.tenant(authorization)
        return await self._respond(body, chat=False, build=lambda: (body.to_generate_request(), None),
                                   timeout_s=timeout, tenant=tenant)

    async def chat_completions(self, body: ChatCompletionRequest, timeout: RequestTimeout = None,
                               authorization: Authorization = None) -> Any:
        tenant = self.tenant(authorization)

        def build() -> tuple[pb.GenerateRequest, ParserFactory | None]:
            plan = body.tool_plan(self.parsing)
            max_chars = self.service.model.max_model_len * self.service.limits.max_prompt_chars_per_token
            ids = chat_prompt_token_ids(self.service.tokenizer, body.message_dicts(), max_chars,
                                        tools=plan.tools)
            message = body.to_generate_request(ids, plan)
            params = message.sampling_params
            if self.parsing.reasoning_parser is not None and params.HasField("structured_output"):
                params.structured_output.reasoning_end_token_ids.extend(
                    reasoning_gate(self.service.tokenizer, ids))
            return message, self._chat_parser(body, plan, message)

        return await self._respond(body, chat=True, build=build, timeout_s=timeout, tenant=tenant)

    def _chat_parser(self, body: ChatCompletionRequest, plan: ToolPlan,
                     message: pb.GenerateRequest) -> ParserFactory | None:
        """What reads each choice of the answer; None: the text is the content."""
        # Output a grammar wrote from its first token (enforced tools, response_format, and no
        # reasoning gate: the prompt closed the reasoning) is JSON: no reasoning in it.
        params = message.sampling_params
        ungated = params.HasField("structured_output") and not params.structured_output.reasoning_end_token_ids
        reasoning = self.parsing.reasoning_parser is not None and not ungated
        if not plan.parses and not reasoning:
            return None
        return lambda: ChatChoiceParser(plan.new_parser(), self.parsing.reasoning() if reasoning else None,
                                        parallel=plan.parallel)

    async def _respond(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool,
                       build: Callable[[], tuple[pb.GenerateRequest, ParserFactory | None]],
                       timeout_s: float | None = None, tenant: Tenant | None = None) -> Any:
        if body.model is not None and body.model not in self.model_names:
            raise self.refused(model_not_found(body.model, self.model_names))
        if timeout_s is not None and not (0 < timeout_s < math.inf):
            raise self.refused(OpenAIError(400, f"X-Request-Timeout must be a positive number of "
                                                f"seconds, got {timeout_s}", param="X-Request-Timeout"))
        try:
            message, parser_factory = build()
        except Exception as e:
            raise self.refused(e) from None
        params = message.sampling_params
        logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        echo, completion = None, body if isinstance(body, CompletionRequest) else None
        if completion is not None and completion.echo:
            echo = message.prompt or self.service.tokenizer.decode(list(message.prompt_token_ids))
        builder = ResponseBuilder(
            chat=chat, request_id=message.request_id, model=body.model or self.model_name,
            tokenizer=self.service.tokenizer, n=params.n if params.HasField("n") else 1,
            logprobs=logprobs, include_usage=body.include_usage, echo=echo,
            num_logprobs=completion.logprobs if completion is not None else None,
            echo_logprobs=completion is not None and completion.echo_logprobs,
            prompt_logprobs=body.prompt_logprobs, chat_parser=parser_factory)
        stream = self.service.generate(message, timeout_s, tenant=tenant)
        # Pull the first message before answering: a refused request (validation, full queue,
        # engine gone) then gets its HTTP status, not a 200 stream that carries an error.
        try:
            first = await anext(stream)
        except Exception as e:
            await stream.aclose()
            raise self.refused(e) from None
        if body.stream:
            return StreamingResponse(self._event_stream(builder, first, stream),
                                     media_type="text/event-stream", headers=self.headers)
        async with contextlib.aclosing(stream):
            builder.add(first)
            try:
                async for message in stream:
                    builder.add(message)
            except Exception as e:
                raise self.refused(e) from None
        return JSONResponse(builder.response(), headers=self.headers)

    async def _event_stream(self, builder: ResponseBuilder, first: pb.GenerateResponse,
                            stream: AsyncGenerator[pb.GenerateResponse, None]) -> AsyncIterator[str]:
        async with contextlib.aclosing(stream):
            try:
                for chunk in builder.chunks(first):
                    yield sse(chunk)
                async for message in stream:
                    for chunk in builder.chunks(message):
                        yield sse(chunk)
            except Exception as e:  # after the 200 is sent: the error travels as an event
                yield sse(self.refused(e).body())
        yield sse("[DONE]")

    def refused(self, error: BaseException) -> OpenAIError:
        """The error as OpenAI answers it, counted in the metrics by its gRPC code."""
        refusal = OpenAIError.from_exception(error)
        self.metrics.record_error(refusal.grpc_code.name)
        return refusal
