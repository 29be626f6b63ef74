"""A profile: what one prefill and one decode worker of a model cost, as served, on one kind
of machine (measured by `pdserve profile`), and the cost functions the simulator reads
from it. Pure Python: the planner runs in the slim image (no numpy, no torch).

All times are as the client of the gateway sees them at no load:

- ``prefill``: time to first token of a prompt of each measured length, sent alone through
  a gateway to a prefill worker (the gateway, the prefill's steps, the first token back).
- ``handover``: what the hand-over to the decode worker adds to the second token (the
  blocks' transfer and import), by prompt length.
- ``decode``: one decode step at each measured batch size, every sequence with about
  ``context`` tokens, plus ``attention_ms_per_token``: what each further token of context
  in the batch adds to a step.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_VERSION = 1


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points, extended past either end along its last segment."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Curve:
    """Measured points ``y(x)``, x ascending."""

    x: tuple[float, ...]
    y: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y) or not self.x:
            raise ValueError("a curve needs as many y as x, and at least one point")
        if list(self.x) != sorted(set(self.x)):
            raise ValueError(f"a curve's x must ascend without repeats: {list(self.x)}")

    def __call__(self, x: float) -> float:
        return interpolate(self.x, self.y, x)


@dataclass(frozen=True)
class Profile:
    """One worker's costs in ms; see the module's text."""

    model: str
    dtype: str
    hardware: dict
    prefill: Curve  # prompt tokens -> ms to the first token, alone, disaggregated
    handover: Curve  # prompt tokens -> ms the hand-over adds to the second token
    decode: Curve  # batch size -> ms a step, at ``context`` tokens a sequence
    context: int
    attention_ms_per_token: float
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # Quantiles (0, 5, ..., 100%) of a decode gap over its batch's median, as measured: the
    # spread of steps and of their delivery to the client; (1.0,): none.
    jitter: tuple[float, ...] = (1.0,)
    measured: dict = field(default_factory=dict)  # what was measured, how long it took

    @property
    def name(self) -> str:
        """model-dtype-hardware, as the file is named."""
        return "-".join(
            _slug(part) for part in (self.model, self.dtype, self.hardware.get("class", "cpu"))
        )

    def prefill_ms(self, prompt: float) -> float:
        """Time to first token of a prompt of ``prompt`` tokens, alone: a + b L + c L^2 (the
        linears and the attention) fitted to the measured points, each weighed by its
        relative error; straight lines between them with fewer than 3."""
        fit = _quadratic(self.prefill) if len(self.prefill.x) >= 3 else None
        value = (
            self.prefill(prompt) if fit is None else fit[0] + (fit[1] + fit[2] * prompt) * prompt
        )
        return max(value, 0.5 * self.prefill.y[0])

    @property
    def overhead_ms(self) -> float:
        """The part of a time to first token that is no worker's compute (the gateway, the
        calls): the prefill curve at 0 tokens less a decode step, at least 0."""
        x, y = self.prefill.x, self.prefill.y
        at_zero = y[0] if len(x) == 1 else y[0] - (y[1] - y[0]) * x[0] / (x[1] - x[0])
        return min(max(at_zero - self.decode.y[0], 0.0), 0.9 * y[0])

    def service_ms(self, prompt: float) -> float:
        """What a prompt occupies a worker for: its prefill less the overhead."""
        return self.prefill_ms(prompt) - self.overhead_ms

    def chunk_ms(self, start: int, end: int) -> float:
        """Compute of prompt tokens [start, end) prefilled in a step among decode rows."""
        if start == 0:
            return self.service_ms(end)
        return max(self.prefill_ms(end) - self.prefill_ms(start), 0.0)

    def handover_ms(self, prompt: float) -> float:
        return max(self.handover(prompt), 0.0)

    def jitter_at(self, u: float) -> float:
        """The gap-over-median ratio at quantile ``u`` in [0, 1)."""
        q = self.jitter
        if len(q) == 1:
            return q[0]
        return interpolate([i / (len(q) - 1) for i in range(len(q))], q, u)

    def step_ms(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        base = max(self.decode(batch), self.decode.y[0])
        extra = max(context_tokens - batch * self.context, 0)
        return base + self.attention_ms_per_token * extra

    # --- files ---------------------------------------------------------------------

    def to_json(self) -> dict:
        out = asdict(self)
        out = {"version": PROFILE_VERSION, **out}
        for key in ("prefill", "handover", "decode"):
            curve = getattr(self, key)
            out[key] = {"x": list(curve.x), "ms": list(curve.y)}
        return out

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {version!r}; this pdserve reads version {PROFILE_VERSION}: "
                "measure again with `pdserve profile`"
            )
        try:
            curves = {
                key: Curve(tuple(map(float, data[key]["x"])), tuple(map(float, data[key]["ms"])))
                for key in ("prefill", "handover", "decode")
            }
            return cls(
                model=str(data["model"]),
                dtype=str(data["dtype"]),
                hardware=dict(data.get("hardware", {})),
                context=int(data["context"]),
                attention_ms_per_token=float(data["attention_ms_per_token"]),
                max_num_seqs=int(data.get("max_num_seqs", 64)),
                max_num_batched_tokens=int(data.get("max_num_batched_tokens", 1024)),
                jitter=tuple(float(v) for v in data.get("jitter", (1.0,))),
                measured=dict(data.get("measured", {})),
                **curves,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pdserve profile: missing or wrong {e}") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"cannot read the profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"the profile {path} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the profile {path} is not a JSON object")
        return cls.from_json(data)


@functools.lru_cache(maxsize=64)
def _quadratic(curve: Curve) -> tuple[float, float, float] | None:
    """Least squares a + b x + c x^2 through ``curve``'s points, relative errors (None when
    singular)."""
    rows = [(1 / y, x / y, x * x / y) for x, y in zip(curve.x, curve.y, strict=True) if y > 0]
    # The normal equations: (A^T A) c = A^T 1.
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] for r in rows) for i in range(3)]
    for col in range(3):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot], v[col], v[pivot] = m[pivot], m[col], v[pivot], v[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
                v[r] -= f * v[col]
    return tuple(v[i] / m[i][i] for i in range(3))


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "._" else "-" for c in text.strip())
    return keep.strip("-") or "x"


def percentile(values: Sequence[float], p: float) -> float:
    """numpy's default (linear) percentile; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
