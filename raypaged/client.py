"""Python client of a raypaged server: `AsyncClient` (asyncio) and `Client` (blocking).

    from raypaged.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("def fib(n):", max_tokens=32, temperature=0):
            print(chunk.outputs[0].text, end="", flush=True)
        result = client.generate("def fib(n):", max_tokens=32)   # the whole completion

Sampling parameters are keyword arguments named as in SamplingParams (n, max_tokens,
temperature, top_p, top_k, min_p, stop, stop_token_ids, seed, logprobs, ignore_eos, logit_bias,
prompt_logprobs, …), or a SamplingParams object. A prompt is text or a list of token ids. Leaving a stream early cancels
the call, which aborts the request on the server. Errors raise RequestError with the status.

A server started with TLS and a token (README: Running on a network safely):

    Client("host:50051", credentials=tls_credentials("ca.pem"), auth_token=os.environ["TOKEN"])
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from raypaged.core.sampling_params import SamplingParams
from raypaged.core.structured_output import StructuredOutput
from raypaged.proto.v1 import SERVICE_NAME, raypaged_pb2, raypaged_pb2_grpc

pb = raypaged_pb2

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}
_OPTIONAL_FIELDS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
                    "skip_special_tokens", "prompt_logprobs")
_SAMPLING_FIELDS = frozenset(_OPTIONAL_FIELDS + ("stop", "stop_token_ids", "ignore_eos",
                                                  "structured_output", "logit_bias"))


class RequestError(Exception):
    """The server refused or failed the call: `code` is the gRPC status, `message` says why;
    retry_after_s: when to try again, where the server said (a shed request's RESOURCE_EXHAUSTED
    carries it as trailing metadata "retry-after")."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class CompletionChunk:
    """One sample's news in one stream message."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: top tokens and the sampled one
    finish_reason: str | None  # "stop" | "length" | "abort" on the sample's last chunk
    stop_reason: int | str | None
    # prompt_logprobs, on the sample's first chunk: per prompt token its top tokens and itself;
    # None for the first (nothing before it scores it), as vLLM's.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class StreamChunk:
    request_id: str
    outputs: list[CompletionChunk]
    usage: Usage | None  # on the stream's last message


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class GenerateResult:
    request_id: str
    outputs: list[Completion]
    usage: Usage | None


def build_request(prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                  request_id: str = "", priority: int = 0, cache_salt: str = "",
                  **sampling) -> pb.GenerateRequest:
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
    if params is not None:
        if sampling:
            raise TypeError("give a SamplingParams or keyword sampling parameters, not both")
        sampling = {name: getattr(params, name) for name in _SAMPLING_FIELDS if hasattr(params, name)}
    message = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt)
    if isinstance(prompt, str):
        message.prompt = prompt
    else:
        message.prompt_token_ids.extend(prompt)
    target = message.sampling_params
    for name in _OPTIONAL_FIELDS:
        if sampling.get(name) is not None:
            setattr(target, name, sampling[name])
    stop = sampling.get("stop") or ()
    target.stop.extend([stop] if isinstance(stop, str) else stop)
    target.stop_token_ids.extend(sampling.get("stop_token_ids") or ())
    target.ignore_eos = bool(sampling.get("ignore_eos", False))
    bias = sampling.get("logit_bias") or {}
    target.logit_bias.update(dict(bias.items() if isinstance(bias, dict) else bias))
    structured = sampling.get("structured_output")
    if structured is not None:
        target.structured_output.CopyFrom(structured_output_to_proto(structured))
    return message


def structured_output_to_proto(spec: StructuredOutput | dict) -> raypaged_pb2.StructuredOutput:
    """A StructuredOutput (or vLLM's structured_outputs dict) as its raypaged.v1 message."""
    if isinstance(spec, dict):
        spec = StructuredOutput.from_dict(spec)
    kind = spec.kind
    gate = list(spec.reasoning_end_token_ids)
    if kind == "json":
        return raypaged_pb2.StructuredOutput(json_schema=spec.json, reasoning_end_token_ids=gate)
    if kind == "choice":
        return raypaged_pb2.StructuredOutput(choice=raypaged_pb2.StructuredOutput.Choices(
            choice=list(spec.choice or ())), reasoning_end_token_ids=gate)
    return raypaged_pb2.StructuredOutput(**{kind: getattr(spec, kind)}, reasoning_end_token_ids=gate)


def chunk_from_proto(message: pb.GenerateResponse) -> StreamChunk:
    outputs = []
    for delta in message.outputs:
        which = delta.WhichOneof("stop_reason")
        logprobs = [_logprob_dict(lp) for lp in delta.logprobs] if delta.logprobs else None
        prompt = None
        if delta.prompt_logprobs:
            prompt = [None, *(_logprob_dict(lp) for lp in delta.prompt_logprobs[1:])]
        outputs.append(CompletionChunk(
            index=delta.index, text=delta.text, token_ids=list(delta.token_ids), logprobs=logprobs,
            finish_reason=FINISH_REASONS.get(delta.finish_reason),
            stop_reason=getattr(delta, which) if which else None, prompt_logprobs=prompt))
    usage = None
    if message.HasField("usage"):
        u = message.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    return StreamChunk(message.request_id, outputs, usage)


def _logprob_dict(entry: pb.TokenLogprobs) -> dict[int, float]:
    return {**{t.token_id: t.logprob for t in entry.top_logprobs}, entry.token_id: entry.logprob}


class ResultBuilder:
    """Accumulates a stream's chunks into the whole GenerateResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.outputs: dict[int, Completion] = {}
        self.usage: Usage | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.request_id = chunk.request_id
        for out in chunk.outputs:
            completion = self.outputs.setdefault(out.index, Completion(out.index))
            completion.text += out.text
            completion.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None:
                completion.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        if chunk.usage is not None:
            self.usage = chunk.usage

    def result(self) -> GenerateResult:
        return GenerateResult(self.request_id, [self.outputs[i] for i in sorted(self.outputs)], self.usage)


def _health_modules():
    # Imported on use: the client runs without grpcio-health-checking unless health() is called.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2, health_pb2_grpc


def tls_credentials(ca_file: str | None = None, cert_file: str | None = None,
                    key_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS for the channel: the CA that signed the server's certificate (None: the system's
    roots), and this client's certificate and key where the server asks for one."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def _auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    # Call metadata works with and without TLS (the server warns when it is exposed without).
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else None


def _error(e: grpc.RpcError) -> RequestError:
    retry_after = None
    for key, value in e.trailing_metadata() or ():
        if key == "retry-after":
            with contextlib.suppress(ValueError):
                retry_after = float(value)
    return RequestError(e.code(), e.details() or "", retry_after)


class AsyncClient:
    def __init__(self, address: str, *, options: Sequence[tuple[str, object]] = (),
                 credentials: grpc.ChannelCredentials | None = None, auth_token: str | None = None) -> None:
        self.address = address
        self._metadata = _auth_metadata(auth_token)
        self._channel = (grpc.aio.secure_channel(address, credentials, options=list(options)) if credentials
                         else grpc.aio.insecure_channel(address, options=list(options)))
        self._stub = raypaged_pb2_grpc.RaypagedServiceStub(self._channel)

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     request_id: str = "", timeout: float | None = None, priority: int = 0,
                     cache_salt: str = "", **sampling) -> AsyncIterator[StreamChunk]:
        message = build_request(prompt, params, request_id=request_id, priority=priority,
                                cache_salt=cache_salt, **sampling)
        call = self._stub.Generate(message, timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield chunk_from_proto(response)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # no-op once the stream ended; aborts the request when left early

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs) -> GenerateResult:
        builder = ResultBuilder()
        async for chunk in self.stream(prompt, params, **kwargs):
            builder.add(chunk)
        return builder.result()

    async def abort(self, request_id: str) -> None:
        try:
            await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None

    async def model_info(self) -> pb.ModelInfo:
        try:
            return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None

    async def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        """"SERVING", "NOT_SERVING", … as grpc.health.v1 names them."""
        health_pb2, health_pb2_grpc = _health_modules()
        try:
            response = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Client:
    """Blocking twin of AsyncClient (same methods), for scripts and the command line."""

    def __init__(self, address: str, *, options: Sequence[tuple[str, object]] = (),
                 credentials: grpc.ChannelCredentials | None = None, auth_token: str | None = None) -> None:
        self.address = address
        self._metadata = _auth_metadata(auth_token)
        self._channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials
                         else grpc.insecure_channel(address, options=list(options)))
        self._stub = raypaged_pb2_grpc.RaypagedServiceStub(self._channel)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str = "", timeout: float | None = None, priority: int = 0,
               cache_salt: str = "", **sampling) -> Iterator[StreamChunk]:
        message = build_request(prompt, params, request_id=request_id, priority=priority,
                                cache_salt=cache_salt, **sampling)
        call = self._stub.Generate(message, timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield chunk_from_proto(response)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 **kwargs) -> GenerateResult:
        builder = ResultBuilder()
        for chunk in self.stream(prompt, params, **kwargs):
            builder.add(chunk)
        return builder.result()

    def abort(self, request_id: str) -> None:
        try:
            self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None

    def model_info(self) -> pb.ModelInfo:
        try:
            return self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None

    def health(self, service: str = SERVICE_NAME, timeout: float | None = 5.0) -> str:
        health_pb2, health_pb2_grpc = _health_modules()
        try:
            response = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
