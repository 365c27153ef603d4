"""Exceptions the core raises. Each leaves the manager's state exactly as it was."""


class RaypagedError(Exception):
    """Base class of every error raypaged raises on purpose."""


class InvalidRequestError(RaypagedError, ValueError):
    """A request or its parameters can never be served (bad value, too long, duplicate id)."""


class UnknownRequestError(RaypagedError, KeyError):
    """An operation named a request id the engine does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"


class NoFreeBlocksError(RaypagedError):
    """The block pool cannot satisfy an allocation right now (the scheduler preempts on it)."""


class QueueFullError(InvalidRequestError):
    """The waiting queue is at its bound (SchedulerConfig.max_waiting_requests): try again later.
    The frontend maps it to RESOURCE_EXHAUSTED rather than INVALID_ARGUMENT."""


class EngineDeadError(RaypagedError):
    """The engine cannot serve anything (its actor is gone, or its workers could not be brought
    back): the frontend answers UNAVAILABLE."""


class RequestFailedError(RaypagedError):
    """The engine failed a request it had accepted (its model workers broke; it restarts them).
    Raised by the output processing (raypaged/text/) that every transport shares; the frontend
    answers UNAVAILABLE."""
