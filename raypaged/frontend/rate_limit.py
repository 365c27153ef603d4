"""Per-tenant limits at the front door: requests per second, tokens per minute, requests in flight.

Pure bookkeeping over a clock (injected: tests drive a fake one). Each limited measure is a
token bucket that refills continuously:

- requests_per_second: a bucket of `burst` requests refilled at the rate; a request takes one.
- tokens_per_minute: a bucket of tokens_per_minute tokens refilled at a sixtieth of that a
  second. A request is admitted when the bucket holds its prompt tokens (or is full, for a
  prompt larger than the whole bucket), takes them at once, then takes each token it generates
  as it streams. Generated tokens are taken whatever the level: a long answer runs the bucket
  into debt, and the key's next requests wait until it has paid it back.
- max_concurrent: requests admitted and not yet closed.

A refusal is a TenantLimitError (RESOURCE_EXHAUSTED / HTTP 429) naming the limit, with a
Retry-After: when the bucket will hold what was missing (at least 1 s); 1 s for max_concurrent,
which no clock can predict. Nothing is taken from any bucket for a refused request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from raypaged.core.errors import QueueFullError
from raypaged.frontend.tenants import Tenant

REASONS = ("requests_per_second", "tokens_per_minute", "max_concurrent")
MIN_RETRY_AFTER_S = 1.0


class TenantLimitError(QueueFullError):
    """A request over its tenant's limit; reason is one of REASONS."""

    # Defaults: Ray rebuilds an exception that crossed processes from its message alone.
    def __init__(self, message: str, reason: str = "requests_per_second", tenant: str = "",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason
        self.tenant = tenant


class TokenBucket:
    """capacity units, refilled at rate_per_s, full at first; the level may go below zero."""

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._level = capacity
        self._at = now

    def level(self, now: float) -> float:
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate_per_s)
            self._at = now
        return self._level

    def take(self, amount: float, now: float) -> None:
        self._level = self.level(now) - amount

    def wait_s(self, needed: float, now: float) -> float:
        """Seconds until the bucket holds `needed` (0 when it does now)."""
        return max(0.0, (needed - self.level(now)) / self.rate_per_s)


class TenantLimiter:
    """One tenant's limits and in-flight count; one per tenant, shared by all its requests."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant = tenant
        self._clock = clock
        limits = tenant.limits
        now = clock()
        self.requests = None if limits.requests_per_second is None else \
            TokenBucket(limits.requests_per_second, limits.request_burst, now)
        self.tokens = None if limits.tokens_per_minute is None else \
            TokenBucket(limits.tokens_per_minute / 60.0, limits.tokens_per_minute, now)
        self.in_flight = 0

    def check(self) -> None:
        """TenantLimitError when a request would be refused whatever its prompt (called before
        tokenizing it): no request left in the bucket, none in flight to spare, tokens in debt."""
        self._raise_if_over(None)

    def admit(self, num_prompt_tokens: int) -> TenantGrant:
        """A grant for one request (its request, its prompt tokens and its place taken), or
        TenantLimitError with nothing taken."""
        self._raise_if_over(num_prompt_tokens)
        now = self._clock()
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(num_prompt_tokens, now)
        self.in_flight += 1
        return TenantGrant(self)

    def charge(self, num_tokens: int) -> None:
        """Generated tokens, taken whatever the level."""
        if self.tokens is not None and num_tokens > 0:
            self.tokens.take(num_tokens, self._clock())

    def _raise_if_over(self, num_prompt_tokens: int | None) -> None:
        limits, name, now = self.tenant.limits, self.tenant.name, self._clock()
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            raise TenantLimitError(
                f"tenant {name!r} has {self.in_flight} requests in flight, its limit (max_concurrent "
                f"{limits.max_concurrent})", "max_concurrent", name, MIN_RETRY_AFTER_S)
        if self.requests is not None and self.requests.level(now) < 1:
            raise TenantLimitError(
                f"tenant {name!r} is over its rate limit of {limits.requests_per_second:g} requests per "
                f"second (burst {limits.request_burst})", "requests_per_second", name,
                _retry_after(self.requests.wait_s(1, now)))
        if self.tokens is not None:
            # Before tokenizing, only a debt refuses; a prompt larger than the bucket needs it full.
            needed = 1 if num_prompt_tokens is None else min(num_prompt_tokens, self.tokens.capacity)
            if self.tokens.level(now) < needed:
                raise TenantLimitError(
                    f"tenant {name!r} is over its limit of {limits.tokens_per_minute} tokens per minute",
                    "tokens_per_minute", name, _retry_after(self.tokens.wait_s(needed, now)))


class TenantGrant:
    """One admitted request: its generated tokens are charged through it; close() (idempotent)
    gives its place back."""

    def __init__(self, limiter: TenantLimiter) -> None:
        self._limiter = limiter
        self._open = True

    def on_tokens(self, num_tokens: int) -> None:
        self._limiter.charge(num_tokens)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._limiter.in_flight -= 1


def _retry_after(wait_s: float) -> float:
    return max(MIN_RETRY_AFTER_S, float(math.ceil(wait_s)))
