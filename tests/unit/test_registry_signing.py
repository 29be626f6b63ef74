"""Registry signatures (pdserve.controlplane.signing): what verifies and what does not."""

from __future__ import annotations

import dataclasses
import json
import time

from pdserve.controlplane.registry import WorkerInfo
from pdserve.controlplane.signing import SIGNATURE_FIELD, Verifier, registry_key, signed_json

OLD, NEW = "old-internal-token-0123456789abcdef", "new-internal-token-0123456789abcdef"


def _entry(token: str | None, **changes) -> dict:
    info = WorkerInfo("decode-1", "decode", "10.0.0.1:50052", fingerprint="ab" * 16)
    info = dataclasses.replace(info, **{"updated_at": time.time(), **changes})
    return json.loads(info.to_json(registry_key(token)))


def test_an_entry_verifies_under_its_tokens_key_and_reads_back_the_same():
    data = _entry(OLD)
    assert Verifier.for_tokens(OLD).why_refused(data) is None
    assert WorkerInfo.from_dict(data).address == "10.0.0.1:50052"  # the signature set aside
    assert registry_key(OLD) != OLD.encode() and OLD not in json.dumps(data)


def test_unsigned_tampered_foreign_and_stale_entries_are_refused():
    verifier = Verifier.for_tokens(OLD)
    unsigned = {k: v for k, v in _entry(OLD).items() if k != SIGNATURE_FIELD}
    assert "not signed" in verifier.why_refused(unsigned)
    tampered = {**_entry(OLD), "address": "10.9.9.9:1"}
    assert "signature" in verifier.why_refused(tampered)
    assert "signature" in verifier.why_refused(_entry(NEW))
    stale = _entry(OLD, updated_at=time.time() - 3600)
    assert "heartbeat time" in verifier.why_refused(stale)


def test_during_a_rotation_both_tokens_verify_and_without_one_all_is_open():
    both = Verifier.for_tokens(NEW, OLD)
    assert both.why_refused(_entry(OLD)) is None and both.why_refused(_entry(NEW)) is None
    open_cluster = Verifier.for_tokens(None)
    assert not open_cluster.required and open_cluster.why_refused(_entry(None)) is None
    assert registry_key(None) is None and SIGNATURE_FIELD not in _entry(None)


def test_events_verify_like_entries():
    verifier = Verifier.for_tokens(OLD)
    down = {"kind": "down", "id": "decode-1"}
    assert not verifier.verified(down)
    assert verifier.verified(json.loads(signed_json(down, registry_key(OLD))))
    assert not verifier.verified(json.loads(signed_json(down, registry_key(NEW))))
