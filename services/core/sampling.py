"""What a request asks of sampling, and what it gets back per token.

Free of torch: the gateway checks these, the engine samples with them, and they cross
the wire between them (``pdserve.wire.convert``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# A temperature below this samples greedily, as in vLLM: dividing logits by it would
# overflow to inf and make the probabilities NaN.
SAMPLING_EPS = 1e-5
# max_tokens of a request that leaves it unset (the gateway's --max-tokens-default).
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 (or below SAMPLING_EPS) means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 and min_p 0.0
    disable theirs. A seed makes sampling reproducible whatever the batch. Penalties follow
    vLLM: presence and frequency (0.0: off) count output tokens only; repetition (1.0: off)
    divides or multiplies the logits of every token seen in the prompt or the output.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
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


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and of the top-n candidates at one step."""

    token_id: int
    logprob: float
    top: dict[int, float]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
