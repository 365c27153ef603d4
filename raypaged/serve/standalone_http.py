"""The OpenAI HTTP API without Ray Serve: a FastAPI app over one OpenAIFrontDoor, served by
uvicorn in the caller's event loop (`raypaged serve`, beside the gRPC server).

The routes are serve/openai_api.py's ROUTES, answered by the same OpenAIFrontDoor the Serve
deployment uses. What the gRPC server enforces, this one does too: a known API key (the bearer
token, or a key of the keys file: frontend/tenants.py) on every route but /health, checked
before the body is read (401 in OpenAI's shape), a bound on the request body
(413), and TLS with optional client certificates. Signals are the caller's: uvicorn's own
handlers are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from raypaged.frontend.tenants import TenantRegistry
from raypaged.frontend.tls import TLSConfig
from raypaged.serve.openai_api import ROUTES, OpenAIFrontDoor, install_error_handlers
from raypaged.serve.openai_errors import OpenAIError, unauthenticated

OPEN_PATHS = frozenset({"/health"})  # what a load balancer probes without the token


def build_http_app(front: OpenAIFrontDoor, *, auth_token: str | None = None,
                   max_body_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    """The keys checked up front are the front door's (front.tenants) and auth_token, if given."""
    app = FastAPI(title="raypaged", description="OpenAI-compatible API of raypaged serve")
    install_error_handlers(app)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(front, name), methods=[method])
    keys = TenantRegistry.merge((front.tenants, None if auth_token is None else TenantRegistry.single(auth_token)))
    app.add_middleware(_Guard, keys=keys, max_body_bytes=max_body_bytes)
    return app


class _Guard:
    """ASGI middleware: the API key first (before the body is read), then the body bound,
    on the declared Content-Length and on the bytes that actually arrive (chunked bodies)."""

    def __init__(self, app: Any, *, keys: TenantRegistry | None, max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.keys is not None and scope["path"] not in OPEN_PATHS:
            if self.keys.authenticate(headers.get(b"authorization")) is None:
                return await _answer(unauthenticated(), scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _answer(self._too_large(), scope, receive, send)
        seen, answered = 0, False

        async def bounded_receive() -> dict[str, Any]:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:  # answer now; the app sees the client leave
                answered = True
                await _answer(self._too_large(), scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not answered:
                await send(message)

        await self.app(scope, bounded_receive, guarded_send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body exceeds {self.max_body_bytes} bytes")


async def _answer(error: OpenAIError, scope: dict[str, Any], receive: Any, send: Any) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)


def ssl_options(tls: TLSConfig | None) -> dict[str, Any]:
    """uvicorn's TLS settings for the gRPC server's TLSConfig."""
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.client_ca_file is not None:
        options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class HTTPServer:
    """uvicorn on a socket bound at construction (a port in use is an OSError then, and port 0
    is resolved: `port`). start() serves in the running loop; stop() closes it and waits."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: TLSConfig | None = None,
                 shutdown_grace_s: float = 30.0) -> None:
        try:
            self._socket = socket.create_server((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=int(shutdown_grace_s), **ssl_options(tls))
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # it failed to start (e.g. a bad certificate)
                self._task.result()
                raise OSError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close()


class _QuietServer(uvicorn.Server):
    """uvicorn.Server minus its signal handlers (it would take SIGINT / SIGTERM from the
    command, and re-raise them when it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
