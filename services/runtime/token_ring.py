"""The internal token as it rotates: the token a process sends and the ones it accepts.

A token given by ``--internal-token-file`` is read again when the file changes (looked at,
by ``stat``, at most once a second, when a call needs the token), as Kubernetes rewrites a
mounted Secret. On a change, the previous token stays accepted for ``overlap_s`` and is
still *sent* for its first half: every process switches what it sends only after every
other one (which sees the new file within that half, by the rule) accepts the new token,
and accepts the old one for as long as anyone may still send it. So one write of the file
rotates a cluster without a refused call (docs/security.md, "Rotation").
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pdserve.settings.process import MIN_TOKEN_CHARS

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TokenRing:
    """The current token, and during a rotation the previous one (see the module)."""

    def __init__(
        self,
        token: str,
        path: str | None = None,
        overlap_s: float = 300.0,
        clock=time.monotonic,
    ) -> None:
        self._current = token
        self._previous: str | None = None
        self._path = path
        self._overlap_s = overlap_s
        self._clock = clock
        self._stamp = _stamp(path) if path else None
        self._next_check = clock() + CHECK_EVERY_S
        self._send_previous_until = 0.0
        self._accept_previous_until = 0.0
        self._bad_file_warned = False

    def __repr__(self) -> str:  # never the tokens
        return f"TokenRing(path={self._path!r}, overlap_s={self._overlap_s})"

    def sent(self) -> str:
        """The token to send on a call now."""
        self._follow()
        if self._previous is not None and self._clock() < self._send_previous_until:
            return self._previous
        return self._current

    def accepted(self) -> tuple[str, ...]:
        """The tokens a call may carry now: the current one, and the previous one during
        the overlap."""
        self._follow()
        if self._previous is not None and self._clock() < self._accept_previous_until:
            return (self._current, self._previous)
        return (self._current,)

    def _follow(self) -> None:
        """Read the file again if it changed since it was last looked at."""
        if self._path is None or self._clock() < self._next_check:
            return
        self._next_check = self._clock() + CHECK_EVERY_S
        stamp = _stamp(self._path)
        if stamp is None or stamp == self._stamp:
            return
        try:
            lines = Path(self._path).read_text().strip().splitlines()
        except OSError:
            return  # being replaced: the next look reads it
        token = lines[0].strip() if lines else ""
        if len(token) < MIN_TOKEN_CHARS:
            if not self._bad_file_warned:
                logger.warning(
                    "--internal-token-file %s changed, but its first line is not a token of %d "
                    "characters or more: still using the previous token",
                    self._path,
                    MIN_TOKEN_CHARS,
                )
                self._bad_file_warned = True
            return
        self._stamp, self._bad_file_warned = stamp, False
        if token == self._current:
            return
        now = self._clock()
        self._previous, self._current = self._current, token
        self._send_previous_until = now + self._overlap_s / 2
        self._accept_previous_until = now + self._overlap_s
        logger.warning(
            "internal token rotated (%s changed): the previous token is still sent for %g s "
            "and accepted for %g s",
            self._path,
            self._overlap_s / 2,
            self._overlap_s,
        )
