"""The chaos soak's "replica killed" fault: on a `ServeTarget` (benchmarks/lib/chaos_serve.py),
the actor of an engine replica that is streaming requests is killed (`ray.kill`, no restart:
its process and its engine with it). The ingress carries every stream it served over to another
replica (serve/engine_pool.py: no gap, no repeat, n > 1 samples each as a call of its own) and
Serve's controller starts a replica in its place. Recovered once the victim is gone, as many
engine replicas as before answer, and a probe is served: the time to recover is mostly the new
replica's start (its engine, its model).

Registered as "replica_killed" on import (benchmarks/chaos.py imports it).
"""

from __future__ import annotations

from benchmarks.lib.chaos_faults import FAULT_KINDS, FaultKind, register
from benchmarks.lib.chaos_serve import ServeTarget


class ReplicaKilled(FaultKind):
    name = "replica_killed"

    def __init__(self, target: ServeTarget) -> None:
        if not isinstance(target, ServeTarget):
            raise TypeError(f"replica_killed needs a Serve target (ServeTarget), not {type(target).__name__}")
        super().__init__(target)
        self.target: ServeTarget = target
        self._victim: str | None = None

    def inject(self, rng_value: float) -> str:
        """`rng_value` picks among the replicas with requests running (any, when none has)."""
        victim, running, alive = self.target.kill_replica(rng_value)
        self._victim = victim
        return f"ray.kill engine replica {victim} of {alive} ({running} requests running)"

    def recovered(self) -> bool:
        return (self._victim is not None and self._victim not in self.target.engine_replicas()
                and self.target.serving())


# The kinds that need a `ServeTarget` (benchmarks/chaos.py picks the target by them).
SERVE_KINDS = frozenset({ReplicaKilled.name})

if ReplicaKilled.name not in FAULT_KINDS:
    register(ReplicaKilled.name, ReplicaKilled)
