"""Next-token choice for a batch of rows: penalties, greedy, temperature, top-k, top-p, min-p,
seeds, logprobs, vectorized over the batch (one host transfer per step at the end).

Sampling is an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token draws
exactly from ``probs``, and lets every row be drawn in one batched operation, whatever
its own noise came from.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from pdserve.core.sampling import TokenLogprobs
from pdserve.engine.logits_processors import apply_token_rules
from pdserve.engine.outputs import RequestError
from pdserve.engine.sequence import Sequence
from pdserve.engine.structured_output import apply_bitmask
from pdserve.kernels.sample_cpu import argmax

logger = logging.getLogger(__name__)


class Samples(NamedTuple):
    """One token per row (None where it could not be sampled), its logprobs when asked
    for, and why a row could not be sampled."""

    tokens: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: list[RequestError | None]


def _unsamplable(raw: torch.Tensor, allowed: torch.Tensor, seq: Sequence) -> RequestError:
    """The error of a row whose logits or probabilities are not usable; ``raw``: the model's
    logits, ``allowed``: after the grammar mask and the request's token rules."""
    if not bool(raw.isfinite().all()):
        return RequestError("the model's logits are not finite (NaN or inf)")
    p = seq.params
    if not bool((allowed > float("-inf")).any()):
        return RequestError(
            "no token may come next: the request's structured output, allowed_token_ids, "
            f"bad_words and min_tokens ({p.min_tokens}) together rule out every token",
            invalid=True,
        )
    return RequestError(
        "the sampling parameters make the next token's probabilities non-finite "
        f"(temperature={p.temperature:g}, top_k={p.top_k}, top_p={p.top_p:g}, "
        f"min_p={p.min_p:g}, repetition_penalty={p.repetition_penalty:g}, "
        f"presence_penalty={p.presence_penalty:g}, "
        f"frequency_penalty={p.frequency_penalty:g})",
        invalid=True,
    )


class Sampler:
    """Picks one token per row of logits.

    A seeded request's k-th token is drawn from noise seeded with (seed, k) alone, made on
    the CPU, so its tokens depend neither on the batch, nor on which worker samples which
    step, nor on the device: a request prefilled on one worker and decoded on another
    draws what one worker would have drawn. Unseeded rows share the sampler's generator.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        # A test's fault injection: called with every row's sequence before a draw; what
        # it raises is a fault in that row's sampling.
        self.fault: Callable[[Sequence], None] | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        offsets: list[int] | None = None,
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> Samples:
        """logits: [M, vocab], row i for seqs[i]; ``offsets[i]``: how many tokens after the
        sequence's next one row i draws (a speculating sequence scores several positions;
        a seeded draw is seeded by the token's index). Penalties see the sequence as it is,
        so rows with an offset must have none. ``bitmask``: the grammar masks of the rows
        that have one (``structured_output.step_bitmask``).

        Logprobs are those of the logits after the grammar mask, before the token rules,
        penalties and temperature, as vLLM's. A row that cannot be sampled gets token None
        and its error, and costs no other row anything: an exception in the batched draw
        is retried row by row.
        """
        offsets = offsets or [0] * len(seqs)
        try:
            return self._sample(logits, seqs, offsets, bitmask)
        except Exception as error:  # noqa: BLE001 (it becomes the rows' errors)
            if len(seqs) == 1:
                logger.exception("sampling request %s failed", seqs[0].request_id)
                return Samples([None], [None], [RequestError(f"sampling failed: {error!r}")])
        samples = Samples([], [], [])
        for i, seq in enumerate(seqs):
            mask = None
            if bitmask is not None and i in bitmask[1]:
                mask = (bitmask[0][i : i + 1], [0])
            row = self(logits[i : i + 1], [seq], offsets[i : i + 1], mask)
            for mine, theirs in zip(samples, row, strict=True):
                mine.extend(theirs)
        return samples

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        offsets: list[int],
        bitmask: tuple[torch.Tensor, list[int]] | None,
    ) -> Samples:
        if self.fault is not None:
            for s in seqs:
                self.fault(s)
        raw = logits.float()
        if bitmask is not None:
            if raw is logits:  # the caller's tensor stays as it was
                raw = raw.clone()
            apply_bitmask(raw, *bitmask)
        ruled = raw
        if any(s.params.has_token_rules for s in seqs):
            ruled = raw.clone()
            apply_token_rules(ruled, seqs, offsets)
        penalized = apply_penalties(ruled, seqs)
        tokens = argmax(penalized)
        # argmax picks a NaN when there is one: the value at the pick tells a bad row, as
        # does -inf (every token ruled out).
        picked = penalized.gather(1, tokens[:, None])[:, 0]
        ok = ~picked.isnan() & (picked != float("-inf"))
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=raw.device)
            probs = filtered_probs(penalized[rows], [seqs[i] for i in sampled])
            noise = self._noise(probs, [seqs[i] for i in sampled], [offsets[i] for i in sampled])
            picks = argmax(probs / noise)
            tokens = tokens.index_copy(0, rows, picks)
            # NaN or all-zero probabilities: the pick's probability is not > 0.
            ok = ok.index_copy(0, rows, probs.gather(1, picks[:, None])[:, 0] > 0)
        token_list: list[int | None] = tokens.tolist()
        errors: list[RequestError | None] = [None] * len(seqs)
        if not bool(ok.all()):
            for i in (~ok).nonzero()[:, 0].tolist():
                token_list[i] = None
                errors[i] = _unsamplable(logits[i].float(), ruled[i], seqs[i])
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        want = [
            i
            for i, s in enumerate(seqs)
            if s.params.logprobs is not None and token_list[i] is not None
        ]
        if want:
            picked = [token_list[i] for i in want]
            tops = [seqs[i].params.logprobs for i in want]
            chosen = [seqs[i].params.logprob_token_ids for i in want]
            for i, lp in zip(want, token_logprobs(raw[want], picked, tops, chosen), strict=True):
                logprobs[i] = lp
        return Samples(token_list, logprobs, errors)

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence], offsets: list[int]) -> torch.Tensor:
        """[R, vocab] Exp(1) noise: seeded rows from (seed, step), the rest from the sampler."""
        seeded = [k for k, s in enumerate(seqs) if s.params.seed is not None]
        if probs.device.type == "cpu":
            noise = torch.empty_like(probs)
            if len(seeded) < len(seqs):
                noise.exponential_(generator=self.generator)
        else:
            noise = torch.empty_like(probs).exponential_(generator=self._device_generator(probs))
        for k in seeded:
            s = seqs[k]
            gen = _step_generator(s.params.seed, s.num_output_tokens + offsets[k])
            row = torch.empty(probs.shape[1]).exponential_(generator=gen)
            noise[k] = row.to(probs.device)
        # A draw of exactly 0 would turn a filtered-out token's 0 / 0 into NaN, which argmax
        # picks; the smallest normal float keeps it at 0 and changes nothing else.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _device_generator(self, like: torch.Tensor) -> torch.Generator:
        gen = self._device_generators.get(like.device)
        if gen is None:
            gen = torch.Generator(device=like.device).manual_seed(self.seed)
            self._device_generators[like.device] = gen
        return gen


def filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[R, vocab] logits -> probabilities after each row's temperature, top-k, top-p, min-p."""
    num_rows, vocab = logits.shape
    dev = logits.device
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    x = logits / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, device=dev)
        top = x.topk(max(ks), dim=-1).values
        kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        x = top_p_filtered(x, torch.tensor(top_ps, dtype=x.dtype, device=dev))
    probs = torch.softmax(x, dim=-1)
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        m = torch.tensor(min_ps, dtype=probs.dtype, device=dev)[:, None]
        probs = probs.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


# Tokens a row's nucleus is looked for in first: a sort of the whole vocabulary costs 5 ms a
# row on a CPU, the top 128 a fraction of that, and they hold the nucleus of nearly every
# row a language model makes.
TOP_P_CANDIDATES = 128


def top_p_filtered(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, vocab] logits with each row's tokens outside its top-p nucleus set to -inf.

    A token is dropped when the more probable tokens before it already cover top_p (the
    first is always kept). A row whose TOP_P_CANDIDATES most probable tokens cover top_p
    is decided among them (every later token is dropped); the others sort their whole
    row. Rows with top_p 1 are left as they are.
    """
    on = top_p < 1.0
    k = min(TOP_P_CANDIDATES, x.shape[1])
    top_probs, top_ids = torch.softmax(x, dim=-1).topk(k, dim=-1)
    cum = top_probs.cumsum(dim=-1)
    keep = (cum - top_probs) < top_p[:, None]
    keep[:, 0] = True
    inside = on & (cum[:, -1] >= top_p)
    out = x
    if bool(inside.any()):
        kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, top_ids, keep)
        out = x.masked_fill(inside[:, None] & ~kept, float("-inf"))
    outside = (on & ~inside).nonzero()[:, 0]
    if len(outside):
        out = out.index_copy(0, outside, _top_p_by_sort(x[outside], top_p[outside]))
    return out


def _top_p_by_sort(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p_filtered`` over the whole sorted row (every row has top_p < 1)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    return x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))


def token_logprobs(
    raw: torch.Tensor,
    tokens: list[int],
    top_n: list[int],
    token_ids: list[tuple[int, ...] | None] | None = None,
) -> list[TokenLogprobs]:
    """Logprobs of each row's chosen token and its top ``top_n[r]`` (raw: [R, vocab]); a
    row with ``token_ids[r]`` gets those ids' logprobs and the chosen one's instead."""
    lp = torch.log_softmax(raw, dim=-1)
    chosen_t = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])
    ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    token_ids = token_ids or [None] * len(tokens)
    n = max(0 if token_ids[r] else top_n[r] for r in range(len(tokens)))
    top_values, top_ids = lp.topk(n, dim=-1) if n else (None, None)
    values = top_values.tolist() if n else [[]] * len(tokens)
    ids = top_ids.tolist() if n else [[]] * len(tokens)
    tops = [
        dict(zip(ids[r][: top_n[r]], values[r][: top_n[r]], strict=True))
        for r in range(len(tokens))
    ]
    for r, asked in enumerate(token_ids):
        if asked:
            named = sorted({*asked, tokens[r]})
            rows = lp[r, torch.tensor(named, device=lp.device)].tolist()
            tops[r] = dict(zip(named, rows, strict=True))
    return [
        TokenLogprobs(token_id=t, logprob=c, top=tops[r], rank=ranks[r])
        for r, (t, c) in enumerate(zip(tokens, chosen, strict=True))
    ]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[M, vocab] logits with each row's presence, frequency and repetition penalties applied.

    Rows without penalties are left as they are; with none at all, ``logits`` itself returns.
    """
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return logits
    penalized = logits.clone()
    penalized[rows] = _penalized_rows(logits[rows], [seqs[i] for i in rows])
    return penalized


def _penalized_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [R, vocab] for seqs, every one with a penalty."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts([s.output_token_ids for s in seqs], vocab).to(device)
    in_prompt = _token_counts([s.prompt_token_ids for s in seqs], vocab).to(device) > 0
    # [R, 1] per-row penalties, broadcast over the vocabulary
    rep, freq, pres = torch.tensor(
        [
            [s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
            for s in seqs
        ],
        dtype=logits.dtype,
        device=device,
    ).split(1, dim=1)
    seen = in_prompt | (output_counts > 0)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    return logits - freq * output_counts - pres * (output_counts > 0)


def _token_counts(token_ids: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_ids), vocab] int64: how often each row's list holds each token id."""
    # Offsetting row r's ids by r * vocab makes one bincount count every row.
    flat = torch.cat(
        [torch.tensor(ids, dtype=torch.int64) + row * vocab for row, ids in enumerate(token_ids)]
    )
    counts = torch.bincount(flat, minlength=len(token_ids) * vocab)
    return counts.view(len(token_ids), vocab)


def _step_generator(seed: int, step: int) -> torch.Generator:
    """A generator for one draw of a seeded request, from its seed and the token's index."""
    mixed = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed, "little") >> 1)
