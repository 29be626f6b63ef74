"""A service's Prometheus metrics as prometheus_client's parser reads them."""

from __future__ import annotations

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def families(text: str) -> dict[str, Metric]:
    """{family name: family (its type and samples)} of a Prometheus text exposition; a
    counter's family is named without ``_total``."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (histograms' ``_bucket``, ``_sum`` and
    ``_count`` samples under their own names)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
    )


def scrape(url: str) -> str:
    """The text of ``url``/metrics."""
    response = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10)
    response.raise_for_status()
    return response.text


def metric(url: str, name: str, **labels: str) -> float:
    """``value`` of one sample family, scraped from ``url``/metrics now."""
    return value(scrape(url), name, **labels)
