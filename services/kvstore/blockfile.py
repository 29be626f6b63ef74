"""One KV block in one file: the kvstore's disk tier writes and reads blocks this way.

A file is a fixed header (magic, key length, num_tokens, the sender's checksum, the data's
length and a CRC-32 of all the rest), then the key, then the block's bytes. Its name comes
from the key (``<2 hex>/<blake2b of the key>.blk`` under the tier's directory), so a file
whose header names another key is as damaged as one whose bytes changed.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

from pdserve.kvstore.store import StoredBlock

MAGIC = b"PDKVBLK1"
SUFFIX = ".blk"
# magic, key length, num_tokens, has a sender's checksum, that checksum, data length, CRC-32.
_HEADER = struct.Struct("<8sHIBIQI")
_HEADER_BEFORE_CRC = struct.Struct("<8sHIBIQ")


class DamagedBlockFile(ValueError):
    """A block file that fails its check: never served."""


class FileHeader(NamedTuple):
    key: bytes
    num_tokens: int
    checksum: int | None
    data_len: int
    crc: int

    @property
    def file_size(self) -> int:
        return _HEADER.size + len(self.key) + self.data_len


def block_path(root: Path, key: bytes) -> Path:
    """Where the block under ``key`` lives below ``root``."""
    name = hashlib.blake2b(key, digest_size=20).hexdigest()
    return root / name[:2] / (name + SUFFIX)


def file_size(key: bytes, block: StoredBlock) -> int:
    """Bytes of the file that holds ``block``."""
    return _HEADER.size + len(key) + len(block.data)


def write_block_file(path: Path, key: bytes, block: StoredBlock) -> None:
    """Write ``block`` to ``path`` atomically: a temp file beside it, then os.replace."""
    before_crc = _before_crc(key, block.num_tokens, block.checksum, len(block.data))
    crc = _crc(before_crc, key, block.data)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(before_crc + struct.pack("<I", crc) + key)
        f.write(block.data)
    os.replace(tmp, path)


def read_header(f) -> FileHeader:
    """The header and key at the start of the open file ``f``; DamagedBlockFile if unreadable."""
    raw = f.read(_HEADER.size)
    if len(raw) != _HEADER.size:
        raise DamagedBlockFile(f"{len(raw)} bytes, shorter than a header")
    magic, key_len, num_tokens, has_checksum, checksum, data_len, crc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise DamagedBlockFile(f"not a block file (magic {magic!r})")
    key = f.read(key_len)
    if len(key) != key_len:
        raise DamagedBlockFile("cut short in its key")
    return FileHeader(key, num_tokens, checksum if has_checksum else None, data_len, crc)


def check_header(path: Path, root: Path, header: FileHeader, size: int) -> None:
    """DamagedBlockFile unless the file's name and size agree with its header."""
    if block_path(root, header.key) != path:
        raise DamagedBlockFile("its header names another key than its file name")
    if size != header.file_size:
        raise DamagedBlockFile(f"{size} bytes, its header says {header.file_size}")


def read_block_file(path: Path, root: Path) -> tuple[bytes, StoredBlock]:
    """The key and block in ``path``, every byte checked against the file's CRC;
    DamagedBlockFile naming what is wrong, FileNotFoundError if it is gone."""
    with open(path, "rb") as f:
        header = read_header(f)
        data = f.read(header.data_len)
        size = f.tell() + len(f.read(1))
    check_header(path, root, header, size)
    before_crc = _before_crc(header.key, header.num_tokens, header.checksum, header.data_len)
    crc = _crc(before_crc, header.key, data)
    if crc != header.crc:
        raise DamagedBlockFile(f"CRC-32 {crc:#010x}, its header says {header.crc:#010x}")
    return header.key, StoredBlock(data, header.num_tokens, header.checksum)


def _before_crc(key: bytes, num_tokens: int, checksum: int | None, data_len: int) -> bytes:
    has_checksum = checksum is not None
    return _HEADER_BEFORE_CRC.pack(
        MAGIC, len(key), num_tokens, has_checksum, checksum or 0, data_len
    )


def _crc(before_crc: bytes, key: bytes, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(key, zlib.crc32(before_crc)))
