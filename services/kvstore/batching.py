"""Grouping blocks into stream messages of a bounded number of data bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def batched_by_bytes(
    items: Iterable[T], size: Callable[[T], int], max_bytes: int
) -> Iterator[list[T]]:
    """Consecutive non-empty batches of at most ``max_bytes``; an item larger than that goes alone."""
    batch: list[T] = []
    batch_bytes = 0
    for item in items:
        n = size(item)
        if batch and batch_bytes + n > max_bytes:
            yield batch
            batch, batch_bytes = [], 0
        batch.append(item)
        batch_bytes += n
    if batch:
        yield batch
