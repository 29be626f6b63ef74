"""Stop strings on streamed text: truncate at the first one, never emit a piece of one."""

from __future__ import annotations


class StopChecker:
    """Watches a stream of text for stop strings.

    ``feed`` returns what is safe to emit: text that no stop string can still begin in
    is passed on, a tail that may be the start of one is held back until the next feed
    decides. The stop string that completes first in the stream wins (the longer on a
    tie), and is not emitted, so the output does not depend on how the text was chunked.
    """

    def __init__(self, stop: list[str], include: bool = False) -> None:
        """``include``: the stop string that ends the text is part of it (vLLM's
        include_stop_str_in_output)."""
        self._stop = sorted({s for s in stop if s}, key=len, reverse=True)
        self._include = include
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop string hit)."""
        if self.stopped:
            return "", True
        text = self._held + new_text
        hit = self._first_stop(text)
        if hit is not None:
            cut, self.matched = hit
            self._held = ""
            self.stopped = True
            return text[: cut + len(self.matched) if self._include else cut], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of the stream (no stop string came of it)."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        return text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first completed stop string in ``text`` starts, and which, or None."""
        best: tuple[int, int, str] | None = None  # (end, start, string)
        for s in self._stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, text: str) -> int:
        """The length of the longest tail of ``text`` that some stop string starts with."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[-n:]):
                    longest = n
                    break
        return longest
