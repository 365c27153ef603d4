"""Bearer-token authentication: a server interceptor that refuses, with UNAUTHENTICATED, every
call whose `authorization` metadata is not `Bearer <key>` of a known key.

The keys are a TenantRegistry (frontend/tenants.py): one token (`--auth-token`), or one key per
tenant from a keys file (`--api-keys-file`, frontend/keys_file.py), or both. Health checks stay
open (load balancers and Kubernetes probes carry no token); everything else, reflection
included, needs a key. Keys are looked up by their SHA-256 (no timing says anything about them).
Without TLS a key crosses the network in clear text: `raypaged launch` warns about that.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from raypaged import envs
from raypaged.frontend.tenants import AUTHORIZATION_KEY, TenantRegistry, check_key

# grpc.aio's interceptor signature: the next interceptor, or the handler lookup.
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]

AUTH_TOKEN_ENV = "RAYPAGED_AUTH_TOKEN"
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a client."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)


def auth_token_from_env() -> str | None:
    """$RAYPAGED_AUTH_TOKEN as this process started with it (raypaged/envs.py); None if unset."""
    return envs.RAYPAGED_AUTH_TOKEN


def check_token(token: str) -> str:
    """The token, refused when it could not safely travel in a header or is too weak."""
    return check_key(token, "the auth token")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: str | TenantRegistry,
                 open_method_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        """keys: one token, or a registry of API keys."""
        self.registry = TenantRegistry.single(check_token(keys)) if isinstance(keys, str) else keys
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
        return self.registry.from_metadata(metadata) is not None


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
