"""What a request asks of sampling, and what it gets back per token.

Free of torch: the gateway checks these, the engine samples with them, and they cross
the wire between them (``pdserve.wire.convert``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Most ids one request may ask logprobs of (vLLM's bound).
MAX_LOGPROB_TOKEN_IDS = 128
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# A temperature below this samples greedily, as in vLLM: dividing logits by it would
# overflow to inf and make the probabilities NaN.
SAMPLING_EPS = 1e-5
# max_tokens of a request that leaves it unset (the gateway's --max-tokens-default).
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output, as vLLM's ``structured_outputs``: exactly one of a
    JSON schema (as JSON text), any JSON object, a regular expression, one of some strings,
    or a grammar in EBNF (GBNF, as llama.cpp and xgrammar write it)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs takes exactly one of json, json_object, regex, choice and "
            f"grammar, got {', '.join(given) or 'none'}",
        )
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            _check(
                isinstance(schema, dict | bool),
                f"a JSON schema is an object (or true/false), got {type(schema).__name__}",
            )
        if self.choice is not None:
            _check(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                "choice must be a non-empty list of non-empty strings",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), f"{name} is empty")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint's text (a choice as its JSON list; "" for json_object)."""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        value = getattr(self, self.kind)
        return "" if value is True else value

    def key(self) -> bytes:
        """A stable key of the constraint (compiled grammars are cached by it)."""
        text = f"{self.kind}\0{self.source}".encode()
        return hashlib.blake2b(text, digest_size=16).digest()


KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 (or below SAMPLING_EPS) means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 and min_p 0.0
    disable theirs. A seed makes sampling reproducible whatever the batch. Penalties follow
    vLLM: presence and frequency (0.0: off) count output tokens only; repetition (1.0: off)
    divides or multiplies the logits of every token seen in the prompt or the output.

    What a token may be, as vLLM: ``structured_outputs`` (a grammar the output follows),
    ``allowed_token_ids`` (None: any), ``bad_words_token_ids`` (token sequences never
    completed), and ``min_tokens`` (no stop token before that many); ``logit_bias`` adds to
    tokens' logits (a dict or (token, bias) pairs). ``prompt_logprobs``: the logprobs of
    every prompt token after the first, with the top n at each position.
    ``logprob_token_ids`` (with ``logprobs``): at each generated position, the logprobs of
    these tokens and of the chosen one instead of the top n (vLLM's field of that name).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputs | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias or ()
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in pairs)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logprob_token_ids is not None:
            object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        words = tuple(tuple(w) for w in self.bad_words_token_ids or ())
        object.__setattr__(self, "bad_words_token_ids", words)
        self._check_values()
        self._check_token_rules()

    def _check_values(self) -> None:
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
            f"temperature must be in [0, 100], got {self.temperature!r}",
        )
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            f"seed must be a non-negative integer below 2**63, got {self.seed!r}",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2.0 <= value <= 2.0,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2] (1.0 is off), got {self.repetition_penalty!r}",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
            f"got {self.prompt_logprobs!r}",
        )

    def _check_token_rules(self) -> None:
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs must be a StructuredOutputs",
        )
        for token, bias in self.logit_bias:
            _check(_is_int(token) and token >= 0, f"logit_bias: {token!r} is not a token id")
            _check(
                _is_number(bias) and math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS,
                f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
            )
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids)
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids must be a non-empty list of token ids",
            )
        for word in self.bad_words_token_ids:
            _check(
                bool(word) and all(_is_int(t) and t >= 0 for t in word),
                f"bad_words_token_ids: {list(word)!r} is not a non-empty list of token ids",
            )
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            _check(
                0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in ids),
                f"logprob_token_ids must be 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                f"{list(ids)[:8]!r}{'...' if len(ids) > 8 else ''}",
            )
            _check(
                self.logprobs is not None,
                "logprob_token_ids must be sent with logprobs (their logprobs take the "
                "top-n's place)",
            )

    def token_ids_used(self) -> list[int]:
        """Every token id the parameters name (to check against a vocabulary)."""
        ids = [*self.stop_token_ids, *(t for t, _ in self.logit_bias)]
        ids += [*(self.allowed_token_ids or ()), *(t for w in self.bad_words_token_ids for t in w)]
        return [*ids, *(self.logprob_token_ids or ())]

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether any presence, frequency or repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_token_rules(self) -> bool:
        """Whether allowed_token_ids, bad words, min_tokens or a logit bias change the logits
        (a grammar is apart: ``structured_outputs``)."""
        return bool(
            self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or self.min_tokens
            or self.logit_bias
        )


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and of the top-n candidates at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int = 0  # 1 + the tokens more probable than it; 0: not known


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
