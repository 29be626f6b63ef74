"""A GenerateRequest checked and tokenized: what the orchestrator runs, or why not.

Validation lives here, at the edge: every refusal is an ``InvalidRequest`` whose
message tells the caller what to change.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdserve.core.model import check_prompt
from pdserve.core.sampling import MAX_LOGPROBS
from pdserve.core.tokenizer import ChatTemplateError, Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from pdserve.wire.convert import sampling_from_proto, sampling_to_proto


class InvalidRequest(ValueError):
    """The request cannot be served as sent; the message says what to change."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: its id, prompt tokens, worker-ready params and stop strings.

    ``request_id`` is the gateway's own, unique, and is what the workers see;
    ``client_request_id`` is what the client called it (``x-request-id``, or the gRPC
    request's ``request_id``): only echoed back and logged, so two clients that pick the
    same id never meet.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams  # proto3 defaults resolved into explicit values
    stop: tuple[str, ...]
    client_request_id: str = ""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def wants_logprobs(self) -> bool:
        return self.params.HasField("logprobs")

    @property
    def reply_id(self) -> str:
        """The id the client's answers carry: its own when it gave one."""
        return self.client_request_id or self.request_id


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts (prompts shorter than max_model_len, ids below
    vocab_size) and the gateway's caps on what one request may ask for."""

    max_model_len: int
    vocab_size: int
    max_tokens_default: int | None = None  # None: the rest of the context
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_logprobs: int = MAX_LOGPROBS


def new_request_id() -> str:
    """A fresh gateway request id."""
    return uuid.uuid4().hex


def prepare(
    request: gateway_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    request_id: str | None = None,
    max_tokens_default: int | None = None,
) -> PreparedRequest:
    """Check and tokenize ``request``; raise InvalidRequest if it cannot be served.

    ``request_id``: the gateway's id for it (default: a new one); the request's own
    ``request_id`` is kept only as ``client_request_id``. An unset max_tokens takes
    ``max_tokens_default`` (None: the rest of the context), capped by the context and by
    ``limits.max_tokens_default``. Tokenizing is CPU work: callers on an event loop run
    this in a thread.
    """
    check_bounds(request, limits)
    prompt_token_ids = prompt_tokens(request, tokenizer, limits)
    try:
        check_prompt(prompt_token_ids, limits.max_model_len, limits.vocab_size)
        room = limits.max_model_len - len(prompt_token_ids)
        asked = request.params.max_tokens
        if asked > room:
            raise InvalidRequest(
                f"This model's maximum context length is {limits.max_model_len} tokens. "
                f"However, you requested {len(prompt_token_ids) + asked} tokens "
                f"({len(prompt_token_ids)} in the prompt, {asked} in the completion). "
                "Please reduce the length of the prompt or max_tokens."
            )
        defaults = (room, max_tokens_default, limits.max_tokens_default)
        params = sampling_from_proto(request.params, min(d for d in defaults if d is not None))
        check_token_ids(params.token_ids_used(), limits.vocab_size)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return PreparedRequest(
        request_id=request_id or new_request_id(),
        prompt_token_ids=prompt_token_ids,
        params=sampling_to_proto(params),
        stop=tuple(request.stop),
        client_request_id=request.request_id,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=(
            request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ),
    )


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Refuse a token id the sampling parameters name that is outside the vocabulary."""
    for token in token_ids:
        if token >= vocab_size:
            raise InvalidRequest(
                f"token id {token} is out of vocabulary: the model's ids are 0 to {vocab_size - 1}"
            )


def check_bounds(request: gateway_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """Refuse what is too large to look at, before any of it is tokenized or copied."""
    stop = request.stop
    if len(stop) > limits.max_stop:
        raise InvalidRequest(
            f"stop has {len(stop)} strings; at most {limits.max_stop} are allowed (--max-stop)"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidRequest(
            f"a stop string has {longest} characters; at most {limits.max_stop_chars} are "
            "allowed (--max-stop-chars)"
        )
    stop_ids = request.params.stop_token_ids
    if len(stop_ids) > limits.max_stop:
        raise InvalidRequest(
            f"stop_token_ids has {len(stop_ids)} ids; at most {limits.max_stop} are allowed "
            "(--max-stop)"
        )
    if request.params.HasField("logprobs") and request.params.logprobs > limits.max_logprobs:
        raise InvalidRequest(
            f"logprobs asks for the top {request.params.logprobs} tokens; at most "
            f"{limits.max_logprobs} are allowed (--max-logprobs)"
        )
    if request.WhichOneof("input") == "prompt_token_ids":
        check_prompt_length(len(request.prompt_token_ids.ids), limits)


def check_prompt_length(num_tokens: int, limits: ModelLimits) -> None:
    """Refuse a prompt of token ids that leaves no room for output, by its length alone."""
    if num_tokens >= limits.max_model_len:
        raise InvalidRequest(
            f"the prompt has {num_tokens} tokens, but the model's maximum context length is "
            f"{limits.max_model_len}: shorten it to leave room for output"
        )


def prompt_tokens(
    request: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits
) -> list[int]:
    """The prompt's token ids: text tokenized as is, ids as given, or a chat templated."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequest("the prompt is empty: send some text")
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    if kind == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)  # its length is checked already
    if kind == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise InvalidRequest("messages is empty: send at least one chat message")
        try:
            return tokenizer.apply_chat_template(messages)
        except ChatTemplateError as error:
            raise InvalidRequest(
                f"the model's chat template refused the messages: {error}"
            ) from None
    raise InvalidRequest("the request has no input: set prompt, prompt_token_ids or messages")
