"""The REST front's ASGI middleware: the root path, request ids, the API key, and the body
size limit.

Each refuses a request before FastAPI sees it, in OpenAI's error shape.
"""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from pdserve.gateway.openai_errors import APIError

REQUEST_ID_HEADER = "x-request-id"
MAX_CLIENT_ID_CHARS = 256  # of an x-request-id kept to echo and log
PROTECTED_PREFIX = "/v1/"  # /health and /openapi.json stay open
# Generation outside /v1/ (SageMaker's route; vLLM leaves it open, a key here guards it).
PROTECTED_PATHS = ("/invocations",)


async def send_error(scope: dict, receive: Any, send: Any, error: APIError, **headers: str) -> None:
    """Answer the request with ``error`` as OpenAI's JSON."""
    response = JSONResponse(error.body(), status_code=error.status, headers=headers or None)
    await response(scope, receive, send)


class RootPathMiddleware:
    """Serves the API under ``root_path`` as well as at the top (vLLM's ``--root-path``):
    for a proxy that forwards ``/llm/v1/...`` unchanged, or one that strips the prefix.
    A request under the prefix has it taken off ``path`` and recorded in the scope's
    ``root_path`` (ASGI's place for it) before any other middleware reads the path, so the
    API key, the body limit and the routes see the same path either way."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (
            path == self.root_path or path.startswith(self.root_path + "/")
        ):
            rest = path[len(self.root_path) :] or "/"
            scope = {
                **scope,
                "path": rest,
                "root_path": scope.get("root_path", "") + self.root_path,
            }
            if scope.get("raw_path"):
                scope["raw_path"] = scope["raw_path"][len(self.root_path) :] or b"/"
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Gives every request the gateway's own id (``state.request_id``: what the workers
    see) and keeps the client's ``x-request-id`` (``state.client_request_id``) only to echo
    it on the response and log it: two clients sending the same one never collide. Without
    one, the response carries the gateway's id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        value = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1").strip()
        state = scope.setdefault("state", {})
        # When the request arrived, for its TTFT and the start of its span.
        state["arrival"], state["arrival_ns"] = time.perf_counter(), time.time_ns()
        state["request_id"] = uuid.uuid4().hex
        state["client_request_id"] = value[:MAX_CLIENT_ID_CHARS]
        request_id = state["client_request_id"] or state["request_id"]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """Every /v1/ route and /invocations need ``Authorization: Bearer <api_key>``; else 401."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (
            path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS
        ):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"").strip()
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        message = (
            "Incorrect API key provided."
            if given
            else "Missing API key: send 'Authorization: "
            "Bearer <key>' with the key the gateway was started with (--api-key)."
        )
        error = APIError(401, message, code="invalid_api_key")
        await send_error(scope, receive, send, error, **{"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """Refuses a body over ``max_bytes`` with 413, by Content-Length or while reading it.

    The body is read here, whole, and replayed to the app: a chunked body past the limit is
    refused before FastAPI parses any of it.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(scope, receive, send, self._too_large())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await send_error(scope, receive, send, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body exceeds the gateway's limit of {self.max_bytes} bytes "
            "(--max-body-bytes)",
            code="request_too_large",
        )
