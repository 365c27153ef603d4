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
    """The waiting queue is at its bound (SchedulerConfig.max_waiting_requests), or the frontend
    shed the request under overload (frontend/load_shedding.py): try again later. The frontend
    maps it to RESOURCE_EXHAUSTED / HTTP 429 rather than INVALID_ARGUMENT, with retry_after_s
    (when known) as the Retry-After the client is told."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(RaypagedError):
    """A request ran past its timeout (the server's request_timeout_s or the client's own): it
    was aborted in the engine. The frontend answers DEADLINE_EXCEEDED / HTTP 504."""


class EngineDeadError(RaypagedError):
    """The engine cannot serve anything (its actor is gone, or its workers could not be brought
    back): the frontend answers UNAVAILABLE."""


class RequestFailedError(RaypagedError):
    """The engine failed a request it had accepted (its model workers broke; it restarts them).
    Raised by the output processing (raypaged/text/) that every transport shares; the frontend
    answers UNAVAILABLE."""
