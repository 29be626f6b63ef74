"""A REST body turned into the requests the workers run: one per prompt and choice.

Chat messages are rendered here (tools, documents, template arguments, a continued final
message) and every prompt is tokenized here, so what reaches ``requests.prepare`` is token
ids and sampling parameters, as from a gRPC client. Choice ``i * n + j`` is prompt i's j-th
sample; a seeded one samples with seed + j.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from pdserve.core.sampling import MAX_LOGIT_BIAS, MAX_LOGPROB_TOKEN_IDS, StructuredOutputs
from pdserve.core.tokenizer import ChatTemplateError, Tokenizer
from pdserve.gateway.openai_errors import APIError, bad_request
from pdserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StructuredOutputsParams,
)
from pdserve.gateway.openai_tools import ToolMode, template_tools, tool_constraint
from pdserve.gateway.requests import (
    InvalidRequest,
    ModelLimits,
    PreparedRequest,
    check_prompt_length,
    prepare,
)
from pdserve.v1 import common_pb2, gateway_pb2
from pdserve.wire.convert import structured_to_proto

# OpenAI's default max_tokens of a completion (chat's is the rest of the context).
COMPLETION_MAX_TOKENS = 16
SEED_SPACE = 2**63  # the engine's seeds: a request's (seed + j) is taken modulo this


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, and its text when it came as text."""

    token_ids: list[int]
    text: str | None = None


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer) -> Prompt:
    """The chat rendered by the chat template and tokenized."""
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:  # as vLLM passes it
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    try:
        text = tokenizer.render_chat(
            messages,
            body.add_generation_prompt,
            tools=template_tools(body),
            documents=body.documents,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except ChatTemplateError as error:
        raise bad_request(f"the chat template refused the messages: {error}", "messages") from None
    except TypeError as error:  # e.g. a template argument that collides with one of ours
        raise bad_request(f"chat_template_kwargs: {error}", "chat_template_kwargs") from None
    add_special = bool(body.add_special_tokens)  # a template writes its own special tokens
    return Prompt(tokenizer.encode(text, add_special_tokens=add_special), text)


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates read it: its text, and an assistant's tool calls with
    their arguments as objects (as transformers' templates expect)."""
    out = message.model_dump(exclude_unset=True, exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}]: content of type {part.type!r} is not served: pdserve "
                    "serves text models (send text parts)",
                    f"messages.{index}.content",
                )
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    for call in out.get("tool_calls") or []:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, str):
            try:
                call["function"]["arguments"] = json.loads(arguments) if arguments else {}
            except ValueError:
                raise bad_request(
                    f"messages[{index}]: a tool call's arguments are not JSON",
                    f"messages.{index}.tool_calls",
                ) from None
    return out


def completion_prompts(
    body: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits, max_prompts: int
) -> list[Prompt]:
    """Each prompt of a completion request, tokenized (text) or checked (token ids)."""
    prompt = body.prompt
    if prompt is None or prompt == "" or prompt == []:
        # vLLM's words, which clients match on (prompt_embeds is refused here).
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty: send text or token ids",
            "prompt",
        )
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = prompt
    if len(prompts) > max_prompts:
        raise bad_request(
            f"the request batches {len(prompts)} prompts; at most {max_prompts} are allowed "
            "(--max-prompts)",
            "prompt",
        )
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("a prompt is empty: send some text", "prompt")
            out.append(Prompt(tokenizer.encode(p, add_special_tokens=add_special), p))
        else:
            if not p:
                raise bad_request("a prompt of token ids is empty", "prompt")
            bad = next((i for i in p if i >= limits.vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"prompt token id {bad} is out of vocabulary: the model's ids are 0 to "
                    f"{limits.vocab_size - 1}",
                    "prompt",
                )
            out.append(Prompt(list(p)))
    return out


def truncated(prompt: Prompt, body: CompletionRequest | ChatCompletionRequest, limits) -> Prompt:
    """The prompt cut to truncate_prompt_tokens (-1: the context) from truncation_side."""
    limit = body.truncate_prompt_tokens
    if limit is None:
        check_length(prompt, limits)
        return prompt
    limit = limits.max_model_len - 1 if limit == -1 else limit
    ids = prompt.token_ids
    if len(ids) > limit:
        ids = ids[:limit] if body.truncation_side == "right" else ids[len(ids) - limit :]
        prompt = Prompt(ids, None)
    check_length(prompt, limits)
    return prompt


def check_length(prompt: Prompt, limits: ModelLimits) -> None:
    try:
        check_prompt_length(len(prompt.token_ids), limits)
    except InvalidRequest as error:
        raise bad_request(str(error), "prompt") from None


def sampling(
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    mode: ToolMode | None = None,
) -> common_pb2.SamplingParams:
    """The request's sampling parameters as the workers take them (max_tokens 0: the
    default, which ``prepare`` resolves)."""
    chat = isinstance(body, ChatCompletionRequest)
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    try:
        params = common_pb2.SamplingParams(
            max_tokens=max(max_tokens or 0, 1) if max_tokens is not None else 0,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=body.top_p or 0,
            min_p=body.min_p or 0,
            presence_penalty=body.presence_penalty or 0,
            frequency_penalty=body.frequency_penalty or 0,
            repetition_penalty=body.repetition_penalty or 0,  # 0: unset -> 1.0 (off)
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            stop_token_ids=body.stop_token_ids or (),
            allowed_token_ids=body.allowed_token_ids or (),
        )
    except ValueError as error:  # a value outside the proto's range
        raise bad_request(f"a parameter is out of range: {error}") from None
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise bad_request(
            "allowed_token_ids is empty: no token could be sampled", "allowed_token_ids"
        )
    if body.seed is not None:
        params.seed = body.seed % SEED_SPACE
    top_n = _top_logprobs(body)
    if top_n is not None:
        _check_logprobs(top_n, limits, "top_logprobs" if chat else "logprobs")
        params.logprobs = top_n
    if body.logprob_token_ids:
        params.logprob_token_ids.extend(_logprob_token_ids(body, top_n, limits))
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and not chat and body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs  # echo shows the prompt's logprobs too
    if prompt_logprobs is not None:
        _check_logprobs(prompt_logprobs, limits, "prompt_logprobs")
        params.prompt_logprobs = prompt_logprobs
    params.logit_bias.update(logit_bias(body.logit_bias, limits.vocab_size))
    for word in body.bad_words or ():
        for ids in bad_word_token_ids(word, tokenizer):
            params.bad_words.add(ids=ids)
    spec = structured(body) or (tool_constraint(body, mode) if mode is not None else None)
    if spec is not None:
        params.structured_outputs.CopyFrom(structured_to_proto(spec))
    return params


def logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Logprobs per generated token the answer lists (the top n, or each of
    ``logprob_token_ids`` and the chosen token), or None for no logprobs."""
    top_n = _top_logprobs(body)
    if top_n is not None and body.logprob_token_ids:
        return len(set(body.logprob_token_ids)) + 1
    return top_n


def _top_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Top-n logprobs per token the client asked for, or None for no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _logprob_token_ids(
    body: ChatCompletionRequest | CompletionRequest, top_n: int | None, limits: ModelLimits
) -> list[int]:
    """vLLM's ``logprob_token_ids``, checked as vLLM checks them."""
    ids, param = body.logprob_token_ids or [], "logprob_token_ids"
    if top_n is None:
        asks = "logprobs: true" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"when using logprob_token_ids, {asks} must be set", param)
    if isinstance(body, CompletionRequest) and body.echo and body.max_tokens == 0:
        raise bad_request(
            "logprob_token_ids is not supported when echo=True and max_tokens=0 because no "
            "output tokens are generated",
            param,
        )
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise bad_request(
            f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
            f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
            param,
        )
    outside = [t for t in ids if t >= limits.vocab_size]
    if outside:
        raise bad_request(
            f"token_id(s) {outside} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {limits.vocab_size}",
            param,
        )
    return ids


def _check_logprobs(n: int, limits: ModelLimits, param: str) -> None:
    if n > limits.max_logprobs:
        raise bad_request(
            f"{param} asks for the top {n} tokens; at most {limits.max_logprobs} are allowed "
            "(--max-logprobs)",
            param,
        )


def logit_bias(bias: dict[str, Any] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings to biases) as ids, checked as vLLM does."""
    if not bias:
        return {}
    bad_keys = [k for k in bias if not k.strip().lstrip("-").isdigit()]
    if bad_keys:
        raise bad_request(
            f"logit_bias keys must be token ids (integers), got {', '.join(map(repr, bad_keys))}",
            "logit_bias",
        )
    out = {}
    for key, value in bias.items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias: token id {token} is out of vocabulary (vocab size {vocab_size})",
                "logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise bad_request(
                f"logit_bias: the bias of token {token} is not a number", "logit_bias"
            )
        out[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
    return out


def bad_word_token_ids(word: str, tokenizer: Tokenizer) -> list[list[int]]:
    """The token sequences of a bad word, alone and after a space (as vLLM bans both)."""
    plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    out = [plain] if plain else []
    if spaced and spaced != plain and (not plain or spaced[0] != plain[0]):
        out.append(spaced)
    return out


def structured(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    """The constraint of ``structured_outputs`` or ``response_format`` (which wins, as in
    vLLM), or None."""
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt is not None and fmt.type == "json_schema":
        return _spec(
            lambda: StructuredOutputs(json=json.dumps(fmt.json_schema.json_schema)),
            "response_format",
        )
    if fmt is not None and fmt.type == "structural_tag":
        raise bad_request("response_format structural_tag is not served", "response_format")
    so = body.structured_outputs
    return None if so is None else _from_params(so)


def _from_params(so: StructuredOutputsParams) -> StructuredOutputs:
    if so.structural_tag is not None:
        raise bad_request("structured_outputs.structural_tag is not served", "structured_outputs")
    if so.whitespace_pattern is not None:
        raise bad_request(
            "structured_outputs.whitespace_pattern is not served: JSON is written compact",
            "structured_outputs",
        )
    kinds = {
        "json": None if so.json_ is None else _schema_text(so.json_),
        "regex": so.regex,
        "choice": None if so.choice is None else tuple(so.choice),
        "grammar": so.grammar,
        "json_object": so.json_object or False,
    }
    return _spec(lambda: StructuredOutputs(**kinds), "structured_outputs")


def _schema_text(schema: dict[str, Any] | str | bool) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _spec(make, param: str) -> StructuredOutputs:
    try:
        return make()
    except ValueError as error:
        raise bad_request(f"{param}: {error}", param) from None


def choices(
    prompts: list[Prompt],
    params: common_pb2.SamplingParams,
    body: ChatCompletionRequest | CompletionRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    request_id: str,
    max_tokens_default: int | None,
) -> list[PreparedRequest]:
    """One prepared request per prompt and choice, in choice order (prompt-major)."""
    if body.n * len(prompts) > limits.max_n:
        raise APIError(
            400,
            f"the request asks for {body.n * len(prompts)} choices (n x prompts); at most "
            f"{limits.max_n} are allowed (--max-n)",
            param="n",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
    out = []
    for i, prompt in enumerate(prompts):
        proto = gateway_pb2.GenerateRequest(
            prompt_token_ids=gateway_pb2.TokenIds(ids=prompt.token_ids),
            params=params,
            stop=stop,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=skip_special,
            request_id=body.request_id or "",
        )
        try:
            first = prepare(
                proto, tokenizer, limits, f"{request_id}-{i * body.n}", max_tokens_default
            )
        except InvalidRequest as error:
            raise bad_request(str(error), _param_of(str(error), body)) from None
        out.append(first)
        for j in range(1, body.n):
            p = common_pb2.SamplingParams()
            p.CopyFrom(first.params)
            if body.seed is not None:
                p.seed = (body.seed + j) % SEED_SPACE
            out.append(replace(first, request_id=f"{request_id}-{i * body.n + j}", params=p))
    return out


def _param_of(message: str, body: Any) -> str | None:
    """The field an InvalidRequest names first ("temperature must be ..."), if it is a field."""
    word = message.split(maxsplit=1)[0] if message else ""
    return word if word in type(body).model_fields else None
