"""vLLM's batched chat, ``POST /v1/chat/completions/batch``: the fields of a chat completion,
with ``messages`` a list of conversations; each is answered as its own chat completion and
the answer holds one choice per conversation, indexed 0 to N-1 in their order.

As vLLM: no streaming, no tools, one choice per conversation (``n`` 1), no beam search; each
is a 400 here rather than a field silently dropped.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pdserve.gateway.openai_errors import APIError
from pdserve.gateway.openai_protocol import ChatCompletionRequest

# Fields the batch refuses, with why (vLLM refuses the same).
_REFUSED = {
    "stream": "streaming is not supported by the batch endpoint; send each conversation to "
    "/v1/chat/completions",
    "tools": "tools are not supported by the batch endpoint",
    "use_beam_search": "beam search is not supported by the batch endpoint",
}


def conversations(body: dict[str, Any]) -> list[ChatCompletionRequest]:
    """One chat completion request per conversation of a batch body, or a 400."""
    batch = body.get("messages")
    if not isinstance(batch, list) or not batch:
        raise APIError(400, "messages must be a non-empty list of conversations", "messages")
    for i, conversation in enumerate(batch):
        if not isinstance(conversation, list) or not conversation:
            raise APIError(
                400, f"messages[{i}] must be a non-empty list of messages", param="messages"
            )
    for name, why in _REFUSED.items():
        if body.get(name):
            raise APIError(400, why, param=name)
    if body.get("n") not in (None, 1):
        raise APIError(400, "n must be 1 for the batch endpoint", param="n")
    try:
        return [ChatCompletionRequest.model_validate({**body, "messages": c}) for c in batch]
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def merged(answers: list[dict[str, Any]], answer_id: str) -> dict[str, Any]:
    """The batch's answer, ``answer_id``: the first answer's envelope, every answer's choice
    (indexed by conversation) and the usage of all."""
    first = answers[0]
    out = {k: v for k, v in first.items() if k not in ("choices", "usage", "prompt_logprobs")}
    out["id"] = answer_id
    out["choices"] = [
        {**choice, "index": i} for i, answer in enumerate(answers) for choice in answer["choices"]
    ]
    if any(a.get("prompt_logprobs") is not None for a in answers):
        out["prompt_logprobs"] = [a.get("prompt_logprobs") for a in answers]
    usage = _summed([a["usage"] for a in answers if a.get("usage")])
    if usage is not None:
        out["usage"] = usage
    return out


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not usages:
        return None
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                inner = total.setdefault(key, {})
                for k, v in value.items():
                    if isinstance(v, int):
                        inner[k] = inner.get(k, 0) + v
            elif key not in total:
                total[key] = value
    return total
