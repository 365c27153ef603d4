"""The Ray Serve deployment: one replica = one engine, served over OpenAI HTTP and raypaged.v1 gRPC.

The replica starts its engine actor (and, at tensor_parallel_size > 1, the TP workers) inside
its own placement group (serve/placement.py), then wraps it in the gRPC frontend's
GenerationService: validation, detokenization, stop strings and metrics are the same code on
both transports. HTTP routes live on `api` (FastAPI, mounted with serve.ingress); gRPC calls
arrive through Serve's gRPC proxy, which calls the method named like the RPC (`Generate`, …).

A request whose client goes away (HTTP disconnect, gRPC cancel) is cancelled by Serve; leaving
GenerationService.generate then aborts it in the engine, which frees its KV blocks.

With `api_keys_file`, both transports need a known key (HTTP `Authorization: Bearer <key>`, gRPC
metadata `authorization`): 401 / UNAUTHENTICATED otherwise. Each key's limits are this
replica's (N replicas let a key through up to N times its limits).
"""

# No `from __future__ import annotations` here: serve.ingress rebuilds the route methods, and
# FastAPI must see the body models as real classes, not strings, to read them from the body.
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from ray import serve

from raypaged.core.outputs import EngineLoad
from raypaged.engine.client import AsyncEngineClient
from raypaged.frontend.load_shedding import OverloadPolicy
from raypaged.frontend.malformed import refuse_undecodable
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.prefix_router import PrefixRouter
from raypaged.frontend.service import GenerationService
from raypaged.frontend.tenants import Tenant, unused_priorities_warning
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.args import ServeAppArgs
from raypaged.serve.openai_api import Authorization, OpenAIFrontDoor, RequestTimeout, install_error_handlers
from raypaged.serve.openai_errors import unauthenticated
from raypaged.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from raypaged.serve.prefix_request_router import routing_value
from raypaged.serve.ray_metrics import RayMetricsMirror

logger = logging.getLogger(__name__)

api = FastAPI(title="raypaged", description="OpenAI-compatible API of a raypaged replica")
install_error_handlers(api)


@serve.ingress(api)
class RaypagedDeployment:
    async def __init__(self, args: ServeAppArgs) -> None:  # type: ignore[misc]  # Serve awaits it
        from transformers import AutoTokenizer

        config = args.engine
        self.args = args
        self.engine = await AsyncEngineClient.start(config)
        # This replica's prefix cache as its engine reports it, for Serve's request router.
        self._cache_view = PrefixRouter(1)
        self.engine.on_batch = self._on_engine_batch
        info = self.engine.model_info
        tokenizer = AutoTokenizer.from_pretrained(config.model_settings.tokenizer or info["model_dir"])
        names = args.served_model_names
        model_name = names[0] if names else ("demo" if config.model_settings.model is None else None)
        self.service = GenerationService(self.engine, tokenizer, model_name=model_name, limits=args.limits,
                                         overload=OverloadPolicy.from_config(config))
        self.replica_id = serve.get_replica_context().replica_tag
        self._headers = {"x-raypaged-replica": self.replica_id}  # which replica answered
        self.metrics = FrontendMetrics(self.service.model_name, info["max_model_len"], engine=self.replica_id)
        self.metrics.record_kv_pool(info)
        RayMetricsMirror().attach(self.metrics)
        self.service.metrics = self.metrics
        self.tenants = args.api_keys()
        unused = unused_priorities_warning(self.tenants, config.scheduler.scheduling_policy)
        if unused is not None:
            logger.warning("%s", unused)
        self.openai = OpenAIFrontDoor(self.service, self.metrics, self._headers, model_names=names,
                                      parsing=args.chat_parsing, tenants=self.tenants)
        self._poll_task = asyncio.get_running_loop().create_task(self._poll_engine())
        logger.info("raypaged replica %s ready: %s (%d KV blocks of %d, tp %d)", self.replica_id,
                    self.service.model_name, info["num_blocks"], info["block_size"],
                    info["tensor_parallel_size"])

    @property
    def model_name(self) -> str:
        return self.service.model_name

    # ---- OpenAI HTTP: serve/openai_api.py ------------------------------------------------------
    @api.get("/v1/models")
    async def models(self, authorization: Authorization = None) -> dict[str, Any]:
        return await self.openai.models(authorization)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return await self.openai.health()

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, timeout: RequestTimeout = None,
                          authorization: Authorization = None) -> Any:
        return await self.openai.completions(body, timeout, authorization)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, timeout: RequestTimeout = None,
                               authorization: Authorization = None) -> Any:
        return await self.openai.chat_completions(body, timeout, authorization)

    # ---- raypaged.v1 through Serve's gRPC proxy ------------------------------------------------
    # A request whose bytes did not parse arrives as an Undecodable (serve/grpc_ingress.py).
    async def Generate(self, request: pb.GenerateRequest,
                       grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            tenant = self._grpc_tenant(grpc_context)
            refuse_undecodable(request)
            async for response in self.service.generate(request, tenant=tenant):
                yield response
        except Exception as e:
            self._grpc_refused(grpc_context, e)
            raise

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        """Reaches one replica: a request streaming on another answers NOT_FOUND here."""
        try:
            tenant = self._grpc_tenant(grpc_context)
            refuse_undecodable(request)
            return await self.service.abort(request, tenant)
        except Exception as e:
            self._grpc_refused(grpc_context, e)
            raise

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context=None) -> pb.ModelInfo:
        try:
            self._grpc_tenant(grpc_context)
            refuse_undecodable(request)
        except Exception as e:
            self._grpc_refused(grpc_context, e)
            raise
        return self.service.model_info()

    def _grpc_tenant(self, grpc_context) -> Tenant | None:
        """The caller's tenant from its metadata (None without keys); no known key: refused."""
        if self.tenants is None:
            return None
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
        tenant = self.tenants.from_metadata(metadata)
        if tenant is None:
            raise unauthenticated()
        return tenant

    def _grpc_refused(self, grpc_context, error: Exception) -> None:
        """Serve's proxy answers with the code set on the context when the method then raises."""
        refusal = self.openai.refused(error)
        if grpc_context is not None:
            grpc_context.set_code(refusal.grpc_code)
            grpc_context.set_details(refusal.message)
            retry_after = (refusal.headers or {}).get("Retry-After")
            if retry_after is not None:
                grpc_context.set_trailing_metadata((("retry-after", retry_after),))

    # ---- operations: Serve calls, handle calls -------------------------------------------------
    async def check_health(self) -> None:
        """Serve restarts a replica whose engine is gone."""
        if not self.engine.is_alive:
            raise RuntimeError("the engine is gone")

    def _on_engine_batch(self, events: list[int], load: EngineLoad | None) -> None:
        self._cache_view.apply_events(0, events)
        if load is not None:
            self._cache_view.update_load(0, load)

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's request router (serve/prefix_request_router.py) reads of this replica."""
        state = self._cache_view.replicas[0]
        load = state.load or EngineLoad(0, 0, 0.0)
        return {"cached": [routing_value(v) for v in state.cached], "num_waiting": load.num_waiting,
                "num_running": load.num_running, "kv_usage": load.kv_usage}

    async def engine_stats(self) -> dict[str, Any]:
        stats = await self.engine.actor.stats.remote()
        return {"replica": self.replica_id, "num_running": stats["num_running"],
                "num_waiting": stats["num_waiting"], "num_blocks": stats["scheduler"].kv_cache.num_blocks,
                "num_free_blocks": stats["scheduler"].kv_cache.num_free_blocks,
                "prefix_cache_hits": stats["scheduler"].kv_cache.prefix_cache_hits,
                "in_flight": self.service.num_in_flight}

    def metrics_text(self) -> str:
        """This replica's metrics in Prometheus' text format (Prometheus itself scrapes Ray's
        export of them: serve/ray_metrics.py)."""
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

