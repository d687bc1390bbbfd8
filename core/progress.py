"""Progress lines for long stage work: count, rate and ETA, at most every few seconds.

Stages log through the standard ``logging`` module (logger ``kibidango.*``) and never import
Prefect; the flow registers that logger with Prefect, so the lines reach the console and the
Prefect UI alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["Progress", "metric_sink", "report_metrics"]

MetricSink = Callable[[dict[str, float], int], None]
_sink: ContextVar[MetricSink | None] = ContextVar("kibidango_metric_sink", default=None)


@contextmanager
def metric_sink(sink: MetricSink) -> Iterator[None]:
    """Route :func:`report_metrics` calls made in this context (this thread) to ``sink``. The
    runner installs one that logs to the stage's MLflow run, so a stage reports training curves
    without importing MLflow."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


def report_metrics(metrics: dict[str, float], step: int) -> None:
    """Metrics of a step of long work (loss, learning rate): logged live where a sink listens,
    dropped otherwise. A sink that fails never fails the stage."""
    sink = _sink.get()
    if sink is None:
        return
    try:
        sink(metrics, step)
    except Exception as e:  # noqa: BLE001 - tracking is best effort while training
        logging.getLogger("kibidango.progress").warning(f"could not log live metrics: {e}")


class Progress:
    def __init__(self, label: str, total: int | None, logger: logging.Logger, every_s: float = 5.0):
        self.label, self.total, self.logger, self.every_s = label, total, logger, every_s
        self.start = self._last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        rate = done / max(now - self.start, 1e-9)
        line = f"{self.label}: {done:,}"
        if self.total:
            eta = (self.total - done) / rate if rate else float("inf")
            line += f"/{self.total:,} ({100 * done / self.total:.0f}%), ETA {eta:.0f}s"
        self.logger.info(f"{line}, {rate:,.0f}/s")

    def finish(self, done: int) -> float:
        """Log the final count and return the elapsed seconds."""
        elapsed = time.monotonic() - self.start
        self.logger.info(f"{self.label}: {done:,} in {elapsed:.1f}s ({done / max(elapsed, 1e-9):,.0f}/s)")
        return elapsed
