"""Failures an executor reports to the engine."""


class WorkerGroupError(RuntimeError):
    """The TP worker group failed (a rank died, hung or raised): it must be restarted whole,
    since a rank cannot rejoin a broken process group."""


class NoCapacityError(RuntimeError):
    """The worker group's placement group was not placed in time: the cluster has no room for
    it (its node was lost and no capacity is left, or it never had enough)."""
