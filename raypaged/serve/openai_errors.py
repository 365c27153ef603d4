"""Exceptions → OpenAI-shaped error bodies and HTTP statuses.

The classification is the gRPC frontend's (frontend/errors.py: status_for), so both transports
refuse the same requests for the same reasons; only the codes differ:
INVALID_ARGUMENT 400, NOT_FOUND 404, RESOURCE_EXHAUSTED 429 (with Retry-After when the server
estimated one), UNAVAILABLE 503, DEADLINE_EXCEEDED 504 (a request past its timeout), anything
else 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from raypaged.frontend.errors import retry_after_header, retry_after_s, status_for

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types by status; any other 4xx (405, 413, 415, …) is the client's mistake.
ERROR_TYPE = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    if status in ERROR_TYPE:
        return ERROR_TYPE[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


@dataclass
class OpenAIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    headers: dict[str, str] | None = None  # e.g. Allow on a 405

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_exception(cls, error: BaseException) -> OpenAIError:
        if isinstance(error, OpenAIError):
            return error
        code, message = status_for(error)
        retry_after = retry_after_s(error)
        headers = None if retry_after is None else {"Retry-After": retry_after_header(retry_after)}
        return cls(HTTP_STATUS.get(code, 500), message, grpc_code=code, headers=headers)


def unauthenticated() -> OpenAIError:
    """A request without a known API key (bearer token)."""
    return OpenAIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                       grpc_code=grpc.StatusCode.UNAUTHENTICATED, headers={"WWW-Authenticate": "Bearer"})


def model_not_found(requested: str, served: str | Sequence[str]) -> OpenAIError:
    names = ", ".join(f"`{name}`" for name in ([served] if isinstance(served, str) else served))
    return OpenAIError(404, f"The model `{requested}` does not exist; this server serves {names}.",
                       param="model", code="model_not_found", grpc_code=grpc.StatusCode.NOT_FOUND)


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    """FastAPI's body validation errors (wrong types, missing fields, bad JSON) as one 400."""
    parts, param = [], None
    for error in errors[:5]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        # A check over the whole body (serve/client_text.py) names its field in ctx.
        location = location or str((error.get("ctx") or {}).get("field", ""))
        param = param or location or None
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return OpenAIError(400, "; ".join(parts) + more, param=param)
