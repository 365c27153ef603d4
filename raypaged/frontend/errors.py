"""What the frontend can fail with, and the gRPC status each maps to.

Every refusal is a status with a message the client can act on; nothing else ever reaches a
client (an unexpected exception is logged here with its traceback and answered INTERNAL).
Other transports (Ray Serve's HTTP, issue 7) map the same codes to their own.
"""

from __future__ import annotations

import logging
import math

import grpc

from raypaged.core.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RaypagedError,
    RequestFailedError,
    RequestTimeoutError,
    UnknownRequestError,
)

logger = logging.getLogger(__name__)

__all__ = ["RequestFailedError", "ServerShuttingDownError", "retry_after_header", "retry_after_s",
           "status_for"]


class ServerShuttingDownError(RaypagedError):
    """New requests are refused while the server drains its streams before stopping."""


def retry_after_s(error: BaseException) -> float | None:
    """How long a refused client should wait before trying again (RESOURCE_EXHAUSTED), if the
    server said; sent as Retry-After (HTTP header, gRPC trailing metadata "retry-after")."""
    return error.retry_after_s if isinstance(error, QueueFullError) else None


def retry_after_header(seconds: float) -> str:
    """Retry-After's value: whole seconds (RFC 9110), rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception raised while serving a request."""
    # Order matters: QueueFullError is an InvalidRequestError, UnknownRequestError a KeyError.
    if isinstance(error, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error} (try again later)"
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, RequestTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    if isinstance(error, UnknownRequestError):
        return grpc.StatusCode.NOT_FOUND, str(error)
    if isinstance(error, (EngineDeadError, ServerShuttingDownError, RequestFailedError)):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    logger.error("internal error while serving a request", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
