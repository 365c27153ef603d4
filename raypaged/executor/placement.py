"""Where a Ray worker group runs: its placement group, and the bounded wait for its capacity.

A group either makes a placement group of its own (named after the engine actor it serves, so
that whoever replaces a dead engine can remove it) or, inside a placement group already (a Ray
Serve replica's), takes that group's last world_size bundles.

A lost node: Ray reschedules the bundles that were on it onto whatever capacity is left (the
placement group is RESCHEDULING until they are placed), and the workers there are gone. A group
of its own is removed with its failed workers and the next group makes a new one: PACK places the
whole group together where it fits, where Ray's rescheduling would put back only the lost bundles,
wherever there is room, leaving a tensor-parallel group split across nodes. A Serve replica's
placement group is not the executor's to remove: the next group waits for Ray to reschedule it.
Either wait is bounded; past it, `NoCapacityError` names what was asked and what is free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypaged.executor.errors import NoCapacityError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


def worker_placement_group_name(engine_actor_id: str) -> str:
    """The name of the placement group an executor running inside that engine actor makes.

    Ray removes a placement group with the job that made it, not with the actor: when the engine
    actor dies, whoever replaces it removes the group by this name, or its GPUs stay reserved."""
    return f"raypaged-workers-{engine_actor_id}"


def _own_placement_group_name() -> str:
    actor_id = ray.get_runtime_context().get_actor_id()
    return worker_placement_group_name(actor_id) if actor_id else ""


@dataclass
class WorkerPlacement:
    """The bundles of one worker group: rank r runs in bundle first_bundle + r of `group`."""

    group: PlacementGroup
    first_bundle: int
    owned: bool  # made for this worker group (and removed with it), not the process's own

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group,
                                                placement_group_bundle_index=self.first_bundle + rank)

    def release(self) -> None:
        """Remove the placement group if it is the worker group's own (a replica's stays)."""
        if self.owned:
            remove_placement_group(self.group)


def place_workers(world_size: int, bundle: dict[str, float], timeout_s: float) -> WorkerPlacement:
    """Reserve world_size bundles of `bundle` and wait until every one is placed.

    Inside a placement group already (a Ray Serve replica's, whose `placement_group_bundles`
    reserve the engine's GPUs), the workers take its last world_size bundles, as vLLM does under
    Serve: a second group would reserve the same GPUs twice. Otherwise a group of its own, packed.
    Raises NoCapacityError when the bundles are not all placed within timeout_s (a group of its
    own is removed first), RuntimeError when the process's group cannot hold the workers."""
    current = ray.util.get_current_placement_group()
    if current is None:
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK",
                                name=_own_placement_group_name())
        placement = WorkerPlacement(group, 0, owned=True)
    else:
        specs = current.bundle_specs
        first = len(specs) - world_size
        short = [i for i in range(max(first, 0), len(specs))
                 if any(specs[i].get(k, 0) < v for k, v in bundle.items())]
        if first < 0 or short:
            raise RuntimeError(
                f"this process runs in a placement group whose last {world_size} bundles must "
                f"each hold a worker ({bundle}); it has {specs}")
        placement = WorkerPlacement(current, first, owned=False)
    try:
        wait_placed(placement.group, timeout_s, f"{world_size} bundles of {bundle}")
    except BaseException:
        placement.release()
        raise
    return placement


def wait_placed(group: PlacementGroup, timeout_s: float, what: str) -> None:
    """Until every bundle of `group` is placed (after a lost node: rescheduled), or
    NoCapacityError after timeout_s."""
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        free: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]  # unannotated in Ray
        raise NoCapacityError(
            f"the worker group's placement group ({what}) was not placed within {timeout_s:g} s: "
            f"the cluster has no room for it (free now: {free})")
    ray.get(ready[0])  # a group removed meanwhile raises here rather than pass for placed
