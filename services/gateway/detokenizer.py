"""Incremental detokenization: the new text each batch of generated tokens adds.

Decoding each token on its own goes wrong in two ways: a character whose UTF-8 bytes
span several tokens decodes as U+FFFD until its last byte arrives, and tokenizers
whose decoders look at neighbours (SentencePiece's leading "▁", cleanup of spaces)
decode a suffix differently from the suffix of the whole decode. vLLM's answer, used
here: keep two offsets into the token list. ``tokens[prefix_offset:read_offset]`` is
a few tokens of context whose text was already emitted; decoding
``tokens[prefix_offset:]`` and dropping the context's text gives the new text, in the
context of its neighbours. Text is held back while it ends in U+FFFD.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as context for the first output tokens (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The one method of a Hugging Face tokenizer that detokenization needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's output tokens, as they arrive, into the text they add.

    The concatenation of every ``add()`` and ``finish()`` is the text of the output
    tokens decoded in the context of the prompt's last tokens; for byte-level BPE
    tokenizers (GPT-2, Llama 3, SmolLM2, Qwen2) that is exactly
    ``tokenizer.decode(output_token_ids, skip_special_tokens=...)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would swallow the first output bytes into
        # its own U+FFFD; such a prompt gives no context.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return only the text they complete (maybe "")."""
        pieces = []
        for token_id in token_ids:
            self._tokens.append(token_id)
            pieces.append(self._advance(final=False))
        return "".join(pieces)

    def finish(self) -> str:
        """The text still held back (an unfinished character shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token, or bytes that make no character yet
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        # Only the tokens of the last emitted text stay, as context for the next.
        del self._tokens[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
