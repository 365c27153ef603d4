"""Request bytes that are not a valid message answer INVALID_ARGUMENT with a clear message.

grpc itself answers UNKNOWN ("Unexpected <class 'DecodeError'>…") when a request does not parse.
This interceptor gives the raypaged service's handlers a deserializer that cannot raise: what
does not parse becomes an _Undecodable marker, and the wrapped handler aborts on it before the
service sees anything. Parsing is protobuf's own (no pickle, no eval of client bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from raypaged.frontend.auth import Continuation
from raypaged.proto.v1 import SERVICE_NAME


@dataclass(frozen=True)
class _Undecodable:
    reason: str


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
    deserialize = handler.request_deserializer

    def safe_deserialize(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser says, the bytes are bad
            return _Undecodable(str(e) or type(e).__name__)

    def refusal(request: _Undecodable) -> str:
        return f"the request is not a valid message for {method}: {request.reason}"

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def stream(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=safe_deserialize,
            response_serializer=handler.response_serializer)

    behavior = handler.unary_unary

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=safe_deserialize, response_serializer=handler.response_serializer)
