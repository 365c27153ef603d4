"""Bearer-token authentication: a server interceptor that refuses, with UNAUTHENTICATED, every
call whose `authorization` metadata is not `Bearer <token>`.

Health checks stay open (load balancers and Kubernetes probes carry no token); everything else,
reflection included, needs the token. The token is compared in constant time. Without TLS the
token crosses the network in clear text: `raypaged launch` warns about that.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from raypaged import envs

# grpc.aio's interceptor signature: the next interceptor, or the handler lookup.
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]

AUTH_TOKEN_ENV = "RAYPAGED_AUTH_TOKEN"
AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a client."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)


def auth_token_from_env() -> str | None:
    """$RAYPAGED_AUTH_TOKEN as this process started with it (raypaged/envs.py); None if unset."""
    return envs.RAYPAGED_AUTH_TOKEN


def check_token(token: str) -> str:
    """The token, refused when it could not safely travel in a header or is too weak."""
    if len(token) < 16:
        raise ValueError("the auth token must have at least 16 characters")
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError("the auth token must be printable ASCII without spaces")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, open_method_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._expected = f"Bearer {check_token(token)}".encode()
        self._open = open_method_prefixes

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(self._open) \
                or self._authorized(handler_call_details.invocation_metadata):
            return handler  # None: an unknown method, answered UNIMPLEMENTED either way
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (send metadata 'authorization: Bearer <token>')")

    def _authorized(self, metadata) -> bool:
        values = [value for key, value in (metadata or ()) if key == AUTHORIZATION_KEY]
        if len(values) != 1:
            return False
        value = values[0]
        given = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(given, self._expected)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only aborts. It has no deserializer: a
    refused caller's bytes reach no parser."""

    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    async def refuse_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(code, details)
        yield  # unreachable: makes this an async generator, as streaming handlers are

    if handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming \
            else grpc.unary_stream_rpc_method_handler
        return make(refuse_stream)
    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming \
        else grpc.unary_unary_rpc_method_handler
    return make(refuse)
