"""Prometheus families labelled by model name, one value each: what the features' ``metrics``
hooks yield, and the engine's own (engine/metrics.py) alike."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["counter", "gauge"]


def gauge(model: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=["model_name"])
    fam.add_metric([model], value)
    return fam


def counter(model: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=["model_name"])
    fam.add_metric([model], value)
    return fam
