"""The gRPC server: raypaged.v1 next to grpc.health.v1 and reflection, Prometheus metrics on a
port of their own, engine stats polled into the metrics, and a graceful shutdown.

Shutdown: health turns NOT_SERVING at once (load balancers stop sending), new requests get
UNAVAILABLE, streams in flight get up to the grace period to finish; what is left then is
cancelled (and so aborted in the engine), and the engine goes last.

A dead engine (its actor died, or it gave up on its workers): health NOT_SERVING at once, and
with an engine factory the supervisor (frontend/supervisor.py) brings a new one and health goes
back to SERVING; the streams in flight go on on it (frontend/replay.py). Optional TLS
(frontend/tls.py) and bearer token or API keys (frontend/auth.py, frontend/tenants.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from raypaged.engine.client import AsyncEngineClient
from raypaged.engine.interface import EngineClient
from raypaged.frontend.auth import BearerTokenInterceptor
from raypaged.frontend.data_parallel import DataParallelEngineClient, EngineHandle
from raypaged.frontend.load_shedding import OverloadPolicy
from raypaged.frontend.malformed import MalformedRequestInterceptor
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.metrics_http import MetricsHTTPServer
from raypaged.frontend.replay import ReplayingEngine
from raypaged.frontend.service import GenerationService
from raypaged.frontend.servicer import RaypagedServicer
from raypaged.frontend.supervisor import EngineFactory, EngineSupervisor, RestartPolicy
from raypaged.frontend.tenants import TenantRegistry
from raypaged.frontend.tls import TLSConfig
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
    tls: TLSConfig | None = None  # None: plain text (fine on loopback only)
    auth_token: str | None = None  # set: every call but health needs "authorization: Bearer <it>"
    # API keys, each a tenant (frontend/tenants.py); with auth_token too, that is one more key.
    tenants: TenantRegistry | None = None
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)  # with an engine factory
    overload: OverloadPolicy = field(default_factory=OverloadPolicy)  # load shedding, request timeout


class FrontendServer:
    def __init__(self, engine: EngineHandle, tokenizer: Any, config: ServerConfig | None = None,
                 owns_engine: bool = False, engine_factory: EngineFactory | None = None) -> None:
        """config: None for the defaults (a ServerConfig of this server's own: it is mutable).
        engine_factory: how to start a new engine when this one dies (None: stay NOT_SERVING)."""
        if config is None:
            config = ServerConfig()
        self.engine = engine
        self.config = config
        self.owns_engine = owns_engine
        info = engine.model_info
        # The service streams through the replaying engine: with a supervisor, a stream whose
        # engine dies goes on on the next one.
        # Data-parallel replicas carry their streams over to one another themselves.
        self.replay = None if isinstance(engine, DataParallelEngineClient) else ReplayingEngine(
            engine, config.restart_policy.recovery_timeout_s if engine_factory is not None else 0.0)
        front: EngineClient = engine if self.replay is None else self.replay
        service = GenerationService(front, tokenizer, model_name=config.model_name,
                                    limits=config.limits, overload=config.overload)
        self.metrics = FrontendMetrics(service.model_name, info["max_model_len"])
        self.metrics.record_kv_pool(info)
        service.metrics = self.metrics
        if self.replay is not None:
            self.replay.on_replay = self.metrics.streams_replayed.inc
        self.service = service
        self.tenants = TenantRegistry.merge(
            (config.tenants, None if config.auth_token is None else TenantRegistry.single(config.auth_token)))
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http: MetricsHTTPServer | None = None
        self._poll_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.supervisor = None if engine_factory is None else EngineSupervisor(engine_factory,
                                                                               config.restart_policy)
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
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.tenants is not None:
            interceptors.append(BearerTokenInterceptor(self.tenants))  # before any parsing
        # Every service with unary requests (reflection, request-streaming, is left to grpc).
        interceptors.append(MalformedRequestInterceptor((SERVICE_NAME, health.SERVICE_NAME)))
        credentials = config.tls.server_credentials() if config.tls is not None else None
        server = grpc.aio.server(options=options, interceptors=interceptors)
        raypaged_pb2_grpc.add_RaypagedServiceServicer_to_server(RaypagedServicer(self.service, self.tenants), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        try:
            address = f"{config.host}:{config.port}"
            self.port = (server.add_secure_port(address, credentials) if credentials is not None
                         else server.add_insecure_port(address))
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
        loop = asyncio.get_running_loop()
        self._poll_task = loop.create_task(self._poll_engine())
        self._watch_task = loop.create_task(self._watch_engine())

    def _start_metrics_http(self, host: str, port: int) -> None:
        self._metrics_http = MetricsHTTPServer(host, port, self.metrics.registry)
        self.metrics_port = self._metrics_http.port

    async def _poll_engine(self) -> None:
        """Engine stats into the metrics."""
        while True:
            if self.engine.is_alive:
                await self._poll_engine_once()
            await asyncio.sleep(self.config.stats_interval_s)

    async def _watch_engine(self) -> None:
        """Health NOT_SERVING the moment the engine is gone; then, with a supervisor, a new
        engine and SERVING again. (Streams and new requests meanwhile wait for it, within the
        restart policy's recovery_timeout_s.)"""
        while True:
            reason = await self.engine.wait_dead()
            logger.error("%s: health is NOT_SERVING", reason)
            dead = self.engine
            if not isinstance(dead, AsyncEngineClient) or self.replay is None:
                # Data-parallel replicas are replaced one by one by their own client: here
                # every one of them is gone for good.
                await self._set_health(NOT_SERVING)
                return
            self.replay.lost(dead)
            await self._set_health(NOT_SERVING)
            if self.supervisor is None:
                self.replay.give_up()
                return
            engine = await self.supervisor.replace(dead)
            if engine is None:
                self.replay.give_up()
                return
            self.engine = engine
            self.replay.swap(engine)
            await self._poll_engine_once()
            await self._set_health(SERVING)
            logger.info("engine replaced: health is SERVING")

    async def _poll_engine_once(self) -> None:
        try:
            stats = await self.engine.stats()
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
        for task in (self._poll_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._metrics_http is not None:
            self._metrics_http.close()
        if self.owns_engine:
            await self.engine.shutdown()
        self._stopped.set()

    async def wait_closed(self) -> None:
        await self._stopped.wait()
