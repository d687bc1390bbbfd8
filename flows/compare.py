"""``make compare``: a table of chosen metrics across the runs of an experiment
(``mlflow.search_runs``), one row per stage run, newest first."""

from __future__ import annotations

import datetime as dt

import mlflow

from flows.tracking import TAG
from flows.workspace import tracking_uri

__all__ = ["compare_table"]


def compare_table(experiment: str, metrics: list[str], stage: str | None = None, limit: int = 20) -> str:
    mlflow.set_tracking_uri(tracking_uri())
    filters = [f"tags.`{TAG}stage_id` = '{stage}'"] if stage else [f"tags.`{TAG}stage_id` != ''"]
    runs = mlflow.search_runs(
        experiment_names=[experiment],
        filter_string=" and ".join(filters),
        order_by=["attributes.start_time DESC"],
        max_results=limit,
        output_format="list",
    )
    if not runs:
        return f"no stage runs in experiment {experiment!r} (tracking URI {tracking_uri()})"
    header = ["started (UTC)", "run", "stage", "cached", "cache key", *metrics]
    rows = []
    for r in runs:
        started = dt.datetime.fromtimestamp(r.info.start_time / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        tags = r.data.tags
        values = [_fmt(r.data.metrics.get(m)) for m in metrics]
        rows.append(
            [
                started,
                r.info.run_id[:8],
                tags.get(f"{TAG}stage_id", ""),
                tags.get(f"{TAG}cached", ""),
                tags.get(f"{TAG}cache_key", "")[:12],
                *values,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value == int(value) and abs(value) >= 1 else f"{value:.4f}"
