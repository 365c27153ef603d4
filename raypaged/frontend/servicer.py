"""The grpc.aio servicer: GenerationService behind raypaged.v1.RaypagedService, errors as statuses.

With API keys (a TenantRegistry) each call's tenant is read from its `authorization` metadata
(the interceptor of frontend/auth.py already refused calls without a known key) and handed to
the service: its limits, cache salt and priority (frontend/tenant_door.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from raypaged.frontend.errors import retry_after_header, retry_after_s, status_for
from raypaged.frontend.service import GenerationService
from raypaged.frontend.tenants import Tenant, TenantRegistry
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc


class RaypagedServicer(pb_grpc.RaypagedServiceServicer):
    def __init__(self, service: GenerationService, tenants: TenantRegistry | None = None) -> None:
        self.service = service
        self.tenants = tenants

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        tenant = await self._tenant(context)
        try:
            # Closed explicitly when the call ends early, so the request is aborted in the
            # engine at once rather than whenever the generator is collected.
            async with contextlib.aclosing(self.service.generate(request, tenant=tenant)) as responses:
                async for response in responses:
                    yield response
        except Exception as e:  # CancelledError (a cancelled call) is not an Exception: it passes
            await self._abort(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        tenant = await self._tenant(context)
        try:
            return await self.service.abort(request, tenant)
        except Exception as e:
            await self._abort(context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.service.model_info()

    async def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        if self.tenants is None:
            return None
        tenant = self.tenants.from_metadata(context.invocation_metadata())
        if tenant is None:  # the interceptor lets none through; a server built without it might
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        return tenant

    # context.abort always raises (grpc's NoReturn), which mypy cannot see: grpc ships no types.
    async def _abort(self, context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:  # type: ignore[misc]
        code, message = status_for(error)
        retry_after = retry_after_s(error)
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after", retry_after_header(retry_after)),))
        if self.service.metrics is not None:
            self.service.metrics.record_error(code.name)
        await context.abort(code, message)
