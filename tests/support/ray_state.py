"""What a test module's Ray instance still holds: actors and placement groups, read from the GCS
tables (ray.util.state needs the dashboard, which the tests leave off)."""

from __future__ import annotations

import ray


def alive_actors() -> list[dict]:
    """The GCS records of the actors that are ALIVE."""
    from ray._private import state

    return [a for a in state.actors().values() if a.get("State") == "ALIVE"]


def live_actors() -> list[str]:
    """Class names of the actors not yet DEAD (starting, alive or restarting)."""
    from ray._private import state

    return [a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD"]


def live_placement_groups() -> list[str]:
    """Ids of the placement groups not yet removed."""
    return [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
