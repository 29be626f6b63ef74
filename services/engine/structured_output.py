"""Structured outputs: a request's grammar as a mask over the vocabulary, at every position
where one of its tokens is sampled (xgrammar, as in vLLM and SGLang).

``GrammarCompiler`` compiles a constraint once per worker, cached by its key, on whatever
thread calls it: a worker compiles off the engine thread with a deadline first
(``pdserve.worker.grammars``), so a slow grammar never stalls a step, and the engine thread
then finds it cached. ``GrammarState`` is one request's matcher. It follows the tokens the
request emits (``Sequence.append_token``): a request imported from a prefill worker, or a
stream migrated from another decode worker, rebuilds it from its token ids alone.
``step_bitmask`` writes one step's masks (a speculating request's rows after its drafts:
the matcher advanced through them, then rolled back).

xgrammar is imported on first use: a worker that never sees a constraint never loads it.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pdserve.core.sampling import StructuredOutputs
from pdserve.kernels import sample_cpu

logger = logging.getLogger(__name__)

# Compiled grammars kept per worker (least recently used out first).
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint that cannot be compiled: a bad schema, regex or grammar."""


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe, cached by their keys.

    ``stop_token_ids``: the tokens the engine stops on (the model's EOS ids): a finished
    grammar allows only these, so a constrained request ends where its grammar does.
    """

    def __init__(
        self, tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: collections.OrderedDict[bytes, Any] = collections.OrderedDict()

    def warm(self) -> None:
        """Load xgrammar and the tokenizer's vocabulary (seconds), if not done yet."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        info = tokenizer_info(self.tokenizer_dir, self.vocab_size, self.stop_token_ids)
        logger.info("structured outputs: xgrammar loaded for %s", self.tokenizer_dir.name)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def is_cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            return spec.key() in self._cache

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it has it); GrammarError
        when it does not compile."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        self.warm()
        try:
            compiled = compile_spec(self._compiler, spec)
        except Exception as error:  # xgrammar raises RuntimeError / ValueError with its reason
            raise GrammarError(f"the {_describe(spec)} does not compile: {error}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutputs) -> GrammarState:
        """A new matcher at the start of ``spec``'s grammar."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(spec)))


def tokenizer_info(tokenizer_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo of a checkpoint's tokenizer, as ``from_huggingface`` makes
    it from transformers' fast tokenizer, made from the same Rust tokenizer without loading
    transformers' (a second or two and a hundred MiB per worker)."""
    import xgrammar as xgr

    from pdserve.core.tokenizer import Tokenizer

    backend = Tokenizer.from_dir(tokenizer_dir).backend
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != metadata["vocab_type"]:
        raise GrammarError(
            f"the tokenizer of {tokenizer_dir.name} is of a kind pdserve cannot describe to "
            "xgrammar (its vocabulary and its pipeline disagree)"
        )
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids or None,
        add_prefix_space=metadata["add_prefix_space"],
    )


def compile_spec(compiler: Any, spec: StructuredOutputs) -> Any:
    """``spec`` compiled by an xgrammar ``GrammarCompiler``: the grammar a constraint means."""
    # Compact JSON: whitespace only where the separators put it, so that no model can
    # spend its tokens on spaces and newlines between values.
    if spec.json is not None:
        return compiler.compile_json_schema(spec.json, any_whitespace=False)
    if spec.json_object:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.choice is not None:
        options = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return compiler.compile_grammar(f"root ::= {options}")
    return compiler.compile_grammar(spec.grammar)


def _describe(spec: StructuredOutputs) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }[spec.kind]


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no move) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and a stop token has been accepted."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed set into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar allows from here (none kept)."""
        n = 0
        for token in token_ids:
            if not self.accept(token):
                break
            n += 1
        self.rollback(n)
        return n


def step_bitmask(
    seqs: list, offsets: list[int], drafts: dict[str, list[int]], vocab_size: int
) -> tuple[torch.Tensor, list[int]] | None:
    """The token masks of one step's sampled rows: ``seqs[k]`` samples row k, ``offsets[k]``
    positions after its next token (its drafts before it). Returns the [rows, words] int32
    bitmask and the rows that have a grammar, or None when none has.

    A row after a draft the grammar refuses stays unmasked: verification stops at that
    draft (the target cannot draw a refused token there), so the row's draw is dropped.
    """
    rows = [k for k, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    advanced: dict[str, int] = {}
    refused: set[str] = set()
    try:
        for k in rows:
            seq, offset = seqs[k], offsets[k]
            rid = seq.request_id
            if offset and rid not in refused:
                if seq.grammar.accept(drafts[rid][offset - 1]):
                    advanced[rid] = advanced.get(rid, 0) + 1
                else:
                    refused.add(rid)
            if rid not in refused:
                seq.grammar.fill(bitmask, k)
    finally:
        by_id = {s.request_id: s for s in seqs}
        for rid, n in advanced.items():
            by_id[rid].grammar.rollback(n)
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose bits in ``bitmask`` are 0: the C
    kernel on the CPU (``pdserve.kernels.sample_cpu``), xgrammar's kernels elsewhere."""
    if sample_cpu.apply_bitmask(logits, bitmask, rows):
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )
