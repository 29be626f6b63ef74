"""A GenerateRequest checked and tokenized: what the orchestrator runs, or why not.

Validation lives here, at the edge: every refusal is an ``InvalidRequest`` whose
message tells the caller what to change.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.common.model import check_prompt
from services.common.pb import common_pb2, gateway_pb2
from services.common.sampling import DEFAULT_MAX_TOKENS
from services.common.tokenizer import ChatTemplateError, Tokenizer
from services.common.wire import sampling_from_proto, sampling_to_proto


class InvalidRequest(ValueError):
    """The request cannot be served as sent; the message says what to change."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: its id, prompt tokens, worker-ready params and stop strings."""

    request_id: str
    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams  # proto3 defaults resolved into explicit values
    stop: tuple[str, ...]

    @property
    def wants_logprobs(self) -> bool:
        return self.params.HasField("logprobs")


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: prompts shorter than max_model_len, ids below vocab_size."""

    max_model_len: int
    vocab_size: int
    max_tokens_default: int = DEFAULT_MAX_TOKENS


def prepare(
    request: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits
) -> PreparedRequest:
    """Tokenize and check ``request``; raise InvalidRequest if it cannot be served."""
    prompt_token_ids = prompt_tokens(request, tokenizer)
    try:
        check_prompt(prompt_token_ids, limits.max_model_len, limits.vocab_size)
        params = sampling_from_proto(request.params, limits.max_tokens_default)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return PreparedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_token_ids,
        params=sampling_to_proto(params),
        stop=tuple(request.stop),
    )


def prompt_tokens(request: gateway_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: text tokenized as is, ids as given, or a chat templated."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequest("the prompt is empty: send some text")
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    if kind == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
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
