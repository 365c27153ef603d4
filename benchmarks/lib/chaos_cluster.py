"""A Ray cluster of several nodes on one host, and a `raypaged serve` on it: the target of the
chaos soak's "node removed" fault (benchmarks/lib/chaos_node.py), and of
tests/reliability/test_node_loss.py (through tests/support/node_cluster.py).

    cluster = NodeCluster()                       # the head: this driver, no CPU for workers
    node = cluster.add_node(num_cpus=1)           # a node a TP group can go to
    ...start a server or an LLM: its workers' placement group lands on that node...
    spare = cluster.add_node(num_cpus=1)          # where the lost node's work can go
    cluster.lose_node(node)                       # killed; returns once the GCS knows
    cluster.shutdown()

Ray's own `ray.cluster_utils.Cluster` runs one raylet per node. A lost node is killed, not
drained (its raylet and every process on it, at once). The GCS declares it dead after
`health_check_failure_threshold` missed health checks; the head here checks every half second,
so that is seconds, not Ray's default of tens of seconds. This process keeps the head (`ray.init`
connects to it), so it is never the node lost. It cannot share a plain `ray.init`: a user makes
one cluster and shuts it down at its end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import ray
from ray.cluster_utils import Cluster

from benchmarks.lib.launched_server import LaunchedServer, session_pids

# The GCS's verdict on a silent raylet: a check every 0.5 s, dead after 6 missed in a row. No
# Python workers started ahead of need: a node joining on a busy machine must register within
# Ray's fixed 30 s.
FAST_NODE_FAILURE_DETECTION = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                               "health_check_failure_threshold": 6, "enable_worker_prestart": False}
AUTH_MODE = "RAY_AUTH_MODE"
WORKER_CPUS = 1  # a node with room for one TP group of CPU workers (a fraction of a CPU each)


class NodeCluster:
    def __init__(self, head_cpus: int = 0, system_config: dict[str, Any] | None = None) -> None:
        """Start the head node and connect this process to it (ray.init)."""
        # One authentication mode for every process of the cluster, set before any starts and
        # inherited by the processes started later (a `ray start` node, a server joining): Ray
        # turns token authentication on in any process that finds a token in ~/.ray while
        # RAY_AUTH_MODE is unset, and the head started here has it off, so such a node or
        # driver could not talk to the rest. Put back at shutdown.
        self._auth_mode = os.environ.get(AUTH_MODE)
        os.environ[AUTH_MODE] = "disabled"
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False,
            "_system_config": system_config or FAST_NODE_FAILURE_DETECTION})
        self._nodes: dict[str, Any] = {}  # node id -> its ray._private.node.Node
        self._processes: dict[str, subprocess.Popen] = {}  # node id -> its `ray start --block`
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        self.head_id: str = ray.get_runtime_context().get_node_id()

    @property
    def address(self) -> str:
        """The GCS address a process joins this cluster at (`ray.init(address=...)`)."""
        return str(self.cluster.address)

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> str:
        """A new node, alive once this returns: its id. The main thread only (Ray's node object
        sets a SIGTERM handler); elsewhere `add_node_process`."""
        node = self.cluster.add_node(num_cpus=num_cpus, resources=resources or {})
        self._nodes[node.node_id] = node
        return str(node.node_id)

    def add_node_process(self, num_cpus: int = 1, timeout_s: float = 120.0) -> str:
        """A new node from any thread: `ray start --block` as a child in a session of its own
        (its raylet and every worker the raylet starts are of that session, which is how
        `lose_node` kills them all at once); its id once the GCS has it alive."""
        known = {n["NodeID"] for n in ray.nodes()}
        process = subprocess.Popen(
            ["ray", "start", f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0",
             f"--object-store-memory={150 * 2**20}", "--disable-usage-stats", "--block"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", AUTH_MODE: "disabled"})
        deadline = time.monotonic() + timeout_s
        while not (new := [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in known]):
            if process.poll() is not None or time.monotonic() > deadline:
                _kill_session(process)
                raise RuntimeError(f"a node did not join within {timeout_s:g} s (ray start: {process.poll()})")
            time.sleep(0.1)
        self._processes[new[0]] = process
        return str(new[0])

    def alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def lose_node(self, node_id: str, timeout_s: float = 60.0) -> float:
        """Kill that node at once (never the head) and wait until the GCS declares it dead: the
        seconds that took. Add the capacity its work is to move to first: a node takes seconds
        to join."""
        start = time.monotonic()
        self.kill_node(node_id)
        while self.alive(node_id):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"node {node_id} still alive {timeout_s:g} s after it was killed")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill_node(self, node_id: str) -> None:
        """Kill that node at once (never the head), without waiting for the GCS's verdict."""
        if node_id in self._processes:
            _kill_session(self._processes.pop(node_id))
        else:
            self.cluster.remove_node(self._nodes.pop(node_id), allow_graceful=False)

    def shutdown(self) -> None:
        ray.shutdown()
        for process in self._processes.values():
            _kill_session(process)
        self._processes.clear()
        self.cluster.shutdown()
        if self._auth_mode is None:
            os.environ.pop(AUTH_MODE, None)
        else:
            os.environ[AUTH_MODE] = self._auth_mode


def _kill_session(process: subprocess.Popen) -> None:
    """SIGKILL every process of the session `process` leads, then reap it."""
    for pid in session_pids(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            pass
    process.wait()


def worker_group_nodes() -> list[list[str]]:
    """The nodes of each live raypaged worker group in the cluster this process is connected
    to, one list per group in bundle order, read off the placement groups (an engine names its
    group after itself: executor/placement.py), so no handle to the engine actor is needed."""
    from raypaged.executor.placement import worker_placement_group_name

    prefix = worker_placement_group_name("")
    groups = []
    for group in ray.util.placement_group_table().values():
        if group["name"].startswith(prefix) and group["state"] == "CREATED":
            placed = group["bundles_to_node_id"]
            groups.append([placed[i] for i in sorted(placed)])
    return groups


class ClusterServer(LaunchedServer):
    """`raypaged serve --ray-address` joining a `NodeCluster` made for it: a head with no CPU
    (so the engine's workers go elsewhere) and one worker node with room for a worker group.
    `kill` also takes the cluster down. The cluster's processes are not of the server's
    session: only the serve process itself is measured, and only faults on nodes apply."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None) -> None:
        self.cluster = NodeCluster()
        self.worker_node = self.cluster.add_node(num_cpus=WORKER_CPUS)
        try:
            super().__init__(["--ray-address", self.cluster.address, *serve_args], env=env, command="serve")
        except BaseException:
            self.cluster.shutdown()
            raise

    def gcs_address(self) -> str | None:
        return self.cluster.address

    def kill(self) -> None:
        super().kill()
        self.cluster.shutdown()
