"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, as the OpenAPI document declares it."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that may answer these statuses with an error (the
    OpenAPI document then says so: clients generated from it, and schema checkers such as
    schemathesis, expect every status a route sends to be documented)."""
    return {
        status: {"model": ErrorResponse, "description": _STATUS_TEXT[status]} for status in statuses
    }


_STATUS_TEXT = {
    400: "a request pdserve cannot serve as sent; the message says what to change",
    401: "no API key, or a wrong one (--api-key)",
    404: "another model than the one served, or no such route",
    413: "a body over --max-body-bytes",
    429: "the gateway's queue is full (Retry-After)",
    500: "a bug in the gateway",
    503: "no worker could take the request (Retry-After)",
    504: "a worker's deadline ran out",
}
# What a generation route answers: JSON, or with "stream": true server-sent events; and
# its errors.
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the answer (JSON), or with stream: true its chunks (text/event-stream)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_responses(400, 401, 404, 413, 429, 500, 503, 504),
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
