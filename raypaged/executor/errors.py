"""Failures an executor reports to the engine."""


class WorkerGroupError(RuntimeError):
    """The TP worker group failed (a rank died, hung or raised): it must be restarted whole,
    since a rank cannot rejoin a broken process group."""
