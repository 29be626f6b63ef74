"""Speculative decoding: proposers, the acceptance rule, the switches and the counters.

Each step, a running request past its prompt may get up to ``num_speculative_tokens``
proposed tokens (its drafts). The step then scores the request's last token and its
drafts together (a query of k+1 tokens over its paged context, in the same batch as every
other request), and the target model draws its own token at each of the k+1 positions, as
it would have without speculation. The drafts are accepted up to the first one that
differs from the target's draw; the target's draw there (or after the last draft, the
bonus token) comes next. So a step emits 1 to k+1 tokens, all of them the target's.

A proposal here is one token per position (a point mass: n-gram lookup, or a draft model's
greedy choice). For a point mass q = δ(x), Leviathan et al.'s rule accepts x with
probability min(1, p(x) / q(x)) = p(x) and, on rejection, draws from the residual
norm(max(0, p - q)), which is p without x. Drawing y ~ p once and accepting iff y = x has
exactly that law; and since y is the draw the request would have made without speculation
(a seeded request draws from its seed and the token's index), a request's output is the
same with speculation on or off, greedy or seeded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.engine.sequence import Sequence
from pdserve.settings.speculative import SpeculativeConfig

# Proposals a request's acceptance rate is measured over, and the steps a request whose
# rate fell below ``min_acceptance_rate`` waits before it proposes again: doubled at each
# failure in a row (up to MAX_BACKOFF_STEPS), so that a request that never accepts costs
# next to nothing.
ACCEPTANCE_WINDOW = 8
BACKOFF_STEPS = 16
MAX_BACKOFF_STEPS = 1024


def accept_drafts(drafts: list[int], draws: list[int]) -> list[int]:
    """The tokens a verified request emits: the drafts up to the first that differs from the
    target's draw at its position, then the target's draw there (``draws`` has one more
    position than ``drafts``: the bonus token)."""
    out = []
    for draft, draw in zip(drafts, draws, strict=False):
        out.append(draw)
        if draft != draw:
            return out
    out.append(draws[len(drafts)])
    return out


# The rule the runner applies: (the drafts, the target's draws at each position, its raw
# logits there [k+1, vocab], the sequence) -> the emitted tokens. Tests swap in broken
# rules to show that the distribution test catches them.
AcceptanceRule = Callable[[list[int], list[int], object, Sequence], list[int]]


def default_rule(drafts: list[int], draws: list[int], logits: object, seq: Sequence) -> list[int]:
    return accept_drafts(drafts, draws)


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max]
    that occurs."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[n_tokens - n :]
            # Windows that start before the suffix itself and are followed by a token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


@dataclass
class _RequestSpec:
    """A request's recent acceptance, for the acceptance switch."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    resume_at: int = 0  # the step from which it may propose again
    backoff: int = BACKOFF_STEPS  # steps of its next back-off


class SpecDecoder:
    """Decides, per step and request, whether and what to speculate; counts the outcome."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None) -> None:
        """``proposer``: the draft-model proposer (``draft_model``), made by the engine,
        which owns the model's device and dtype; n-gram lookup otherwise."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else NgramProposer(config)
        self.stats = SpecDecodeStats()
        self._requests: dict[str, _RequestSpec] = {}
        self._step = 0

    def eligible(self, seq: Sequence) -> bool:
        """Whether ``seq`` may speculate at all: a decode request without penalties or bad
        words (what they look at would change inside the step)."""
        p = seq.params
        return not seq.prefill_only and not p.has_penalties and not p.bad_words_token_ids

    def begin_step(self, num_running: int) -> bool:
        """Called once per step: whether this step speculates (the batch-size switch)."""
        self._step += 1
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def room(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may get now: none while it backs off, and no more than
        its ``max_tokens`` and the model's length leave room for (with the target's own
        token after them)."""
        state = self._requests.get(seq.request_id)
        if state is not None and state.resume_at > self._step:
            return 0
        return min(
            self.config.num_speculative_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )

    def propose(self, seq: Sequence) -> list[int]:
        """Drafts for ``seq``, which is past its prompt (its last token is its only one to
        compute)."""
        return self.propose_all([seq]).get(seq.request_id, [])

    def propose_all(self, seqs: list[Sequence]) -> dict[str, list[int]]:
        """Drafts for each of ``seqs`` (by request id; a request without any is absent)."""
        rooms = {s.request_id: r for s in seqs if (r := self.room(s)) > 0}
        wanted = [(s, rooms[s.request_id]) for s in seqs if s.request_id in rooms]
        if not wanted:
            return {}
        if hasattr(self.proposer, "propose_all"):  # batched (a draft model)
            drafts = self.proposer.propose_all(wanted)
        else:
            drafts = {s.request_id: self.proposer.propose(s.token_ids, r) for s, r in wanted}
        drafts = {k: v[: rooms[k]] for k, v in drafts.items() if v}
        for s, _ in wanted:  # a draft its grammar refuses would be rejected: not proposed
            if s.grammar is not None and s.request_id in drafts:
                valid = s.grammar.valid_prefix(drafts[s.request_id])
                drafts[s.request_id] = drafts[s.request_id][:valid]
        return {k: v for k, v in drafts.items() if v}

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: counted, and the request's acceptance switch updated."""
        self.stats.record(num_drafts, num_accepted)
        if seq.spec_pending is None:
            seq.spec_pending = SpecDecodeStats()
        seq.spec_pending.record(num_drafts, num_accepted)
        state = self._requests.setdefault(seq.request_id, _RequestSpec())
        state.proposed.append(num_drafts)
        state.accepted.append(num_accepted)
        if len(state.proposed) > ACCEPTANCE_WINDOW:
            del state.proposed[0], state.accepted[0]
        if len(state.proposed) == ACCEPTANCE_WINDOW:
            rate = sum(state.accepted) / sum(state.proposed)
            if rate < self.config.min_acceptance_rate:
                state.resume_at = self._step + state.backoff + 1
                state.backoff = min(2 * state.backoff, MAX_BACKOFF_STEPS)
                state.proposed.clear()
                state.accepted.clear()
            else:
                state.backoff = BACKOFF_STEPS

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(request_id)
