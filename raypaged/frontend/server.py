"""The gRPC server: raypaged.v1 next to grpc.health.v1 and reflection, Prometheus metrics on a
port of their own, engine stats polled into the metrics, and a graceful shutdown.

Shutdown: health turns NOT_SERVING at once (load balancers stop sending), new requests get
UNAVAILABLE, streams in flight get up to the grace period to finish; what is left then is
cancelled (and so aborted in the engine), and the engine goes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import make_wsgi_app

from raypaged.engine.client import AsyncEngineClient
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.service import GenerationService
from raypaged.frontend.servicer import RaypagedServicer
from raypaged.frontend.validation import RequestLimits
from raypaged.proto.v1 import SERVICE_NAME, raypaged_pb2_grpc

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051  # 0: any free port
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    model_name: str | None = None  # None: the model directory's name
    shutdown_grace_s: float = 30.0
    stats_interval_s: float = 1.0  # how often engine stats are polled into the metrics
    max_message_bytes: int = 4 * 1024 * 1024
    limits: RequestLimits = field(default_factory=RequestLimits)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
        pass


class _ThreadingWSGIServer(WSGIServer):
    daemon_threads = True


class FrontendServer:
    def __init__(self, engine: AsyncEngineClient, tokenizer: Any, config: ServerConfig = ServerConfig(),
                 owns_engine: bool = False) -> None:
        self.engine = engine
        self.config = config
        self.owns_engine = owns_engine
        info = engine.model_info
        service = GenerationService(engine, tokenizer, model_name=config.model_name, limits=config.limits)
        self.metrics = FrontendMetrics(service.model_name, info["max_model_len"])
        service.metrics = self.metrics
        self.service = service
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http: WSGIServer | None = None
        self._poll_task: asyncio.Task | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
        ]
        server = grpc.aio.server(options=options)
        raypaged_pb2_grpc.add_RaypagedServiceServicer_to_server(RaypagedServicer(self.service), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        try:
            self.port = server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError as e:  # grpc raises this when the address cannot be bound
            raise OSError(f"cannot listen on {config.host}:{config.port}: {e}") from None
        if not self.port:  # older grpc returns 0 instead of raising
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        if config.metrics_port is not None:
            self._start_metrics_http(config.host, config.metrics_port)
        await server.start()
        self._server = server
        await self._poll_engine_once()  # the first scrape already shows the engine
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, SERVING)
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_engine())

    def _start_metrics_http(self, host: str, port: int) -> None:
        httpd = make_server(host, port, make_wsgi_app(self.metrics.registry),
                            _ThreadingWSGIServer, handler_class=_QuietHandler)
        self.metrics_port = httpd.server_port
        threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
        self._metrics_http = httpd

    async def _poll_engine(self) -> None:
        """Engine stats into the metrics; health NOT_SERVING once the engine is gone."""
        while True:
            if not self.engine.is_alive:
                logger.error("the engine is gone: health is NOT_SERVING")
                await self._set_health(NOT_SERVING)
                return
            await self._poll_engine_once()
            await asyncio.sleep(self.config.stats_interval_s)

    async def _poll_engine_once(self) -> None:
        try:
            stats = await self.engine.actor.stats.remote()
            self.metrics.record_engine_stats(stats["scheduler"])
        except Exception:  # the pump notices a dead engine; here a missed poll is all
            logger.debug("engine stats poll failed", exc_info=True)

    async def _set_health(self, status: int) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Idempotent; concurrent callers all wait for the one shutdown."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self._shutdown(grace_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace_s: float | None) -> None:
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self._set_health(NOT_SERVING)
        await self.health.enter_graceful_shutdown()  # later sets are ignored
        in_flight = self.service.num_in_flight
        if not await self.service.drain(grace):
            logger.warning("%d of %d streams still running after the %.1f s grace period: cancelling",
                           self.service.num_in_flight, in_flight, grace)
        if self._server is not None:
            # The grace period is over: what is left is cancelled now (each cancelled handler
            # aborts its request in the engine), and health watchers end.
            await self._server.stop(grace=None)
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.owns_engine:
            await self.engine.shutdown()
        self._stopped.set()

    async def wait_closed(self) -> None:
        await self._stopped.wait()
