"""The faults a chaos soak injects (benchmarks/chaos.py), each behind one seam: `FaultKind`.

A fault kind knows how to do one bad thing to a live server (`inject`) and how to tell, from
outside, that the server has come back from it (`recovered`): the soak injects on a seeded
schedule while its load runs, polls `recovered()` and reports the time to recover per kind.
Whether anything was lost is not the fault's business: every request's output is checked
against a fault-free reference run afterwards.

The kinds here need only the target's process session (benchmarks/lib/chaos_target.py
`ChaosTarget`): they find Ray's actor processes by their titles and signal them, as an OOM
killer or a wedged device would.

- `worker_sigkill`: a TP worker actor's process SIGKILLed (the engine restarts its group and
  recomputes; frontend streams see nothing);
- `engine_sigkill`: the engine actor's process SIGKILLed (the supervisor brings a new engine,
  frontend/replay.py carries every stream over to it);
- `worker_hang`: a TP worker SIGSTOPped, so its step never returns (the engine's step timeout
  declares the group hung and replaces it).

On the Serve target (several engine replicas) `engine_sigkill` hits one replica's engine: the
ingress carries its streams over to another replica and Serve replaces the replica.

Kinds that need more than one server process plug in with `register()` and get their own
target: `node_removed` (chaos_node.py, on chaos_cluster.py's multi-node cluster),
`replica_killed` (chaos_replica.py, on chaos_serve.py's Serve app).
"""

from __future__ import annotations

import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from benchmarks.lib.chaos_target import ChaosTarget

ENGINE_ACTOR = "ray::EngineActor"
WORKER_ACTOR = "ray::RayWorkerActor"


class FaultKind(ABC):
    """One kind of fault. `inject` does it once and returns at once (it does not wait for the
    server to notice); `recovered` is cheap, is polled every ~0.1 s after an injection, and is
    true once the server serves again as before (not merely answers health)."""

    name: str

    def __init__(self, target: Any) -> None:
        self.target = target

    @abstractmethod
    def inject(self, rng_value: float) -> str:
        """Do the fault; `rng_value` in [0, 1) picks among equal victims (the schedule's seed
        decides, so a run can be repeated). Returns what was done, for the report."""

    @abstractmethod
    def recovered(self) -> bool:
        """The server is whole again after the last `inject`."""

    def cleanup(self) -> None:
        """Undo what would outlive the run (a stopped process); the default has nothing."""
        return None


class _ProcessFault(FaultKind):
    """A fault on an actor process of a target's session; recovered once the victim is gone, as
    many processes of that actor class run as at injection time, and the target serves (its
    engines step again: what tells a restarted group or engine from one still restarting; other
    engines' processes, a Serve target's other replicas, stay as they were)."""

    actor = WORKER_ACTOR
    sig = signal.SIGKILL

    def __init__(self, target: ChaosTarget) -> None:
        super().__init__(target)
        self.target: ChaosTarget = target
        self._before: list[int] = []
        self._victim: int | None = None

    def inject(self, rng_value: float) -> str:
        self._before = self.target.pids_named(self.actor)
        if not self._before:
            raise RuntimeError(f"no {self.actor} process to fault (is the Ray executor on?)")
        victim = self._victim = self._before[int(rng_value * len(self._before))]
        os.kill(victim, self.sig)
        return f"{signal.Signals(self.sig).name} {self.actor} pid {victim} of {len(self._before)}"

    def recovered(self) -> bool:
        now = self.target.pids_named(self.actor)
        return len(now) >= len(self._before) and self._victim not in now and self.target.serving()


class WorkerSigkill(_ProcessFault):
    name = "worker_sigkill"


class EngineSigkill(_ProcessFault):
    name = "engine_sigkill"
    actor = ENGINE_ACTOR


class WorkerHang(_ProcessFault):
    """SIGSTOP: the process stays, holds its resources and answers nothing — a hang, not a
    crash. The engine's step timeout must find it; the group's restart kills it (SIGKILL reaches
    a stopped process)."""

    name = "worker_hang"
    sig = signal.SIGSTOP

    def cleanup(self) -> None:
        for pid in self._before:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:  # gone: killed by the restart, as it should be
                pass


FAULT_KINDS: dict[str, Callable[[Any], FaultKind]] = {
    kind.name: kind for kind in (WorkerSigkill, EngineSigkill, WorkerHang)}


def register(name: str, make: Callable[[Any], FaultKind]) -> None:
    """Adds a fault kind (e.g. "replica_killed", "node_removed") the soak can schedule by name."""
    if name in FAULT_KINDS:
        raise ValueError(f"fault kind {name!r} is registered already")
    FAULT_KINDS[name] = make


def wait_recovered(fault: FaultKind, bound_s: float, poll_s: float = 0.1) -> float | None:
    """Seconds from now until `fault.recovered()`, or None past `bound_s`."""
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if fault.recovered():
            return time.monotonic() - started
        time.sleep(poll_s)
    return None
