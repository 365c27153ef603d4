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

The cluster (`NodeCluster`) is benchmarks/lib/chaos_cluster.py's, where its contract is; here
is what tests add: where an engine's actor and workers run, from a handle to the engine actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

# The cluster itself lives with the chaos soak, which removes nodes too (benchmarks import no
# tests/ code; tests import benchmarks').
from benchmarks.lib.chaos_cluster import FAST_NODE_FAILURE_DETECTION, NodeCluster

__all__ = ["FAST_NODE_FAILURE_DETECTION", "EngineNodes", "NodeCluster", "engine_nodes"]


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
