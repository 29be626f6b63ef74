"""Registry entries and events signed by the cluster: anyone who can write to Redis cannot
make a gateway route prompts, or send the internal token, to an address of their choosing.

With an internal token, every value a worker writes (its entry, its ``down`` event) carries
``"sig"``: an HMAC-SHA256 of the value's canonical JSON (sorted keys, no spaces, without
``sig``) under a key derived from the token (``registry_key``: an HMAC of a fixed label,
so the token itself never reaches Redis). A view with the token keeps an entry only when
its signature verifies under one of its keys and its heartbeat time (``updated_at``) is
within ``MAX_ENTRY_AGE_S`` of the reader's clock, so an old signed entry replayed after its
worker died (its address perhaps another pod's now) is refused too. Without a token the
cluster is open (no internal call is authenticated either): values are written unsigned and
read as they are.

The signature is a field of the entry itself: a reader of an older version ignores it, and
the entry stays readable by ``pdserve status`` and by hand.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import time
from collections.abc import Sequence
from typing import Any, Protocol


class Tokens(Protocol):
    """The internal token as it rotates (``pdserve.runtime.token_ring.TokenRing``)."""

    def sent(self) -> str: ...

    def accepted(self) -> tuple[str, ...]: ...


SIGNATURE_FIELD = "sig"
_LABEL = b"pdserve registry signing v1"
# How stale a signed entry's last heartbeat may be (clock skew between nodes included).
MAX_ENTRY_AGE_S = 60.0


@functools.lru_cache(maxsize=8)
def registry_key(token: str | None) -> bytes | None:
    """The signing key of a cluster whose internal token is ``token`` (None: open)."""
    if not token:
        return None
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def _canonical(data: dict[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _signature(key: bytes, data: dict[str, Any]) -> str:
    return hmac.new(key, _canonical(data), hashlib.sha256).hexdigest()


def signed_json(data: dict[str, Any], key: bytes | None) -> str:
    """``data`` as compact JSON, with its signature under ``key`` (None: as it is)."""
    if key is not None:
        data = {**data, SIGNATURE_FIELD: _signature(key, data)}
    return json.dumps(data, separators=(",", ":"))


class Verifier:
    """Checks values read from the registry against the cluster's keys (the current one,
    and during a rotation the previous one too); with no key, accepts every value."""

    def __init__(
        self,
        keys: Sequence[bytes] = (),
        max_age_s: float = MAX_ENTRY_AGE_S,
        ring: Tokens | None = None,
    ) -> None:
        self._keys = tuple(keys)
        self._ring = ring
        self.max_age_s = max_age_s

    @classmethod
    def for_tokens(cls, *tokens: str | None) -> Verifier:
        return cls([k for k in map(registry_key, tokens) if k is not None])

    @classmethod
    def following(cls, ring: Tokens | None) -> Verifier:
        """The keys of the tokens ``ring`` accepts at each check (None: an open cluster)."""
        return cls(ring=ring)

    @property
    def keys(self) -> tuple[bytes, ...]:
        if self._ring is None:
            return self._keys
        return tuple(registry_key(t) for t in self._ring.accepted())

    @property
    def required(self) -> bool:
        """Whether values must be signed."""
        return bool(self.keys)

    def verified(self, data: dict[str, Any]) -> bool:
        """Whether ``data`` (a parsed value) carries a signature one of the keys made."""
        keys = self.keys
        if not keys:
            return True
        given = data.get(SIGNATURE_FIELD)
        if not isinstance(given, str):
            return False
        return any(hmac.compare_digest(given, _signature(k, data)) for k in keys)

    def why_refused(self, data: dict[str, Any], now: float | None = None) -> str | None:
        """Why a worker entry is not to be trusted, or None when it is: unsigned, a
        signature none of the keys made, or a heartbeat older than ``max_age_s``."""
        if not self.keys:
            return None
        if SIGNATURE_FIELD not in data:
            return "it is not signed"
        if not self.verified(data):
            return "its signature is not the cluster's (another internal token?)"
        updated = data.get("updated_at")
        now = time.time() if now is None else now
        if not isinstance(updated, (int, float)) or abs(now - updated) > self.max_age_s:
            return f"its heartbeat time is over {self.max_age_s:g} s from this clock (a replay?)"
        return None
