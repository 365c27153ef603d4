"""The ingress deployment: holds the client's connection, OpenAI HTTP and raypaged.v1 gRPC.

The app is two deployments. This one answers the clients: FastAPI's OpenAI routes (mounted with
serve.ingress) and the raypaged.v1 methods Serve's gRPC proxy calls by the RPC's name
(`Generate`, …). Its GenerationService does everything above the tokens — validation,
tokenization, API keys and tenant limits, load shedding, detokenization, stop strings, the
frontend's metrics — over serve/engine_pool.py's ServeEnginePool, which streams token-level
records from the engine deployment's replicas (serve/engine_deployment.py, one engine each)
through a DeploymentHandle. Because this replica reads the body before any engine is chosen,
every request (HTTP too) is placed by its prompt's cached prefix (serve/prefix_request_router.py),
and an engine replica that dies mid-stream costs the client nothing: the pool goes on on another.

A request whose client goes away (HTTP disconnect, gRPC cancel) is cancelled by Serve; leaving
GenerationService.generate then cancels the engine call, which aborts it in the engine.

With `api_keys_file`, both transports need a known key (HTTP `Authorization: Bearer <key>`, gRPC
metadata `authorization`): 401 / UNAUTHENTICATED otherwise. Each key's limits are counted here,
per ingress replica: whatever the number of engine replicas, a key gets its limits once per
ingress replica (`ingress_num_replicas`, default 1: exactly its limits).
"""

# No `from __future__ import annotations` here: serve.ingress rebuilds the route methods, and
# FastAPI must see the body models as real classes, not strings, to read them from the body.
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from raypaged.frontend.load_shedding import OverloadPolicy
from raypaged.frontend.malformed import refuse_undecodable
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.service import GenerationService
from raypaged.frontend.tenants import Tenant, unused_priorities_warning
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.args import ServeAppArgs
from raypaged.serve.engine_deployment import served_model_name
from raypaged.serve.engine_pool import ServeEnginePool
from raypaged.serve.openai_api import Authorization, OpenAIFrontDoor, RequestTimeout, install_error_handlers
from raypaged.serve.openai_errors import unauthenticated
from raypaged.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from raypaged.serve.ray_metrics import RayMetricsMirror

logger = logging.getLogger(__name__)

api = FastAPI(title="raypaged", description="OpenAI-compatible API of raypaged on Ray Serve")
install_error_handlers(api)


@serve.ingress(api)
class IngressDeployment:
    async def __init__(self, args: ServeAppArgs, engine: DeploymentHandle) -> None:  # type: ignore[misc]
        from transformers import AutoTokenizer

        self.args = args
        self.engine = await ServeEnginePool.start(engine, recovery_timeout_s=args.replica_recovery_timeout_s)
        info = self.engine.model_info
        tokenizer = AutoTokenizer.from_pretrained(args.engine.model_settings.tokenizer or info["model_dir"])
        names = args.served_model_names
        self.service = GenerationService(self.engine, tokenizer, model_name=served_model_name(args, info),
                                         limits=args.limits, overload=OverloadPolicy.from_config(args.engine))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._headers = {"x-raypaged-replica": self.replica_id}  # which ingress replica answered
        self.metrics = FrontendMetrics(self.service.model_name, info["max_model_len"], engine=self.replica_id)
        self.metrics.record_kv_pool(info)
        RayMetricsMirror().attach(self.metrics)
        self.service.metrics = self.metrics
        self.tenants = args.api_keys()
        unused = unused_priorities_warning(self.tenants, args.engine.scheduler.scheduling_policy)
        if unused is not None:
            logger.warning("%s", unused)
        self.openai = OpenAIFrontDoor(self.service, self.metrics, self._headers, model_names=names,
                                      parsing=args.chat_parsing, tenants=self.tenants)
        logger.info("raypaged ingress %s ready: %s", self.replica_id, self.service.model_name)

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
        """Reaches one ingress replica: a request streaming through another (ingress_num_replicas
        > 1) answers NOT_FOUND here. Whichever engine replica streams it, the abort reaches it."""
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

    # ---- operations: handle calls -------------------------------------------------------------
    def ingress_stats(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "in_flight": self.service.num_in_flight,
                "resumed": self.engine.num_resumed, "held_out": sorted(self.engine.held_out)}

    def metrics_text(self) -> str:
        """This replica's metrics in Prometheus' text format (Prometheus itself scrapes Ray's
        export of them: serve/ray_metrics.py)."""
        return generate_latest(self.metrics.registry).decode()
