"""``--speculative-config``: what a decode worker speculates with, as vLLM spells it.

The flag's value is a JSON object, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}``; the embedded API takes the same keys as a dict. Torch-free: the
launcher and the chart's tests read it without the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from pdserve.core.errors import SettingsError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculation (docs/speculative.md).

    ``method``: ``ngram`` proposes the tokens that followed the latest earlier occurrence of
    the request's last ``prompt_lookup_max``..``prompt_lookup_min`` tokens (prompt lookup);
    ``draft_model`` runs ``model``, a smaller checkpoint with the same tokenizer, greedily
    (``pdserve.engine.draft_model``).
    ``num_speculative_tokens``: the most tokens proposed per request and step.

    The switches that turn it off where it does not pay: above ``disable_by_batch_size``
    running requests, no request speculates; a request whose recent proposals were accepted
    at a rate below ``min_acceptance_rate`` stops proposing for a while, then tries again.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.2

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """The config of a flag's JSON text (or a dict); None for none; SettingsError naming
        the field that is wrong."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise SettingsError(
                    f"--speculative-config must be a JSON object, e.g. "
                    f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\': {error}'
                ) from None
        if not isinstance(value, dict):
            raise SettingsError(
                f"--speculative-config must be a JSON object, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SettingsError(
                f"--speculative-config: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"the fields are {', '.join(sorted(known))}"
            )
        for name, kind in (
            ("method", str),
            ("num_speculative_tokens", int),
            ("prompt_lookup_max", int),
            ("prompt_lookup_min", int),
            ("model", str),
            ("disable_by_batch_size", int),
            ("min_acceptance_rate", (int, float)),
        ):
            v = value.get(name)
            if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
                raise SettingsError(
                    f"--speculative-config: {name} must be a "
                    f"{'number' if name == 'min_acceptance_rate' else kind.__name__}, got {v!r}"
                )
        return cls(**value)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise SettingsError(f"--speculative-config: {message}")

        need(
            self.method in METHODS,
            f"method must be one of {', '.join(METHODS)}, got {self.method!r}",
        )
        need(
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
            f"{self.num_speculative_tokens}",
        )
        need(
            self.prompt_lookup_min >= 1,
            f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}",
        )
        need(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
            f"({self.prompt_lookup_min})",
        )
        need(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
            f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}",
        )
        need(
            0.0 <= self.min_acceptance_rate <= 1.0,
            f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}",
        )
        if self.method == "draft_model":
            need(bool(self.model), 'method "draft_model" needs "model": the draft checkpoint')
        else:
            need(
                self.model is None, f'"model" applies to method "draft_model", not {self.method!r}'
            )

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
