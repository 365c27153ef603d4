"""The frontend's raypaged_* metrics, mirrored into Ray's metrics so Prometheus reaches every replica.

A replica cannot usefully serve its own /metrics: Serve's proxy sends each scrape to whichever
replica it picks. Ray, though, exports every actor's `ray.util.metrics` on its node's metrics
port (the one Ray's Prometheus service discovery and KubeRay's PodMonitor scrape), tagged with
Serve's deployment, replica and application. So each update of the frontend's prometheus_client
metrics is also recorded on a Ray metric of the same name, help text, labels and buckets. Ray
prefixes exported names with `ray_`: `raypaged_time_to_first_token_seconds` is scraped as
`ray_raypaged_time_to_first_token_seconds` (the Grafana dashboard's `prefix` variable covers both).

The mirror wraps FrontendMetrics' labelled children in place, leaving their own registry intact.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from ray.serve import metrics as serve_metrics

from raypaged.frontend.metrics import FrontendMetrics


class _Mirrored:
    """A labelled prometheus_client child that also records on a Ray metric."""

    def __init__(self, child: Any, ray_metric: Any, tags: dict[str, str]) -> None:
        self._child = child
        self._ray = ray_metric
        self._tags = tags

    def inc(self, amount: float = 1.0) -> None:
        self._child.inc(amount)
        if amount > 0:  # Ray's counters refuse 0
            self._ray.inc(amount, tags=self._tags)

    def set(self, value: float) -> None:
        self._child.set(value)
        self._ray.set(value, tags=self._tags)

    def observe(self, value: float) -> None:
        self._child.observe(value)
        self._ray.observe(value, tags=self._tags)


class _MirroredFamily:
    """A labelled family (e.g. request errors by code) whose children are mirrored on demand."""

    def __init__(self, family: Any, mirror: RayMetricsMirror) -> None:
        self._family = family
        self._mirror = mirror

    def labels(self, *values: str) -> _Mirrored:
        return self._mirror.mirror(self._family.labels(*values))


class RayMetricsMirror:
    def __init__(self) -> None:
        self._ray_metrics: dict[str, Any] = {}

    def attach(self, metrics: FrontendMetrics) -> None:
        for name, value in list(vars(metrics).items()):
            if _is_child(value):
                setattr(metrics, name, self.mirror(value))
            elif isinstance(value, dict) and value and all(_is_child(v) for v in value.values()):
                setattr(metrics, name, {k: self.mirror(v) for k, v in value.items()})
            elif name in metrics.PER_CALL_FAMILIES:
                setattr(metrics, name, _MirroredFamily(value, self))

    def mirror(self, child: Any) -> _Mirrored:
        tags = dict(zip(child._labelnames, child._labelvalues))
        return _Mirrored(child, self._ray_metric(child), tags)

    def _ray_metric(self, child: Any) -> Any:
        name = child._name
        metric = self._ray_metrics.get(name)
        if metric is None:
            keys = tuple(child._labelnames)
            doc = child._documentation
            if isinstance(child, Counter):
                metric = serve_metrics.Counter(name, doc, tag_keys=keys)
            elif isinstance(child, Gauge):
                metric = serve_metrics.Gauge(name, doc, tag_keys=keys)
            elif isinstance(child, Histogram):
                bounds = [b for b in child._upper_bounds if b != float("inf")]
                metric = serve_metrics.Histogram(name, doc, boundaries=bounds, tag_keys=keys)
            else:
                raise TypeError(f"cannot mirror a {type(child).__name__} ({name})")
            self._ray_metrics[name] = metric
        return metric


def _is_child(value: Any) -> bool:
    return isinstance(value, (Counter, Gauge, Histogram)) and bool(getattr(value, "_labelvalues", ()))
