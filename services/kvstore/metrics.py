"""A kvstore's /metrics: the store's size and counters, read when scraped, and how long
its puts and gets take."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Histogram

from pdserve.kvstore.store import BlockStore
from pdserve.runtime.metrics import TRANSFER_BUCKETS, Labels, SnapshotCollector, name, new_registry


class KVStoreMetrics:
    """The registry of one kvstore replica (its series are labelled role="kvstore")."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
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
        return (
            ("kvstore_bytes_used", "gauge", "Bytes of blocks held.", s.bytes_used),
            ("kvstore_capacity_bytes", "gauge", "--capacity-bytes.", s.capacity_bytes),
            ("kvstore_blocks", "gauge", "Blocks held.", s.num_blocks),
            ("kvstore_leased_blocks", "gauge", "Blocks put and not fetched yet.", s.num_leased),
            ("kvstore_bytes_in", "counter", "Bytes of blocks put.", s.bytes_in),
            ("kvstore_bytes_out", "counter", "Bytes of blocks served to gets.", s.bytes_out),
            ("kvstore_blocks_in", "counter", "Blocks put.", s.blocks_in),
            ("kvstore_blocks_out", "counter", "Blocks served to gets.", s.blocks_out),
            ("kvstore_hits", "counter", "Blocks a get asked for and found.", s.hits),
            ("kvstore_misses", "counter", "Blocks a get asked for and did not find.", s.misses),
            ("kvstore_evictions", "counter", "Blocks evicted to make room (LRU).", s.evictions),
            ("kvstore_expired", "counter", "Blocks whose lease ended with no get.", s.expired),
            ("kvstore_dropped", "counter", "Single-use blocks dropped once read.", s.dropped),
        )
