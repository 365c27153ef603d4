"""Request bytes that are not a valid message answer INVALID_ARGUMENT with a clear message.

grpc itself answers UNKNOWN ("Unexpected <class 'DecodeError'>…") when a request does not parse.
Both front doors give the raypaged service's handlers a deserializer that cannot raise
(safe_deserializer): what does not parse becomes an Undecodable marker. Here (`raypaged
launch`) the interceptor's wrapped handler aborts on it before the service sees anything; behind
Ray Serve's gRPC proxy (serve/grpc_ingress.py) the marker reaches the replica, which refuses it
(refuse_undecodable). Parsing is protobuf's own (no pickle, no eval of client bytes), and it
also refuses string fields that are not valid UTF-8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from raypaged.core.errors import InvalidRequestError
from raypaged.frontend.auth import Continuation
from raypaged.proto.v1 import SERVICE_NAME


@dataclass(frozen=True)
class Undecodable:
    """What a request's bytes became when they did not parse (picklable: it crosses to a Serve
    replica)."""

    method: str
    reason: str

    @property
    def message(self) -> str:
        return f"the request is not a valid message for {self.method}: {self.reason}"


def safe_deserializer(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """deserialize, answering an Undecodable instead of raising."""

    def safe_deserialize(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser says, the bytes are bad
            return Undecodable(method, str(e) or type(e).__name__)

    return safe_deserialize


def refuse_undecodable(request: Any) -> None:
    """InvalidRequestError (INVALID_ARGUMENT) for a request that did not parse."""
    if isinstance(request, Undecodable):
        raise InvalidRequestError(request.message)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service_names: tuple[str, ...] = (SERVICE_NAME,)) -> None:
        self._prefixes = tuple(f"/{name}/" for name in service_names)

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if (handler is None or handler.request_streaming or handler.request_deserializer is None
                or not method.startswith(self._prefixes)):
            return handler
        return _guarded(handler, method)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    safe_deserialize = safe_deserializer(handler.request_deserializer, method)

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def stream(request, context: grpc.aio.ServicerContext):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=safe_deserialize,
            response_serializer=handler.response_serializer)

    behavior = handler.unary_unary

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=safe_deserialize, response_serializer=handler.response_serializer)
