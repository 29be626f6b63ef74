"""OpenAI's REST shapes: request bodies (checked by pydantic) and errors as OpenAI sends them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import grpc
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from pdserve.gateway.orchestrator import StreamStalled
from pdserve.gateway.requests import InvalidRequest
from pdserve.gateway.router import NoWorkerError
from pdserve.settings.services import MAX_N

# A worker's gRPC status as the HTTP status a REST client expects.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


# -- request bodies ----------------------------------------------------------------------


class StreamOptions(BaseModel):
    """What a stream sends besides the choices."""

    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields chat and text completions share; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # None: 1.0, OpenAI's default; SamplingParams checks it
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None  # None: 0.0; SamplingParams checks the range
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension; None: 1.0
    seed: int | None = Field(None, ge=0, lt=2**63 - MAX_N)  # choice i samples with seed + i
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    return_token_ids: bool = False  # vLLM's extension: each choice's token ids


class TextPart(BaseModel):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat turn; the content is text or a list of text parts."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    """The body of POST /v1/completions."""

    prompt: str | list[Annotated[int, Field(ge=0)]]
    logprobs: int | None = Field(None, ge=0, le=5)  # top-n per token, as OpenAI allows


# -- errors ------------------------------------------------------------------------------


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


def api_error_of(error: Exception) -> APIError:
    """The REST error for one of generation.REQUEST_ERRORS."""
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error))
    if isinstance(error, grpc.aio.AioRpcError):
        status = _HTTP_STATUS.get(error.code(), 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return APIError(status, error.details() or error.code().name, kind)
    if isinstance(error, NoWorkerError | StreamStalled):
        return APIError(503, str(error), "server_error")
    return APIError(500, f"bug in a worker: {error}", "server_error")


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in error.errors():
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        param = param or ".".join(loc) or None
        parts.append(f"{'.'.join(loc) or 'body'}: {item.get('msg')}")
    return "; ".join(parts), param
