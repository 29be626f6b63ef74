"""The internal token as its file rotates (pdserve.runtime.token_ring), on a fake clock."""

from __future__ import annotations

import os

from pdserve.runtime.token_ring import CHECK_EVERY_S, TokenRing

OLD, NEW, NEWER = ("o" * 32, "n" * 32, "x" * 32)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(path, text):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_new_file_is_accepted_at_once_sent_after_half_the_overlap_old_refused_after(tmp_path):
    path, clock = tmp_path / "token", Clock()
    _write(path, OLD + "\n")
    ring = TokenRing(OLD, str(path), overlap_s=10.0, clock=clock)
    _write(path, NEW + "\n")
    assert ring.sent() == OLD  # not looked at again within a second
    clock.now += CHECK_EVERY_S
    assert ring.accepted() == (NEW, OLD) and ring.sent() == OLD
    clock.now += 5.0
    assert ring.sent() == NEW and ring.accepted() == (NEW, OLD)
    clock.now += 5.0
    assert ring.sent() == NEW and ring.accepted() == (NEW,)


def test_a_file_without_a_token_keeps_the_current_one(tmp_path, caplog):
    path, clock = tmp_path / "token", Clock()
    _write(path, OLD)
    ring = TokenRing(OLD, str(path), overlap_s=10.0, clock=clock)
    _write(path, "short\n")
    clock.now += CHECK_EVERY_S
    assert ring.accepted() == (OLD,) and "still using the previous token" in caplog.text
    path.unlink()  # between the kubelet's rename and the next: nothing to read
    clock.now += CHECK_EVERY_S
    assert ring.sent() == OLD
    _write(path, NEWER)
    clock.now += CHECK_EVERY_S
    assert ring.accepted() == (NEWER, OLD)
    assert OLD not in repr(ring) and NEWER not in repr(ring)


def test_a_token_given_without_a_file_never_changes():
    ring = TokenRing(OLD)
    assert ring.sent() == OLD and ring.accepted() == (OLD,)
