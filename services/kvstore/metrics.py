"""A kvstore's /metrics: the store's size and counters, read when scraped, and how long
its puts and gets take."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Histogram

from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.store import BlockStore
from pdserve.runtime.metrics import TRANSFER_BUCKETS, Labels, SnapshotCollector, name, new_registry


class KVStoreMetrics:
    """The registry of one kvstore replica (its series are labelled role="kvstore")."""

    def __init__(self, store: BlockStore, disk: DiskTier | None = None) -> None:
        self.store = store
        self.disk = disk
        self.registry = new_registry()
        labels = Labels("kvstore")
        self._seconds = Histogram(
            name("kvstore_request_seconds"),
            "Time of one PutBlocks or GetBlocks call, in seconds.",
            [*labels.names, "method"],
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.put_seconds = self._seconds.labels(*labels.values, "put")
        self.get_seconds = self._seconds.labels(*labels.values, "get")
        self.registry.register(SnapshotCollector(labels, self._rows))

    def _rows(self) -> Iterable[tuple]:
        s = self.store
        yield from (
            ("kvstore_bytes_used", "gauge", "Bytes of blocks held.", s.bytes_used),
            ("kvstore_capacity_bytes", "gauge", "--capacity-bytes.", s.capacity_bytes),
            ("kvstore_blocks", "gauge", "Blocks held.", s.num_blocks),
            ("kvstore_leased_blocks", "gauge", "Blocks put and not fetched yet.", s.num_leased),
            ("kvstore_bytes_in", "counter", "Bytes of blocks put.", s.bytes_in),
            ("kvstore_bytes_out", "counter", "Bytes of blocks served to gets.", s.bytes_out),
            ("kvstore_blocks_in", "counter", "Blocks put.", s.blocks_in),
            ("kvstore_blocks_out", "counter", "Blocks served to gets.", s.blocks_out),
            ("kvstore_hits", "counter", "Blocks a get asked for and found in memory.", s.hits),
            ("kvstore_misses", "counter", "Blocks a get did not find in memory.", s.misses),
            ("kvstore_evictions", "counter", "Blocks evicted to make room (LRU).", s.evictions),
            ("kvstore_expired", "counter", "Blocks whose lease ended with no get.", s.expired),
            ("kvstore_dropped", "counter", "Single-use blocks dropped once read.", s.dropped),
        )
        d = self.disk
        if d is None:
            return
        yield from (
            ("kvstore_disk_bytes_used", "gauge", "Bytes of the disk tier's files.", d.bytes_used),
            ("kvstore_disk_capacity_bytes", "gauge", "--disk-capacity-bytes.", d.capacity_bytes),
            ("kvstore_disk_blocks", "gauge", "Blocks on disk.", d.num_blocks),
            (
                "kvstore_disk_hits",
                "counter",
                "Blocks a get missed in memory, found on disk.",
                d.hits,
            ),
            ("kvstore_disk_writes", "counter", "Blocks evicted from memory, written.", d.writes),
            (
                "kvstore_disk_writes_dropped",
                "counter",
                "Blocks evicted from memory and not written (queue full, too big, an error).",
                d.writes_dropped,
            ),
            (
                "kvstore_disk_damaged",
                "counter",
                "Block files that failed their check: deleted, not served.",
                d.damaged,
            ),
            (
                "kvstore_disk_evictions",
                "counter",
                "Block files deleted to make room (LRU).",
                d.evictions,
            ),
        )
