"""DiskTier on its own, on a temp directory: block files, LRU by bytes, the write queue's
bound, damaged files, and a tier opened again on its directory."""

from __future__ import annotations

import dataclasses
import os

import pytest
from prometheus_client import generate_latest

from pdserve.core.errors import SettingsError
from pdserve.kv.blocks import BlockLayout
from pdserve.kvstore.blockfile import block_path, file_size
from pdserve.kvstore.disk import DiskTier, open_disk_tier
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.store import BlockStore, StoredBlock, layout_to_text
from pdserve.settings.services import KVStoreSettings

LAYOUT = BlockLayout(
    version=2,
    model_fingerprint=b"\x01\x02",
    dtype="float32",
    block_size=16,
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
)
DATA = 100
FILE = file_size(b"k0", StoredBlock(bytes(DATA), 16))  # every test key has 2 bytes


def block(key: bytes, checksum: int | None = 1234) -> StoredBlock:
    return StoredBlock(key[-1:] * DATA, 16, checksum)


def written(tier: DiskTier, *keys: bytes) -> DiskTier:
    """``tier`` after its writer has written ``keys`` in turn (then stopped)."""
    tier.start()
    for key in keys:
        tier.offer(LAYOUT, key, block(key))
    tier.close()
    return tier


def test_offered_blocks_are_written_and_read_back_exactly(tmp_path):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0", b"k1")
    assert tier.read_many([b"k0", b"k1", b"no"]) == {b"k0": block(b"k0"), b"k1": block(b"k1")}
    assert (tier.num_blocks, tier.bytes_used, tier.writes, tier.hits) == (2, 2 * FILE, 2, 2)
    assert block_path(tmp_path, b"k0").stat().st_size == FILE
    assert (tmp_path / "layout.txt").read_text() == layout_to_text(LAYOUT) + "\n"
    without = written(open_disk_tier(tmp_path / "none", FILE, LAYOUT), b"k2")
    without.start()
    without.offer(LAYOUT, b"k3", block(b"k3", checksum=None))
    without.close()
    assert without.read_many([b"k3"]) == {b"k3": block(b"k3", checksum=None)}


def test_files_past_the_capacity_go_least_recently_used_first(tmp_path):
    tier = written(open_disk_tier(tmp_path, 3 * FILE, LAYOUT), b"k0", b"k1", b"k2")
    assert tier.read_many([b"k0"]).keys() == {b"k0"}  # now the most recent
    written(tier, b"k3")
    assert tier.lru_order() == [b"k2", b"k0", b"k3"]
    assert (tier.evictions, tier.bytes_used) == (1, 3 * FILE)
    assert not block_path(tmp_path, b"k1").exists()


def test_a_queued_block_is_served_from_the_queue_and_a_full_queue_drops(tmp_path):
    tier = open_disk_tier(tmp_path, 10 * FILE, LAYOUT)
    tier.max_queued_bytes = 2 * DATA
    for key in (b"k0", b"k1", b"k2"):  # the writer is not started: they wait
        tier.offer(LAYOUT, key, block(key))
    assert tier.read_many([b"k0", b"k2"]) == {b"k0": block(b"k0")}
    assert (tier.writes_dropped, tier.num_blocks) == (1, 0)
    written(tier)
    assert tier.lru_order() == [b"k0", b"k1"]
    too_big = StoredBlock(bytes(10 * FILE), 16)
    tier.offer(LAYOUT, b"big", too_big)
    assert tier.writes_dropped == 2 and b"big" not in tier


def test_a_block_offered_again_unchanged_is_not_written_again(tmp_path):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0", b"k1", b"k0")
    assert (tier.writes, tier.lru_order()) == (2, [b"k1", b"k0"])
    tier.start()
    tier.offer(LAYOUT, b"k1", block(b"k1", checksum=99))  # other bytes: written again
    tier.close()
    assert tier.writes == 3 and tier.read_many([b"k1"])[b"k1"].checksum == 99


def test_a_damaged_file_is_deleted_counted_and_read_as_a_miss(tmp_path, caplog):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0", b"k1")
    path = block_path(tmp_path, b"k0")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    assert tier.read_many([b"k0", b"k1"]).keys() == {b"k1"}
    assert not path.exists() and (tier.damaged, tier.num_blocks, tier.bytes_used) == (1, 1, FILE)
    assert "fails its check (CRC-32" in caplog.text
    os.remove(block_path(tmp_path, b"k1"))  # gone from outside: a miss, forgotten
    assert tier.read_many([b"k1"]) == {} and tier.num_blocks == 0


def test_discard_deletes_the_file_and_a_queued_write(tmp_path):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0")
    tier.offer(LAYOUT, b"k1", block(b"k1"))
    tier.discard(b"k0")
    tier.discard(b"k1")
    written(tier)
    assert tier.read_many([b"k0", b"k1"]) == {} and tier.writes == 1
    assert not block_path(tmp_path, b"k0").exists() and not block_path(tmp_path, b"k1").exists()


# -- opening a directory again --------------------------------------------------------------


def test_a_tier_opened_again_serves_its_files_in_their_lru_order(tmp_path):
    written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0", b"k1", b"k2")
    for i, key in enumerate((b"k1", b"k2", b"k0")):
        os.utime(block_path(tmp_path, key), ns=(i * 10**9, i * 10**9))
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cut.blk.tmp").write_bytes(b"half")  # a write cut short
    again = open_disk_tier(tmp_path, 2 * FILE, None)  # a smaller capacity: k1 goes
    assert again.layout == LAYOUT
    assert again.lru_order() == [b"k2", b"k0"]
    assert again.read_many([b"k0", b"k2"]) == {b"k0": block(b"k0"), b"k2": block(b"k2")}
    assert not (tmp_path / "ab" / "cut.blk.tmp").exists()
    assert not block_path(tmp_path, b"k1").exists()


def test_a_file_whose_header_names_another_key_is_deleted_at_open(tmp_path):
    written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0", b"k1")
    moved = block_path(tmp_path, b"k9")
    moved.parent.mkdir(exist_ok=True)
    block_path(tmp_path, b"k0").replace(moved)
    again = open_disk_tier(tmp_path, 10 * FILE, LAYOUT)
    assert (again.lru_order(), again.damaged) == ([b"k1"], 1)


def test_a_directory_of_another_layout_or_of_other_files_is_refused(tmp_path):
    written(open_disk_tier(tmp_path / "tier", 10 * FILE, LAYOUT), b"k0")
    other = dataclasses.replace(LAYOUT, block_size=32)
    with pytest.raises(ValueError, match=r"--disk-path .*tier holds blocks of another layout "):
        open_disk_tier(tmp_path / "tier", 10 * FILE, other)
    with pytest.raises(ValueError, match="block_size: --disk-path 16, --block-layout 32"):
        open_disk_tier(tmp_path / "tier", 10 * FILE, other)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"--disk-path .*home is not empty and has no layout"):
        open_disk_tier(tmp_path / "home", 10 * FILE, LAYOUT)
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"


def test_a_tier_without_a_layout_takes_the_first_offered_one(tmp_path):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, None), b"k0")
    assert tier.layout == LAYOUT
    assert open_disk_tier(tmp_path, 10 * FILE, None).lru_order() == [b"k0"]


def test_disk_settings_are_checked_naming_the_flag(tmp_path):
    with pytest.raises(SettingsError, match="--disk-capacity-bytes: cannot read size"):
        KVStoreSettings(disk_capacity_bytes="lots")
    with pytest.raises(SettingsError, match="--disk-capacity-bytes must be positive"):
        KVStoreSettings(disk_capacity_bytes="0")
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingsError, match="--disk-path must be a directory"):
        KVStoreSettings(disk_path=str(tmp_path / "file"))
    settings = KVStoreSettings(disk_path=str(tmp_path / "new"))
    assert (settings.disk_capacity, settings.disk_path) == (8 * 2**30, str(tmp_path / "new"))


def test_the_disk_tier_is_counted_in_the_kvstore_metrics(tmp_path):
    tier = written(open_disk_tier(tmp_path, 10 * FILE, LAYOUT), b"k0")
    tier.read_many([b"k0"])
    text = generate_latest(KVStoreMetrics(BlockStore(100), tier).registry).decode()
    for line in (
        f'pdserve:kvstore_disk_bytes_used{{role="kvstore"}} {float(FILE)}',
        'pdserve:kvstore_disk_blocks{role="kvstore"} 1.0',
        'pdserve:kvstore_disk_hits_total{role="kvstore"} 1.0',
        'pdserve:kvstore_disk_writes_total{role="kvstore"} 1.0',
        'pdserve:kvstore_disk_writes_dropped_total{role="kvstore"} 0.0',
        'pdserve:kvstore_disk_damaged_total{role="kvstore"} 0.0',
    ):
        assert line in text
    assert "kvstore_disk" not in generate_latest(KVStoreMetrics(BlockStore(100)).registry).decode()
