"""A Ray cluster of several nodes on one host (Ray's own `ray.cluster_utils.Cluster`: one raylet
per node), to lose a node while an engine serves: tests/reliability/test_node_loss.py, and the
"node removed" fault of a chaos run.

    cluster = NodeCluster()                       # the head: this driver, no CPU for workers
    node = cluster.add_node(num_cpus=1)           # a node a TP group can go to
    ...start a server or an LLM: its workers' placement group lands on that node...
    where = engine_nodes(engine_client.actor)     # the engine's and its workers' nodes
    spare = cluster.add_node(num_cpus=1)          # where the lost node's work can go
    cluster.lose_node(where.workers[0])           # killed; returns once the GCS knows
    cluster.shutdown()

A lost node is killed, not drained (its raylet and every process on it, at once). The GCS declares
it dead after `health_check_failure_threshold` missed health checks; the head here checks every
half second, so that is seconds, not Ray's default of tens of seconds. This process keeps the
head (`ray.init` connects to it), so it is never the node lost. It cannot share a module's plain
`ray.init` (tests/support/frontend_harness.py init_ray): a module makes one cluster and shuts it
down at its end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.cluster_utils import Cluster

# The GCS's verdict on a silent raylet: a check every 0.5 s, dead after 6 missed in a row. No
# Python workers started ahead of need: a node joining on a busy machine must register within
# Ray's fixed 30 s.
FAST_NODE_FAILURE_DETECTION = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                               "health_check_failure_threshold": 6, "enable_worker_prestart": False}


class NodeCluster:
    def __init__(self, head_cpus: int = 0, system_config: dict[str, Any] | None = None) -> None:
        """Start the head node and connect this process to it (ray.init)."""
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False,
            "_system_config": system_config or FAST_NODE_FAILURE_DETECTION})
        self._nodes: dict[str, Any] = {}  # node id -> its ray._private.node.Node
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        self.head_id: str = ray.get_runtime_context().get_node_id()

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> str:
        """A new node, alive once this returns: its id."""
        node = self.cluster.add_node(num_cpus=num_cpus, resources=resources or {})
        self._nodes[node.node_id] = node
        return str(node.node_id)

    def alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def lose_node(self, node_id: str, timeout_s: float = 60.0) -> float:
        """Kill that node at once (never the head) and wait until the GCS declares it dead: the
        seconds that took. Add the capacity its work is to move to first: a node takes seconds
        to join."""
        node = self._nodes.pop(node_id)
        start = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        while self.alive(node_id):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"node {node_id} still alive {timeout_s:g} s after it was killed")
            time.sleep(0.05)
        return time.monotonic() - start

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@dataclass(frozen=True)
class EngineNodes:
    engine: str  # the node the engine actor runs on
    workers: list[str]  # the node of each worker's bundle, rank order (empty: workers in process)


def engine_nodes(engine_actor: Any, timeout_s: float = 30.0) -> EngineNodes:
    """Where an engine actor (AsyncEngineClient.actor) and its TP workers run: the workers' are
    read from their placement group (named after the engine actor), not from the engine."""
    from raypaged.executor.placement import worker_placement_group_name

    engine = ray.get(engine_actor.__ray_call__.remote(
        lambda actor: ray.get_runtime_context().get_node_id()), timeout=timeout_s)
    try:
        group = ray.util.get_placement_group(worker_placement_group_name(engine_actor._actor_id.hex()))
    except ValueError:  # no group: the engine runs its model in process
        return EngineNodes(engine, [])
    placed = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return EngineNodes(engine, [placed[i] for i in sorted(placed)])
