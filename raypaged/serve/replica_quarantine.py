"""ReplicaQuarantine: the engine replicas that no new call of this process goes to.

A replica whose engine died (its actor SIGKILLed, or it gave up on its workers) stays in Serve's
replica set until Serve's health check has failed enough times in a row to replace it — seconds
in which Serve's router still offers it, and every call placed there fails and is resumed on
another replica (serve/engine_pool.py). A stream's own `RouteHint.avoid` (serve/route_hint.py)
covers only the replicas that stream lost; this is the pool-wide set, shared by every stream of
the ingress's process and read by the engine deployment's router
(serve/prefix_request_router.py), which runs in the same process.

A replica is held from the first sign that its engine is gone:

- a call of the engine pool failed with its engine dead or its actor gone (`hold`, by the pool);
- its routing stats, polled every second, report its engine dead (`note_stats`, by the router):
  this catches a dead engine before any call is lost to it.

It is released when Serve's replica set no longer holds it (`retain`, by the router as the set
changes: the replacement has another id), or when it answers again: fresh routing stats report
a live engine (an actor that was only unreachable a moment). "Fresh": the third snapshot seen
after the hold, not the first — a poll answered just before the engine died can arrive after the
hold, and must not release it.

Pinned calls (aborts, a stats read) are not affected: they name their replica.

Replicas are named by Serve's unique replica id (random, unique across deployments), so one
process-wide instance (`process_quarantine()`) serves every pool and router of the process.
Thread-safe: Serve may run its routers on a loop of their own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Snapshots seen after a hold before a live-engine report releases it (the first may be stale).
FRESH_SNAPSHOTS = 3


@dataclass
class _Hold:
    reason: str
    snapshots_alive: int = 0  # live-engine snapshots seen since the hold


class ReplicaQuarantine:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Hold] = {}
        self.num_held = 0  # holds made so far (a replica held twice counts twice)

    def hold(self, replica: str, reason: str) -> bool:
        """No new call goes to `replica` until it is released; True if it was not held before."""
        with self._lock:
            if replica in self._held:
                return False
            self._held[replica] = _Hold(reason)
            self.num_held += 1
        logger.warning("engine replica %s held out of routing: %s", replica, reason.splitlines()[0] if reason else "")
        return True

    def release(self, replica: str) -> None:
        with self._lock:
            hold = self._held.pop(replica, None)
        if hold is not None:
            logger.info("engine replica %s back in routing", replica)

    def held(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._held)

    def __contains__(self, replica: object) -> bool:
        with self._lock:
            return replica in self._held

    def note_stats(self, replica: str, engine_alive: bool) -> None:
        """A new routing-stats snapshot of `replica`: a dead engine holds it; the FRESH_SNAPSHOTS-th
        live-engine snapshot since its hold releases it (a dead one in between starts over)."""
        if not engine_alive:
            with self._lock:
                hold = self._held.get(replica)
                if hold is not None:
                    hold.snapshots_alive = 0
                    return
            self.hold(replica, "its routing stats report its engine dead")
            return
        with self._lock:
            hold = self._held.get(replica)
            if hold is None:
                return
            hold.snapshots_alive += 1
            if hold.snapshots_alive < FRESH_SNAPSHOTS:
                return
        self.release(replica)

    def retain(self, known: Iterable[str], current: Iterable[str]) -> None:
        """Serve's replica set changed: of the replicas a router `known`s, those no longer
        `current` are released (gone for good; their replacements have new ids). Replicas the
        caller never knew are left alone: another router's."""
        gone = set(known) - set(current)
        with self._lock:
            for replica in gone & self._held.keys():
                del self._held[replica]


_PROCESS_QUARANTINE = ReplicaQuarantine()


def process_quarantine() -> ReplicaQuarantine:
    """The one instance of this process, which the ingress's engine pool and its handle's router
    share. A function, not a module constant the router imports: Serve ships the router's module
    to the replica by value (cloudpickle), which would give the router a copy of a constant it
    imported; this module travels by reference, so the call finds the process's instance."""
    return _PROCESS_QUARANTINE
