"""``leafe run``'s own metrics (the supervisor serves them on its /metrics, ``metrics_urls["run"]``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["RunMetrics"]


class RunMetrics:
    """``leafe_run_validation_*``: the learning curve of ``leafe run``'s online evaluator (served by the
    supervisor; ``services/run/rounds.py`` sets them at every curve point)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.passk = Gauge(
            "leafe_run_validation_passk",
            "Pass@k of the served version on the validation slice, last curve point",
            ["k"],
            registry=r,
        )
        self.unparseable = Gauge(
            "leafe_run_validation_unparseable",
            "Unparseable answers on the validation slice, last curve point (fraction)",
            registry=r,
        )
        self.learner_step = Gauge(
            "leafe_run_validation_learner_step", "Learner step of the last curve point", registry=r
        )
        self.points = Counter("leafe_run_validation_points_total", "Curve points measured", registry=r)

    def point(self, passk: dict[int, float], unparseable: float, learner_step: int) -> None:
        """A new curve point."""
        for k, v in passk.items():
            self.passk.labels(k=str(k)).set(v)
        self.unparseable.set(unparseable)
        self.learner_step.set(learner_step)
        self.points.inc()
