"""The engine deployment: one replica = one engine, streamed at the token level to the ingress.

Each replica starts its engine actor (and, at tensor_parallel_size > 1, the TP workers) inside
its own placement group (serve/placement.py) and serves it to the ingress deployment
(serve/deployment.py) through Serve DeploymentHandles: `generate` streams a core `Request`'s
`EngineCoreOutput` records as the engine makes them, with nothing of the text side (validation,
tokenization, detokenization, stop strings, tenants live at the ingress). A stream cancelled by
its caller (the ingress cancels it when its client leaves, or when a stop string ends it) leaves
`AsyncEngineClient.generate`, which aborts it in the engine and frees its KV blocks.

Every method takes a `route` keyword (serve/route_hint.py) that only the request router reads.
The replica reports what its prefix cache holds and its engine's load to that router
(`record_routing_stats`), and its engine's numbers to Prometheus through Ray's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import generate_latest
from ray import serve

from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import Request
from raypaged.engine.client import AsyncEngineClient
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.prefix_router import PrefixRouter
from raypaged.serve.args import ServeAppArgs
from raypaged.serve.prefix_request_router import routing_stats
from raypaged.serve.ray_metrics import RayMetricsMirror
from raypaged.serve.route_hint import RouteHint

logger = logging.getLogger(__name__)


def served_model_name(args: ServeAppArgs, model_info: dict[str, Any]) -> str:
    """The name the app answers to: the first served name, "demo" for the demo model, else the
    model directory's name."""
    names = args.served_model_names
    if names:
        return names[0]
    if args.engine.model_settings.model is None:
        return "demo"
    return os.path.basename(os.path.normpath(model_info["model_dir"]))


class EngineDeployment:
    async def __init__(self, args: ServeAppArgs) -> None:  # type: ignore[misc]  # Serve awaits it
        self.args = args
        self.engine = await AsyncEngineClient.start(args.engine)
        # This replica's prefix cache as its engine reports it, for the request router.
        self._cache_view = PrefixRouter(1)
        self.engine.on_batch = self._on_engine_batch
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        info = self.engine.model_info
        self.metrics = FrontendMetrics(served_model_name(args, info), info["max_model_len"],
                                       engine=self.replica_id)
        self.metrics.record_kv_pool(info)
        RayMetricsMirror().attach(self.metrics)
        self.num_streams = 0  # generate calls taken (a test's view of where requests went)
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_engine())
        logger.info("raypaged engine replica %s ready (%d KV blocks of %d, tp %d)", self.replica_id,
                    info["num_blocks"], info["block_size"], info["tensor_parallel_size"])

    # ---- what the ingress calls ---------------------------------------------------------------
    async def generate(self, request: Request, timeout_s: float | None = None,
                       route: RouteHint | None = None) -> AsyncIterator[str | EngineCoreOutput]:
        """This replica's id first (the ingress aborts and pins by it), then the request's
        records. Errors (InvalidRequestError, QueueFullError, EngineDeadError, …) reach the
        caller wrapped in Ray's RayTaskError."""
        self.num_streams += 1
        yield self.replica_id
        async with contextlib.aclosing(self.engine.generate(request, timeout_s)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str, route: RouteHint | None = None) -> None:
        await self.engine.abort(request_id)

    def model_info(self, route: RouteHint | None = None) -> dict[str, Any]:
        return self.engine.model_info

    # ---- Serve's calls, operations -------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve replaces a replica whose engine is gone (after a few failed checks in a row,
        serve/app.py's period apart; the ingress stops routing to it before, from its routing
        stats or the first call it lost: serve/replica_quarantine.py)."""
        if not self.engine.is_alive:
            raise RuntimeError("the engine is gone")

    def _on_engine_batch(self, events: list[int], load: EngineLoad | None) -> None:
        self._cache_view.apply_events(0, events)
        if load is not None:
            self._cache_view.update_load(0, load)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router (serve/prefix_request_router.py) reads of this replica; a
        dead engine is reported at once (the router holds the replica out of routing)."""
        return routing_stats(self._cache_view.replicas[0], engine_alive=self.engine.is_alive)

    async def engine_stats(self, route: RouteHint | None = None) -> dict[str, Any]:
        stats = await self.engine.actor.stats.remote()
        kv = stats["scheduler"].kv_cache
        return {"replica": self.replica_id, "actor_name": ray.get_runtime_context().get_actor_name(),
                "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                "num_blocks": kv.num_blocks, "num_free_blocks": kv.num_free_blocks,
                "prefix_cache_hits": kv.prefix_cache_hits, "num_streams": self.num_streams}

    def engine_actor(self, route: RouteHint | None = None) -> Any:
        """The engine actor's handle (a fault test kills it)."""
        return self.engine.actor

    def metrics_text(self, route: RouteHint | None = None) -> str:
        return generate_latest(self.metrics.registry).decode()

    async def _poll_engine(self) -> None:
        while self.engine.is_alive:
            try:
                stats = await self.engine.actor.stats.remote()
                self.metrics.record_engine_stats(stats["scheduler"])
            except Exception:  # the pump notices a dead engine; here a missed poll is all
                logger.debug("engine stats poll failed", exc_info=True)
            await asyncio.sleep(self.args.stats_interval_s)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: streams in flight were drained by Serve first."""
        self._poll_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._poll_task
        await self.engine.shutdown()
