"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError

from pdserve.gateway.orchestrator import StreamStalled
from pdserve.gateway.requests import InvalidRequest
from pdserve.gateway.router import NoWorkerError

# A worker's gRPC status as the HTTP status a REST client expects.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class APIError(Exception):
    """An error a REST client gets in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the field to change."""
    return APIError(400, message, param=param)


def api_error_of(error: Exception) -> APIError:
    """The REST error for one of generation.REQUEST_ERRORS."""
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error))
    if isinstance(error, grpc.aio.AioRpcError):
        status = _HTTP_STATUS.get(error.code(), 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 429:
            kind = "rate_limit_error"
        return APIError(status, error.details() or error.code().name, kind)
    if isinstance(error, NoWorkerError | StreamStalled):
        return APIError(503, str(error), "server_error")
    return APIError(500, f"bug in a worker: {error}", "server_error")


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A pydantic validation error as one message (each failing field, its rule's name and
    what it says) and the first field it names."""
    parts, param = [], None
    for item in error.errors():
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        param = param or ".".join(loc) or None
        kind = item.get("type", "")
        parts.append(f"{'.'.join(loc) or 'body'}: {item.get('msg')} ({kind})")
    return "; ".join(parts), param
