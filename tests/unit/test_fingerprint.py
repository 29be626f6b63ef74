"""The model fingerprint covers every byte of the weights, is stored beside the checkpoint
once, read back while the files are unchanged, and computed again when they change."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from pdserve.core import fingerprint as fp
from pdserve.core.fingerprint import (
    FINGERPRINT_FILE,
    compute_fingerprint,
    model_fingerprint,
    store_fingerprint,
)

SIZE = 4 << 20


def checkpoint(path: Path) -> Path:
    """A directory with a config.json and two weight files of random bytes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (path / name).write_bytes(os.urandom(SIZE))
    return path


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_byte_anywhere_in_the_weights_changes_it(tmp_path):
    ckpt = checkpoint(tmp_path / "m")
    before = compute_fingerprint(ckpt)
    assert compute_fingerprint(ckpt) == before and len(before) == 16
    # Offset 100,000 lies between the samples a sampled fingerprint would read (64 KiB at
    # every 16th of the file).
    for name, offset in [("model-00002-of-00002.safetensors", 100_000), ("config.json", 3)]:
        flip(ckpt / name, offset)
        after = compute_fingerprint(ckpt)
        assert after != before, name
        before = after


def test_files_are_told_apart_by_name(tmp_path):
    ckpt = checkpoint(tmp_path / "m")
    before = compute_fingerprint(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").rename(ckpt / "other.safetensors")
    assert compute_fingerprint(ckpt) != before


def test_a_checkpoint_without_one_gets_it_computed_once_and_stored(tmp_path, monkeypatch, caplog):
    ckpt = checkpoint(tmp_path / "m")  # as prepared before fingerprints were stored
    with caplog.at_level(logging.INFO, logger=fp.__name__):
        first = model_fingerprint(ckpt)
    assert first == compute_fingerprint(ckpt)
    assert "has no stored model fingerprint: computing it once" in caplog.text
    record = json.loads((ckpt / FINGERPRINT_FILE).read_text())
    assert record["fingerprint"] == first.hex() and record["version"] == fp.FINGERPRINT_VERSION
    assert sorted(record["files"]) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    monkeypatch.setattr(fp, "compute_fingerprint", lambda path: pytest.fail("hashed again"))
    assert model_fingerprint(ckpt) == first
    assert [p.name for p in ckpt.iterdir() if ".tmp-" in p.name] == []


def test_a_changed_weight_file_is_hashed_again(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    first = store_fingerprint(ckpt)
    flip(ckpt / "model-00001-of-00002.safetensors", SIZE - 1)
    with caplog.at_level(logging.WARNING, logger=fp.__name__):
        second = model_fingerprint(ckpt)
    assert "changed since its model fingerprint was stored" in caplog.text
    assert second != first and second == compute_fingerprint(ckpt)
    assert json.loads((ckpt / FINGERPRINT_FILE).read_text())["fingerprint"] == second.hex()


def test_an_unreadable_stored_file_is_replaced(tmp_path, caplog):
    ckpt = checkpoint(tmp_path / "m")
    (ckpt / FINGERPRINT_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=fp.__name__):
        assert model_fingerprint(ckpt) == compute_fingerprint(ckpt)
    assert "is unreadable" in caplog.text
    assert json.loads((ckpt / FINGERPRINT_FILE).read_text())["version"] == fp.FINGERPRINT_VERSION


def test_a_read_only_checkpoint_is_served_with_a_warning(tmp_path, monkeypatch, caplog):
    ckpt = checkpoint(tmp_path / "m")

    def refuse(src, dst):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(fp.os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger=fp.__name__):
        assert model_fingerprint(ckpt) == compute_fingerprint(ckpt)
    assert "cannot store the model fingerprint" in caplog.text
    assert "computed again over all weights at every start" in caplog.text
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == []
