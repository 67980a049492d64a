"""``/metrics`` of the ingress: every live replica's own Prometheus export, each series labelled with
``replica``, plus the ingress's routing counters.

Each replica renders its server's ``/metrics`` (the single-process server's exporter, unchanged)
every ``period`` seconds and posts the text to a small named Ray actor, the ``MetricsBoard``; the
ingress reads the board at every scrape and drops replicas that stopped posting (dead or removed
by autoscaling). Sum over ``replica`` for totals (``sum without (replica) (...)``), as one would
over vLLM's ``engine`` label.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


class MetricsBoard:
    """The latest export of each replica (a Ray actor, created by the ingress under a fixed name)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}  # replica -> (time.time() posted, Prometheus text)

    def post(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.time(), text)

    def read(self, max_age: float) -> dict[str, str]:
        """Exports posted within ``max_age`` seconds; older ones are forgotten."""
        now = time.time()
        for replica in [r for r, (t, _) in self._texts.items() if now - t > max_age]:
            del self._texts[replica]
        return {r: text for r, (_, text) in self._texts.items()}


def board_name(app_name: str) -> str:
    return f"tokenleap-metrics-{app_name}"


class _Merged(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_exports(texts: dict[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One Prometheus text of the replicas' exports (``replica -> text``), every sample labelled with
    its replica, and the ``extra`` families as they are."""
    merged: dict[str, Metric] = {}
    for replica in sorted(texts):
        for fam in text_string_to_metric_families(texts[replica]):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([*merged.values(), *extra]))
    return generate_latest(registry)
