"""A GenerateRequest checked and tokenized: what the orchestrator runs, or why not.

Validation lives here, at the edge: every refusal is an ``InvalidRequest`` whose
message tells the caller what to change.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from services.common.pb import common_pb2, gateway_pb2
from services.engine.sampling_params import SamplingParams
from services.engine_proto import sampling_from_proto

DEFAULT_MAX_TOKENS = 256


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
    request: gateway_pb2.GenerateRequest, tokenizer: Any, limits: ModelLimits
) -> PreparedRequest:
    """Tokenize and check ``request``; raise InvalidRequest if it cannot be served."""
    prompt_token_ids = prompt_tokens(request, tokenizer)
    check_prompt(prompt_token_ids, limits)
    try:
        params = to_sampling_params(request.params, limits.max_tokens_default)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return PreparedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_token_ids,
        params=to_proto(params),
        stop=tuple(request.stop),
    )


def prompt_tokens(request: gateway_pb2.GenerateRequest, tokenizer: Any) -> list[int]:
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
        return chat_tokens(tokenizer, messages)
    raise InvalidRequest("the request has no input: set prompt, prompt_token_ids or messages")


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat with the model's template and the assistant prompt appended."""
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError) as error:  # ValueError: the model has no template
        raise InvalidRequest(f"the model's chat template refused the messages: {error}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def check_prompt(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    """Refuse an empty prompt, ids outside the vocabulary, or no room left to generate."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty: send at least one token")
    bad = next((t for t in prompt_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt token id {bad} is outside the vocabulary: ids must be in "
            f"[0, {limits.vocab_size})"
        )
    if len(prompt_token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens, but the maximum model length "
            f"(--max-model-len) is {limits.max_model_len}: shorten the prompt to fewer tokens "
            "to leave room for output"
        )


def to_sampling_params(
    params: common_pb2.SamplingParams, max_tokens_default: int
) -> SamplingParams:
    """The engine's SamplingParams from the proto's, reading proto3's zeros as "unset".

    Raises ValueError (with SamplingParams' message) for a bad value.
    """
    return sampling_from_proto(params, max_tokens=params.max_tokens or max_tokens_default)


def to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto the workers receive: every value explicit, no proto3 zero to interpret."""
    proto = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    if params.seed is not None:
        proto.seed = params.seed
    if params.logprobs is not None:
        proto.logprobs = params.logprobs
    return proto
