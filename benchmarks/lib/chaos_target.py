"""What a chaos soak (benchmarks/chaos.py) runs against: `ChaosTarget`, and the `raypaged serve`
process as one (`ServerTarget`). The other: the Serve app (benchmarks/lib/chaos_serve.py).

A target is a live server in a process session of its own (every process it starts, Ray's
included, can be found, measured, signalled and, at the end, checked gone), with a gRPC door
and an OpenAI HTTP door. The soak asks it:

- which fault kinds it can take (`fault_kinds`; a kind it cannot take is a usage error);
- whether it serves as before (`serving`: what a fault's recovery waits for);
- its engines' pools once the load is over (`settle`: whole, or what was left);
- to drain (`stop`: SIGTERM; calls in flight finish) and, whatever happened, to go (`kill`).

The process faults (benchmarks/lib/chaos_faults.py) signal its processes by their titles
(`pids_named`); the sampler reads their RSS (`rss_by_process`) and health through `address`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.lib.launched_server import LaunchedServer, pool_whole, wait_pool_whole

if TYPE_CHECKING:
    from raypaged.proto.v1 import raypaged_pb2 as pb

# The kinds that only signal a process of the session (chaos_faults.py).
PROCESS_KINDS = frozenset({"worker_sigkill", "engine_sigkill", "worker_hang"})


@dataclass(frozen=True)
class PoolReport:
    """The engines' pools after the load. whole: every free block back, nothing running or
    waiting (and, for a target with an ingress, no stream held there); pool: the numbers, summed
    over engines; streams_resumed: the streams carried over to another engine so far (None: the
    target does not say)."""

    whole: bool
    pool: dict[str, float | None]
    streams_resumed: float | None


class ChaosTarget(ABC):
    """A server a chaos soak loads and faults. `address` (gRPC host:port) and `http_url` (the
    OpenAI base URL, …/v1) are set once `start` returns."""

    fault_kinds: frozenset[str]
    address: str | None = None
    http_url: str | None = None

    @abstractmethod
    def start(self, timeout_s: float = 300.0) -> pb.ModelInfo:
        """Waits until it serves; the served model's ModelInfo."""

    @abstractmethod
    def serving(self) -> bool:
        """It answers a two-token greedy request now (its engines step again)."""

    @abstractmethod
    def settle(self, timeout_s: float = 15.0) -> PoolReport:
        """The pools once whole, or as they are when `timeout_s` passes first."""

    @abstractmethod
    def gcs_address(self) -> str | None:
        """Its Ray cluster's GCS address (the object store's probe asks there)."""

    @abstractmethod
    def session_pids(self) -> list[int]: ...

    @abstractmethod
    def pids_named(self, prefix: str) -> list[int]:
        """Processes of the session whose command line starts with `prefix`."""

    @abstractmethod
    def rss_by_process(self) -> dict[int, tuple[str, int]]: ...

    @abstractmethod
    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (calls in flight finish); its exit status."""

    @abstractmethod
    def kill(self) -> None:
        """Everything of it gone, at once; safe to call twice."""


class ServerTarget(ChaosTarget):
    """`raypaged serve` (one engine, gRPC and OpenAI HTTP in one process) as launched by
    `server` (LaunchedServer; ClusterServer for the node faults). Its pools are read off its
    Prometheus page."""

    def __init__(self, server: LaunchedServer, fault_kinds: frozenset[str]) -> None:
        self.server = server
        self.fault_kinds = fault_kinds
        self._metrics_url: str | None = None

    def start(self, timeout_s: float = 300.0) -> pb.ModelInfo:
        address, self._metrics_url, info = self.server.start(timeout_s)
        self.address, self.http_url = address, self.server.http_url
        return info

    def serving(self) -> bool:
        return serving(self.server)

    def settle(self, timeout_s: float = 15.0) -> PoolReport:
        assert self._metrics_url is not None
        metrics = wait_pool_whole(self._metrics_url, timeout_s)
        pool = {k: metrics.get(f"raypaged_{k}") for k in
                ("kv_cache_blocks", "kv_cache_free_blocks", "num_requests_running", "num_requests_waiting")}
        return PoolReport(pool_whole(metrics), pool, metrics.get("raypaged_streams_replayed_total"))

    def gcs_address(self) -> str | None:
        return self.server.gcs_address()

    def session_pids(self) -> list[int]:
        return self.server.session_pids()

    def pids_named(self, prefix: str) -> list[int]:
        return self.server.pids_named(prefix)

    def rss_by_process(self) -> dict[int, tuple[str, int]]:
        return self.server.rss_by_process()

    def stop(self, timeout_s: float = 120.0) -> int:
        return self.server.stop(timeout_s)

    def kill(self) -> None:
        self.server.kill()


def serving(server: LaunchedServer, probe_timeout_s: float = 3.0) -> bool:
    """Health SERVING and a two-token greedy request served: the engine steps again (a worker
    group's health stays SERVING while it restarts; its new processes run before they serve)."""
    from raypaged.client import Client, RequestError

    assert server.address is not None
    try:
        with Client(server.address) as client:
            if client.health(timeout=2) != "SERVING":
                return False
            result = client.generate([3, 4, 5], max_tokens=2, temperature=0.0, ignore_eos=True,
                                     timeout=probe_timeout_s)
            return len(result.outputs[0].token_ids) == 2
    except RequestError:
        return False
