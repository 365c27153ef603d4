"""The API's logic, free of any transport: GenerateRequest in, GenerateResponse messages out.

The gRPC servicer wraps it (frontend/servicer.py), and so can Ray Serve's gRPC proxy or an HTTP
layer: errors leave as exceptions, which frontend/errors.py maps to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from raypaged.core.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
    UnknownRequestError,
)
from raypaged.core.sample_ids import sample_id
from raypaged.engine.interface import EngineClient
from raypaged.frontend.errors import ServerShuttingDownError
from raypaged.frontend.load_shedding import LoadShedder, OverloadPolicy, ShedError
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.tenant_door import TenantDoor
from raypaged.frontend.tenants import Tenant
from raypaged.frontend.validation import ModelLimits, RequestLimits, prepare_request
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.text.output_processor import RequestOutputProcessor

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GenerationService:
    def __init__(self, engine: EngineClient, tokenizer: Any, *, model_name: str | None = None,
                 limits: RequestLimits = RequestLimits(),  # noqa: B008 (frozen: one shared instance is safe)
                 metrics: FrontendMetrics | None = None, overload: OverloadPolicy | None = None) -> None:
        """overload: when to shed new requests and the default request timeout (None: never
        shed, no timeout)."""
        self.engine = engine
        self.shedder = LoadShedder(overload or OverloadPolicy())
        self.tokenizer = tokenizer
        info = engine.model_info
        self.model_name = model_name or os.path.basename(os.path.normpath(info["model_dir"]))
        self.model = ModelLimits.from_model_info(info)
        self.limits = limits
        self.metrics = metrics
        self.tenants = TenantDoor(lambda: self.metrics)  # per-tenant limits, salt, priority
        self.accepting = True
        # Group ids of the requests being streamed → their tenant's name ("" for none).
        self._in_flight: dict[str, str] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop_waiting = asyncio.Event()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def generate(self, message: pb.GenerateRequest, timeout_s: float | None = None,
                       tenant: Tenant | None = None) -> AsyncGenerator[pb.GenerateResponse, None]:
        """timeout_s: this request's own timeout (default: the server's request_timeout_s);
        past it the request is aborted in the engine and RequestTimeoutError raised. Shed
        requests raise ShedError (a QueueFullError) before anything reaches the engine.
        tenant: whose request it is (frontend/tenant_door.py: limits, cache salt, priority);
        one over its limits raises TenantLimitError (a QueueFullError) the same way."""
        if not self.accepting:
            raise ServerShuttingDownError("the server is shutting down and accepts no new requests")
        if not self.engine.is_alive:
            raise EngineDeadError("the engine is gone; the server cannot serve requests")
        self.tenants.check(tenant)
        self._shed_check(lambda: self.shedder.check(self.engine.load), tenant)
        prepared = prepare_request(message, self.tokenizer, self.model, self.limits)
        request = prepared.request
        self.tenants.apply(tenant, request)
        request_id = request.group_id
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if timeout_s is None:
            timeout_s = self.shedder.policy.request_timeout_s
        processor = RequestOutputProcessor(request, self.tokenizer, prepared.skip_special_tokens)
        # Last before the stream's try: an admission is given back only by its finally.
        admission = self._shed_check(lambda: self.shedder.admit(request.num_prompt_tokens, self.engine.load),
                                     tenant)
        try:
            tenant_pass = self.tenants.admit(tenant, request.num_prompt_tokens)
        except BaseException:
            admission.close(completed=False)
            raise
        tracker = None
        if self.metrics is not None:
            tracker = self.metrics.track(request.num_prompt_tokens, request.sampling_params.n,
                                         request.sampling_params.max_tokens)
        self._in_flight[request_id] = tenant.name if tenant is not None else ""
        self._idle.clear()
        try:
            async with contextlib.aclosing(self.engine.generate(request, timeout_s)) as outputs:
                async for out in outputs:
                    admission.first_output()
                    processed = processor.process(out)
                    if processed is None:
                        continue
                    tenant_pass.on_tokens(processed.num_new_tokens)
                    if tracker is not None:
                        tracker.on_tokens(out.sample_index, processed.num_new_tokens, out.queue_time_s)
                        if processed.finish_reason is not None:
                            tracker.on_finished(out.sample_index, processed.finish_reason)
                    response = pb.GenerateResponse(request_id=request_id, outputs=[processed.delta])
                    if processor.finished:
                        response.usage.CopyFrom(processor.usage())
                    yield response
                    if processor.finished:
                        if processor.samples_stopped_by_strings():
                            return  # leaving aclosing aborts the samples the engine still runs
                        continue  # the engine finished them all: its stream ends by itself
                    just_stopped = processor.samples[out.sample_index].stopped_by_string
                    if just_stopped and processed.finish_reason is not None:
                        # Other samples go on; end this one in the engine (a sample id names
                        # one sample, sample 0 included).
                        await self.engine.abort(sample_id(out.group_id, out.sample_index))
        except QueueFullError as e:  # the engine's own bound, past the front door's check
            if e.retry_after_s is None:
                e.retry_after_s = self.shedder.retry_after_s()
            if self.metrics is not None:
                self.metrics.record_shed("waiting_requests")
            self.tenants.refused(tenant, "waiting_requests")
            raise
        except (asyncio.CancelledError, GeneratorExit, RequestTimeoutError):
            # The client cancelled or its deadline passed: the handler is cancelled while it
            # waits, or closed (GeneratorExit) while it yields; or the server's timeout.
            if tracker is not None:
                for index in processor.unfinished_sample_indices():
                    tracker.on_finished(index, "abort")
            raise
        finally:
            admission.close(completed=processor.finished)
            tenant_pass.close()
            self._in_flight.pop(request_id, None)
            if not self._in_flight:
                self._idle.set()

    def _shed_check(self, check: Callable[[], T], tenant: Tenant | None) -> T:
        try:
            return check()
        except ShedError as e:
            if self.metrics is not None:
                self.metrics.record_shed(e.reason)
            self.tenants.refused(tenant, e.reason)
            raise

    async def abort(self, message: pb.AbortRequest, tenant: Tenant | None = None) -> pb.AbortResponse:
        """tenant: who asks; another tenant's request is unknown to it, as one not in flight."""
        owner = self._in_flight.get(message.request_id)
        if owner is None or (tenant is not None and owner != tenant.name):
            raise UnknownRequestError(f"no request {message.request_id!r} is in flight on this server")
        await self.engine.abort(message.request_id)
        return pb.AbortResponse()

    def model_info(self) -> pb.ModelInfo:
        info = self.engine.model_info
        return pb.ModelInfo(
            name=self.model_name, architecture=info["architecture"],
            max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
            block_size=info["block_size"], num_blocks=info["num_blocks"],
            tensor_parallel_size=info["tensor_parallel_size"],
            eos_token_ids=list(info["eos_token_ids"]))

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait up to timeout_s (or until stop_waiting) for those in
        flight to finish; True when none is left."""
        self.accepting = False
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._stop_waiting.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return not self._in_flight

    def stop_waiting(self) -> None:
        """Cut a drain short (a second Ctrl-C)."""
        self._stop_waiting.set()
