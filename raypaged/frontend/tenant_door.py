"""The front door's per-tenant part, as GenerationService runs it for each request.

In order: `check` (before tokenizing: the tenant's limits that need no prompt), `apply` (the
prepared request takes its tenant's cache salt and priority, frontend/tenants.py), `admit` (the
limits with the prompt's tokens; a TenantPass for the request), then the pass's `on_tokens` as
tokens stream and its `close` when the stream ends. Every step counts into the tenant metrics:
admitted requests, prompt and generated tokens, refusals by reason, requests in flight.

A request without a tenant (a server without keys) passes every step untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from raypaged.core.request import Request
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.rate_limit import TenantGrant, TenantLimiter, TenantLimitError
from raypaged.frontend.tenants import Tenant

T = TypeVar("T")


class TenantPass:
    """One admitted request of a tenant (or of none: then it does nothing)."""

    def __init__(self, door: TenantDoor | None = None, tenant: Tenant | None = None,
                 grant: TenantGrant | None = None) -> None:
        self._door = door
        self._tenant = tenant
        self._grant = grant
        self._open = True

    def on_tokens(self, num_tokens: int) -> None:
        if self._grant is None or self._door is None or self._tenant is None:
            return
        self._grant.on_tokens(num_tokens)
        metrics = self._door.metrics()
        if metrics is not None and num_tokens > 0:
            metrics.record_tenant_tokens(self._tenant.name, generated=num_tokens)

    def close(self) -> None:
        """Idempotent."""
        if not self._open or self._grant is None or self._door is None or self._tenant is None:
            return
        self._open = False
        self._grant.close()
        self._door.count_in_flight(self._tenant)


class TenantDoor:
    def __init__(self, metrics: Callable[[], FrontendMetrics | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """metrics: the service's metrics, read at each use (they are set after it is made)."""
        self.metrics = metrics
        self._clock = clock
        self._limiters: dict[str, TenantLimiter] = {}

    def limiter(self, tenant: Tenant) -> TenantLimiter:
        limiter = self._limiters.get(tenant.name)
        if limiter is None or limiter.tenant != tenant:
            limiter = self._limiters[tenant.name] = TenantLimiter(tenant, self._clock)
        return limiter

    def check(self, tenant: Tenant | None) -> None:
        if tenant is not None:
            self._counted(tenant, self.limiter(tenant).check)

    @staticmethod
    def apply(tenant: Tenant | None, request: Request) -> None:
        if tenant is not None:
            request.cache_salt = tenant.cache_salt(request.cache_salt)
            request.priority = tenant.priority_for(request.priority)

    def admit(self, tenant: Tenant | None, num_prompt_tokens: int) -> TenantPass:
        if tenant is None:
            return TenantPass()
        limiter = self.limiter(tenant)
        grant = self._counted(tenant, lambda: limiter.admit(num_prompt_tokens))
        metrics = self.metrics()
        if metrics is not None:
            metrics.record_tenant_admitted(tenant.name, num_prompt_tokens)
        self.count_in_flight(tenant)
        return TenantPass(self, tenant, grant)

    def refused(self, tenant: Tenant | None, reason: str) -> None:
        """A request of `tenant` refused for `reason` elsewhere (the overload shedder)."""
        metrics = self.metrics()
        if tenant is not None and metrics is not None:
            metrics.record_tenant_refused(tenant.name, reason)

    def count_in_flight(self, tenant: Tenant) -> None:
        metrics = self.metrics()
        if metrics is not None:
            metrics.record_tenant_in_flight(tenant.name, self.limiter(tenant).in_flight)

    def _counted(self, tenant: Tenant, check: Callable[[], T]) -> T:
        try:
            return check()
        except TenantLimitError as e:
            self.refused(tenant, e.reason)
            raise
