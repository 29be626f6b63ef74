"""Per-request rules on what a token may be, applied to a step's logits before penalties and
sampling, as vLLM's built-in logits processors: ``allowed_token_ids``, ``bad_words``,
``min_tokens`` (no stop token before that many), and ``logit_bias``.

Rows without a rule are left as they are; a step with none at all costs one pass over the
sequences' parameters.
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import Sequence


def apply_token_rules(logits: torch.Tensor, seqs: list[Sequence], offsets: list[int]) -> None:
    """Apply each row's rules to ``logits`` [M, vocab] in place: row k samples ``seqs[k]``'s
    token ``offsets[k]`` positions after its next one."""
    ruled = [k for k, s in enumerate(seqs) if s.params.has_token_rules]
    if not ruled:
        return
    neg_inf = float("-inf")
    vocab = logits.shape[1]
    for k in ruled:
        seq, p = seqs[k], seqs[k].params
        row = logits[k]
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = True
            row.masked_fill_(~keep, neg_inf)
        banned = _banned_by_bad_words(p.bad_words_token_ids, seq.output_token_ids)
        if seq.num_output_tokens + offsets[k] < p.min_tokens:
            banned += [*p.stop_token_ids, *([] if p.ignore_eos else seq.eos_token_ids)]
        banned = [t for t in banned if t < vocab]
        if banned:
            row[banned] = neg_inf
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias if t < vocab]
            bias = [b for t, b in p.logit_bias if t < vocab]
            row[ids] += torch.tensor(bias, dtype=row.dtype, device=row.device)


def _banned_by_bad_words(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output (a one-token word
    is always banned), so that no bad word is ever completed."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == list(prefix)):
            banned.append(word[-1])
    return banned
