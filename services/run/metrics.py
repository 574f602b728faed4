"""How ``leafe run`` reads its services' Prometheus metrics (progress, drain): :func:`scrape` a
/metrics endpoint and :func:`parse_samples` its text. Its own metrics (``RunMetrics``) are in
``services/metrics.py`` with every other service's."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["parse_samples", "scrape"]

_SCRAPE_TIMEOUT_S = 3.0


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample: value}``, a sample written ``name{label="value",...}`` (labels
    sorted) or ``name`` when it has none."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


async def scrape(url: str) -> str:
    """GET a /metrics endpoint's text (raises ``aiohttp.ClientError`` or ``TimeoutError``)."""
    timeout = aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()
