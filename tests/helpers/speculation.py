"""A draft proposer for speculation tests: transformers' own continuation, now and then wrong."""

from __future__ import annotations

from pdserve.testing.tiny_models import TINY_VOCAB


class ReferenceProposer:
    """Proposes transformers' greedy continuation of each prompt; every ``wrong_every``-th
    proposal has one wrong token (at a rotating position), and requests of the prompts in
    ``silent`` propose nothing (they decode beside the others without speculating)."""

    def __init__(self, refs, wrong_every: int = 3, silent: frozenset[int] = frozenset()):
        self.refs = [(r.prompt, r.tokens) for r in refs]
        self.wrong_every = wrong_every
        self.silent = silent
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for i, (prompt, answer) in enumerate(self.refs):
            if len(token_ids) > len(prompt) and token_ids[: len(prompt)] == prompt:
                if i in self.silent:
                    return []
                done = len(token_ids) - len(prompt)
                drafts = list(answer[done : done + k])
                self.calls += 1
                if drafts and self.calls % self.wrong_every == 0:
                    j = self.calls % len(drafts)
                    drafts[j] = (drafts[j] + 1) % TINY_VOCAB
                return drafts
        return []
