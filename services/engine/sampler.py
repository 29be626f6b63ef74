"""Next-token choice for a batch of rows: penalties, greedy, temperature, top-k, top-p, min-p,
seeds, logprobs."""

from __future__ import annotations

import hashlib

import torch

from services.common.sampling import TokenLogprobs
from services.engine.sequence import Sequence


class Sampler:
    """Picks one token per row of logits.

    A seeded request's k-th token is drawn from a generator seeded with (seed, k) alone, so
    its tokens depend neither on the batch nor on which worker samples which step: a request
    prefilled on one worker and decoded on another draws what one worker would have drawn.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [M, vocab] float32, row i for seqs[i].

        Logprobs are those of the raw logits, before penalties and temperature, as vLLM's.
        """
        raw = logits.float()
        logits = apply_penalties(raw, seqs)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            tokens = tokens.clone()
            for i in sampled_rows:
                # Generators live on the CPU, so seeded draws are the same on every device.
                probs = _filtered_probs(logits[i], seqs[i]).cpu()
                seed = seqs[i].params.seed
                gen = (
                    self.generator
                    if seed is None
                    else _step_generator(seed, seqs[i].num_output_tokens)
                )
                tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for row, i in enumerate(want):
                logprobs[i] = _token_logprobs(lp[row], token_list[i], seqs[i].params.logprobs)
        return token_list, logprobs


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


def _filtered_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """[vocab] logits -> probabilities after temperature, top-k, top-p and min-p."""
    p = seq.params
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already cover top_p; always keep the first.
        drop = (cum - torch.softmax(sorted_x, dim=-1)) >= p.top_p
        drop[0] = False
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _token_logprobs(lp: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    top: dict[int, float] = {}
    if top_n:
        values, ids = torch.topk(lp, top_n)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id=token, logprob=float(lp[token]), top=top)
