"""What a test module's Ray instance still holds: actors and placement groups, read from the GCS
tables (ray.util.state needs the dashboard, which the tests leave off)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray

_held_across_modules = 0


@contextlib.contextmanager
def held_across_modules() -> Iterator[None]:
    """Mark the Ray connected now as owned by a package- or session-scoped fixture, so the
    per-module check in tests/conftest.py leaves it alone until that fixture is done."""
    global _held_across_modules
    _held_across_modules += 1
    try:
        yield
    finally:
        _held_across_modules -= 1


def is_held_across_modules() -> bool:
    return _held_across_modules > 0


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
