"""Bringing the engine back after its actor died, or after it gave up on its workers.

The frontend notices a dead engine at once (the engine client's pump fails every stream with
EngineDeadError, so clients get UNAVAILABLE, never a hang) and turns health NOT_SERVING. The
supervisor then removes what is left of the old engine (its actor, its workers' placement group)
and starts a new one with exponential backoff; the server swaps it in and turns SERVING again.
Streams in flight wait for it and go on there (frontend/replay.py), for at most
`recovery_timeout_s`; past that they end with UNAVAILABLE.

An engine that keeps dying soon after it starts backs off further each time (a crash loop must
not hammer the cluster); one that stayed up for `stable_after_s` starts the next restart afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from raypaged.engine.client import AsyncEngineClient

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[AsyncEngineClient]]


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    # An engine that lived at least this long was healthy: its death starts a fresh backoff.
    stable_after_s: float = 120.0
    # Restart attempts in a row (each failing to start an engine) before the supervisor stops
    # trying and the server stays NOT_SERVING. None: keep trying.
    max_attempts: int | None = None
    retire_timeout_s: float = 30.0  # how long the old engine's shutdown may take
    # How long streams in flight (and new requests) wait for a new engine after the engine is
    # found dead, to go on there; past it they end with UNAVAILABLE. 0: they end at once.
    recovery_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if not 0 <= self.recovery_timeout_s < float("inf"):
            raise ValueError("recovery_timeout_s must be >= 0 and finite (0: no replay)")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (or None: keep trying)")


class EngineSupervisor:
    def __init__(self, factory: EngineFactory, policy: RestartPolicy = RestartPolicy()) -> None:
        self.factory = factory
        self.policy = policy
        self.num_restarts = 0  # engines started to replace a dead one
        self.num_failed_attempts = 0  # attempts whose new engine did not start
        self._engine_started_at = time.monotonic()
        self._next_delay_s = 0.0  # the first restart after a healthy run waits for nothing

    async def replace(self, dead: AsyncEngineClient) -> AsyncEngineClient | None:
        """Retire the dead engine and start a new one: the new engine's client, or None once
        max_attempts in a row failed. Cancel the caller's task to stop trying."""
        await self._retire(dead)
        if time.monotonic() - self._engine_started_at >= self.policy.stable_after_s:
            self._next_delay_s = 0.0
        attempt = 0
        while self.policy.max_attempts is None or attempt < self.policy.max_attempts:
            attempt += 1
            delay = self._next_delay_s
            self._next_delay_s = min(max(2 * delay, self.policy.initial_backoff_s),
                                     self.policy.max_backoff_s)
            if delay > 0:
                logger.info("restarting the engine in %.1f s (attempt %d)", delay, attempt)
                await asyncio.sleep(delay)
            try:
                engine = await self._start_engine()
            except Exception as e:  # noqa: BLE001 - any failure to start is one failed attempt
                self.num_failed_attempts += 1
                logger.error("engine restart attempt %d failed: %s: %s", attempt, type(e).__name__, e)
                continue
            self.num_restarts += 1
            self._engine_started_at = time.monotonic()
            logger.info("engine restarted (%d restarts so far)", self.num_restarts)
            return engine
        logger.error("gave up restarting the engine after %d attempts in a row", attempt)
        return None

    async def _start_engine(self) -> AsyncEngineClient:
        """The factory, run to its end even when the caller is cancelled (a server shutting down
        mid-restart): an engine half made would outlive everyone; a whole one is shut down."""
        starting = asyncio.ensure_future(self.factory())
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                engine = await starting
                await engine.shutdown()
            raise

    async def _retire(self, dead: AsyncEngineClient) -> None:
        """Kill what is left of it: a live actor that gave up on its workers, or the placement
        group of a dead one, would keep holding the resources the new engine needs."""
        await dead.shutdown(timeout_s=self.policy.retire_timeout_s)
