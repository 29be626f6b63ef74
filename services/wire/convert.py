"""Conversions between pdserve's plain types and their protobuf messages, each written once.

Sampling parameters cross the wire as ``common_pb2.SamplingParams`` whose proto3 zeros
mean "unset" (a client may leave any field out); ``sampling_from_proto`` is the one place
that reads them, and ``sampling_to_proto`` writes every value explicitly, so a worker
reads back exactly what the gateway checked.
"""

from __future__ import annotations

from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import (
    DEFAULT_MAX_TOKENS,
    SamplingParams,
    StructuredOutputs,
    TokenLogprobs,
)
from pdserve.v1 import common_pb2


def sampling_from_proto(
    p: common_pb2.SamplingParams, max_tokens_default: int = DEFAULT_MAX_TOKENS
) -> SamplingParams:
    """proto3 zeros mean "unset": max_tokens 0 -> ``max_tokens_default``, top_p 0 -> 1, top_k 0
    -> off, repetition_penalty 0 -> 1 (off). Raises ValueError (naming the parameter) for a
    nonsense value."""
    return SamplingParams(
        max_tokens=p.max_tokens or max_tokens_default,
        temperature=p.temperature,
        top_k=p.top_k or -1,
        top_p=p.top_p or 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        structured_outputs=structured_from_proto(p.structured_outputs)
        if p.HasField("structured_outputs")
        else None,
        logit_bias=dict(p.logit_bias),
        allowed_token_ids=tuple(p.allowed_token_ids) or None,
        bad_words_token_ids=tuple(tuple(w.ids) for w in p.bad_words),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        logprob_token_ids=tuple(p.logprob_token_ids) or None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The message a worker receives: every value explicit, no proto3 zero to interpret."""
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
    if params.structured_outputs is not None:
        proto.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    proto.logit_bias.update(dict(params.logit_bias))
    proto.allowed_token_ids.extend(params.allowed_token_ids or ())
    proto.bad_words.extend(common_pb2.TokenIdList(ids=w) for w in params.bad_words_token_ids)
    if params.prompt_logprobs is not None:
        proto.prompt_logprobs = params.prompt_logprobs
    proto.logprob_token_ids.extend(params.logprob_token_ids or ())
    return proto


def structured_from_proto(p: common_pb2.StructuredOutputs) -> StructuredOutputs:
    """A constraint from its message; ValueError when it sets no kind, or a bad one."""
    kind = p.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "structured_outputs sets none of json, json_object, regex, choice, grammar"
        )
    if kind == "choice":
        return StructuredOutputs(choice=tuple(p.choice.values))
    return StructuredOutputs(**{kind: getattr(p, kind)})


def structured_to_proto(s: StructuredOutputs) -> common_pb2.StructuredOutputs:
    """A constraint as its message."""
    if s.choice is not None:
        return common_pb2.StructuredOutputs(choice=common_pb2.StringList(values=s.choice))
    return common_pb2.StructuredOutputs(**{s.kind: getattr(s, s.kind)})


def logprob_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    """A token's logprobs as their message."""
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top=lp.top, rank=lp.rank
    )


def logprob_from_proto(lp: common_pb2.TokenLogprob) -> TokenLogprobs:
    """A token's logprobs from their message."""
    return TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=dict(lp.top), rank=lp.rank)


def finish_reason_to_proto(reason: FinishReason | None) -> str:
    """A message's ``finish_reason``: "" while the request goes on, which a PREFILLED one
    does (on a decode worker)."""
    return "" if reason is None or reason is FinishReason.PREFILLED else reason.value


def finish_reason_from_proto(text: str) -> FinishReason | None:
    """A message's ``finish_reason`` ("": none yet); ValueError for a word no worker sends."""
    return FinishReason(text) if text else None
