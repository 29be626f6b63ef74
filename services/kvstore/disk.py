"""DiskTier: the kvstore's optional second tier, the blocks LRU evicted from memory, in files.

Up to ``--disk-capacity-bytes`` of files under ``--disk-path``, least recently used out
first (``blockfile`` has the format: a checked header, then the bytes). The directory's
``layout.txt`` names the block layout of every file in it, so a kvstore started again on
the same directory indexes its files (oldest mtime first) and serves them, and one given
another ``--block-layout`` refuses to start.

One writer thread writes the files (a temp file, then os.replace) from a queue bounded in
bytes: when the disk cannot keep up, an evicted block is dropped rather than held in
memory. A block waiting in that queue is served from it. Reads run in the caller's thread
(the server's ``asyncio.to_thread``), so no file is touched on the event loop; a file that
fails its check is deleted, logged and counted, and reads as a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from pdserve.kv.blocks import BlockLayout, show_key
from pdserve.kvstore.blockfile import (
    SUFFIX,
    DamagedBlockFile,
    block_path,
    check_header,
    file_size,
    read_block_file,
    read_header,
    write_block_file,
)
from pdserve.kvstore.store import StoredBlock, layout_from_text, layout_to_text

logger = logging.getLogger(__name__)

LAYOUT_FILE = "layout.txt"
# Evicted blocks waiting for the writer: past this, further ones are dropped.
MAX_QUEUED_BYTES = 64 * 2**20


class _Entry(NamedTuple):
    path: Path
    size: int  # of the file
    checksum: int | None  # the sender's
    data_len: int


class DiskTier:
    """Block files of one layout below ``root``, evicted least recently used first.

    ``offer`` (from the event loop) queues a block for the writer thread; ``read_many`` and
    ``discard`` may run in any thread. One lock guards the index, the queue's accounting
    and the counters; no file is opened while it is held.
    """

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        layout: BlockLayout | None,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(
                f"the disk tier's capacity must be at least 1 byte, got {capacity_bytes}"
            )
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.max_queued_bytes = max_queued_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, StoredBlock] = {}  # queued for the writer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_bytes = 0
        self._writer: threading.Thread | None = None
        self._last_write_error = ""
        self.bytes_used = 0
        self.hits = 0  # blocks a get missed in memory and found here
        self.writes = 0  # files written
        self.writes_dropped = 0  # evicted blocks not written: queue full, too big, or an error
        self.damaged = 0  # files that failed their check, deleted
        self.evictions = 0  # files deleted to make room (LRU)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending or key in self._index

    def lru_order(self) -> list[bytes]:
        """Keys of the files, least recently used first."""
        with self._lock:
            return list(self._index)

    # -- the event loop's side ----------------------------------------------------------

    def offer(self, layout: BlockLayout, key: bytes, block: StoredBlock) -> None:
        """Queue ``block``, just evicted from memory, for writing (the store's ``on_evict``)."""
        with self._lock:
            if self.layout is None:  # fixed by the store's first put: written before any block
                self.layout = layout
                self._queue.put(("layout", layout))
            elif layout != self.layout:
                raise RuntimeError("bug: the disk tier was offered a block of another layout")
            entry = self._index.get(key)
            if entry is not None and (entry.checksum, entry.data_len) == (
                block.checksum,
                len(block.data),
            ):
                self._index.move_to_end(key)  # promoted from here before: the file is current
                return
            size = len(block.data)
            if (
                file_size(key, block) > self.capacity_bytes
                or self._queued_bytes + size > self.max_queued_bytes
            ):
                self.writes_dropped += 1
                if entry is not None:  # its file holds other bytes than memory held
                    self._forget(key)
                return
            self._pending[key] = block
            self._queued_bytes += size
        self._queue.put(("write", key, block))

    def persist(self, layout: BlockLayout, blocks: Iterable[tuple[bytes, StoredBlock]]) -> int:
        """Write ``blocks`` (memory's, as the kvstore stops) now, in this thread, past the
        queue's bound: a kvstore started again on this directory serves them. A request's
        tail (single-use) is left out. How many files were written."""
        written = 0
        for key, block in blocks:
            if key.startswith(b"tail/"):
                continue
            with self._lock:
                if self.layout is None:
                    self.layout = layout
                    write_layout(self.root, layout)
                entry = self._index.get(key)
                if entry is not None and entry.data_len == len(block.data):
                    continue
                if file_size(key, block) > self.capacity_bytes:
                    continue
                self._pending[key] = block
                self._queued_bytes += len(block.data)
            before = self.writes
            self._write(key, block)
            written += self.writes - before
        return written

    def discard(self, key: bytes) -> None:
        """Forget the block under ``key`` and delete its file (a single-use block, read)."""
        with self._lock:
            self._forget(key)

    def _forget(self, key: bytes) -> None:
        self._pending.pop(key, None)  # the writer skips a block no longer pending
        entry = self._index.pop(key, None)
        if entry is not None:
            self.bytes_used -= entry.size
            self._queue.put(("delete", entry.path))

    # -- any thread ---------------------------------------------------------------------

    def read_many(self, keys: Iterable[bytes]) -> dict[bytes, StoredBlock]:
        """The blocks of ``keys`` this tier has and that pass their check (blocking I/O)."""
        found = {}
        for key in keys:
            block = self._read(key)
            if block is not None:
                found[key] = block
        return found

    def _read(self, key: bytes) -> StoredBlock | None:
        with self._lock:
            block = self._pending.get(key)
            if block is not None:
                self.hits += 1
                return block
            entry = self._index.get(key)
        if entry is None:
            return None
        try:
            _, block = read_block_file(entry.path, self.root)
        except FileNotFoundError:  # evicted or discarded meanwhile, or deleted from outside
            self._drop_entry(key, entry)
            return None
        except (DamagedBlockFile, OSError) as error:
            logger.warning(
                "disk tier: block %s in %s fails its check (%s): deleted, not served",
                show_key(key),
                entry.path,
                error,
            )
            if self._drop_entry(key, entry):
                entry.path.unlink(missing_ok=True)
            with self._lock:
                self.damaged += 1
            return None
        with self._lock:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
            self.hits += 1
        with contextlib.suppress(OSError):  # evicted meanwhile
            os.utime(entry.path)  # its mtime orders the index when a kvstore starts again
        return block

    def _drop_entry(self, key: bytes, entry: _Entry) -> bool:
        """Forget ``entry`` if it is still the index's for ``key``; whether it was."""
        with self._lock:
            if self._index.get(key) is not entry:
                return False
            del self._index[key]
            self.bytes_used -= entry.size
            return True

    # -- the writer thread --------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread."""
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk", daemon=True)
        self._writer.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer thread (blocks up to ``timeout_s``)."""
        if self._writer is None:
            return
        self._queue.put(None)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            logger.warning("disk tier: writes still queued after %.0f s, not waited for", timeout_s)
        self._writer = None

    def _write_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            if op[0] == "write":
                self._write(op[1], op[2])
            elif op[0] == "delete":
                op[1].unlink(missing_ok=True)
            else:
                write_layout(self.root, op[1])

    def _write(self, key: bytes, block: StoredBlock) -> None:
        with self._lock:
            wanted = self._pending.get(key) is block
            if not wanted:
                self._queued_bytes -= len(block.data)
                return
        path = block_path(self.root, key)
        try:
            write_block_file(path, key, block)
        except OSError as error:
            with self._lock:
                self._finish_pending(key, block)
                self.writes_dropped += 1
            if str(error) != self._last_write_error:  # a full disk would log every eviction
                logger.warning("disk tier: cannot write block files (%s): dropping them", error)
                self._last_write_error = str(error)
            return
        entry = _Entry(path, file_size(key, block), block.checksum, len(block.data))
        with self._lock:
            if not self._finish_pending(key, block):  # discarded while being written
                path.unlink(missing_ok=True)
                return
            self._insert(key, entry)
            self.writes += 1
            evicted = self._evict_to_capacity()
        for old in evicted:
            old.unlink(missing_ok=True)

    def _finish_pending(self, key: bytes, block: StoredBlock) -> bool:
        """Take ``block`` off the queue's accounting; whether it was still the one pending."""
        self._queued_bytes -= len(block.data)
        if self._pending.get(key) is not block:
            return False
        del self._pending[key]
        return True

    def _insert(self, key: bytes, entry: _Entry) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self.bytes_used -= old.size
        self._index[key] = entry
        self.bytes_used += entry.size

    def _evict_to_capacity(self) -> list[Path]:
        """Drop least recently used entries until the files fit; their paths, to delete."""
        paths = []
        while self.bytes_used > self.capacity_bytes:
            _, entry = self._index.popitem(last=False)
            self.bytes_used -= entry.size
            self.evictions += 1
            paths.append(entry.path)
        return paths

    # -- start --------------------------------------------------------------------------

    def index_files(self) -> None:
        """Index the block files under ``root``, least recently modified first; delete
        leftover temp files and files that fail their header check."""
        found = []
        for path in self.root.glob("??/*"):
            if path.name.endswith(SUFFIX + ".tmp"):  # a write cut short
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    header = read_header(f)
                stat = path.stat()
                check_header(path, self.root, header, stat.st_size)
            except (DamagedBlockFile, OSError) as error:
                logger.warning("disk tier: %s fails its check (%s): deleted", path, error)
                path.unlink(missing_ok=True)
                self.damaged += 1
                continue
            entry = _Entry(path, header.file_size, header.checksum, header.data_len)
            found.append((stat.st_mtime_ns, header.key, entry))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._insert(key, entry)
        for path in self._evict_to_capacity():  # --disk-capacity-bytes may have shrunk
            path.unlink(missing_ok=True)


def open_disk_tier(root: Path, capacity_bytes: int, layout: BlockLayout | None) -> DiskTier:
    """The disk tier in ``root`` (made if absent), its files indexed, its writer not started.

    A directory with a ``layout.txt`` gives its layout (or must agree with ``layout``); one
    without must be empty. ValueError naming --disk-path when neither holds.
    """
    root.mkdir(parents=True, exist_ok=True)
    layout_file = root / LAYOUT_FILE
    if layout_file.exists():
        try:
            on_disk = layout_from_text(layout_file.read_text())
        except ValueError as error:
            raise ValueError(f"--disk-path {root}: cannot read {LAYOUT_FILE}: {error}") from None
        if layout is not None and on_disk != layout:
            diffs = "; ".join(on_disk.differences(layout, "--disk-path", "--block-layout"))
            raise ValueError(
                f"--disk-path {root} holds blocks of another layout ({diffs}): give another "
                "directory, or empty this one"
            )
        layout = on_disk
    elif any(root.iterdir()):
        raise ValueError(
            f"--disk-path {root} is not empty and has no {LAYOUT_FILE}: give an empty "
            "directory, or one a kvstore wrote"
        )
    elif layout is not None:
        write_layout(root, layout)
    tier = DiskTier(root, capacity_bytes, layout)
    tier.index_files()
    return tier


def write_layout(root: Path, layout: BlockLayout) -> None:
    """Write ``root``'s layout.txt (atomically)."""
    tmp = root / (LAYOUT_FILE + ".tmp")
    tmp.write_text(layout_to_text(layout) + "\n")
    os.replace(tmp, root / LAYOUT_FILE)
