"""The chaos soak's "node removed" fault: on a `ClusterServer` (a `raypaged serve` joined to a
cluster of several raylets on this host), a spare node joins, then the node holding the engine's
worker group is killed at once, raylet and every process on it (the engine actor too, when Ray
put it there). The engine restarts its group on the spare node and recomputes what was in flight,
or, when the engine actor went with the node, the supervisor starts a new engine and the frontend
replays every stream onto it. Recovered once the GCS has the node dead, the engine's worker group
stands only on live nodes, and a probe is served again.

Registered as "node_removed" on import (benchmarks/chaos.py imports it).
"""

from __future__ import annotations

from benchmarks.lib.chaos_cluster import WORKER_CPUS, ClusterServer, worker_group_nodes
from benchmarks.lib.chaos_faults import FAULT_KINDS, FaultKind, register
from benchmarks.lib.chaos_target import ServerTarget


class NodeRemoved(FaultKind):
    name = "node_removed"

    def __init__(self, target: ServerTarget) -> None:
        if not (isinstance(target, ServerTarget) and isinstance(target.server, ClusterServer)):
            raise TypeError("node_removed needs a multi-node target (a ServerTarget of a ClusterServer), "
                            f"not {type(target).__name__}")
        super().__init__(target)
        self.target: ServerTarget = target
        self.cluster = target.server.cluster
        self._removed: str | None = None

    def inject(self, rng_value: float) -> str:
        """Waits for the spare node to join (seconds), then kills the victim and returns: the
        time to recover counts from the kill. `rng_value` picks among the nodes the worker
        groups stand on (one group: its node)."""
        cluster = self.cluster
        nodes = sorted({n for group in worker_group_nodes() for n in group} - {cluster.head_id})
        if not nodes:
            raise RuntimeError("no worker group on a node other than the head to remove")
        victim = nodes[int(rng_value * len(nodes))]
        spare = cluster.add_node_process(WORKER_CPUS)  # joined before the fault: not recovery time
        cluster.kill_node(victim)
        self._removed = victim
        return f"node {victim[:8]} of the workers removed, spare {spare[:8]} added before"

    def recovered(self) -> bool:
        cluster = self.cluster
        groups = worker_group_nodes()
        return (self._removed is not None and not cluster.alive(self._removed) and len(groups) == 1
                and all(cluster.alive(n) for n in groups[0]) and self.target.serving())


# The kinds that need a `ClusterServer` target (benchmarks/chaos.py picks the target by them).
NODE_KINDS = frozenset({NodeRemoved.name})

if NodeRemoved.name not in FAULT_KINDS:
    register(NodeRemoved.name, NodeRemoved)
