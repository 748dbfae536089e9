"""Prometheus gauges (on Ray: the runtime's `record_metrics`): every rank's own figures of each log step."""

from __future__ import annotations

from typing import Any

from stride.trainers.sinks.base import RunInfo, Sink


class PrometheusSink(Sink):
    name = "prometheus"
    every_rank = True

    def open(self, run: RunInfo) -> None:
        self.record = run.record_metrics

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        if self.record is not None:
            self.record({**metrics, **own})
