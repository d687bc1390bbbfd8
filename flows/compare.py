"""``make compare``: a table of chosen metrics across the runs of an experiment
(``mlflow.search_runs``), one row per stage run, newest first. Without a stage and metrics it
compares the evaluations (stage 9): pass@1 / accuracy per benchmark with the router's adapter,
the gold answers' perplexity, size, peak RSS and speculative decoding's speed against target-only;
with a stage and no metrics, that stage's first metrics (confidence bounds and loss histories
left out)."""

from __future__ import annotations

import datetime as dt

import mlflow

from core.redaction import redact_text
from flows.tracking import TAG
from flows.workspace import tracking_uri

__all__ = ["EVALUATION", "compare_table", "fmt_metric", "text_table"]

EVALUATION = [
    "humaneval/auto/pass_at_1",
    "mbpp/auto/pass_at_1",
    "gsm8k/auto/accuracy",
    "general/auto/pass_rate",
    "all/reference_perplexity",
    "bundle_bytes",
    "peak_rss_mb",
    "speed/sd_vs_ar",
]


def compare_table(experiment: str, metrics: list[str] | None = None, stage: str | None = None, limit: int = 20) -> str:
    mlflow.set_tracking_uri(tracking_uri())
    if not metrics and not stage:
        stage, metrics = "9", EVALUATION
    filters = [f"tags.`{TAG}stage_id` = '{stage}'"] if stage else [f"tags.`{TAG}stage_id` != ''"]
    runs = mlflow.search_runs(
        experiment_names=[experiment],
        filter_string=" and ".join(filters),
        order_by=["attributes.start_time DESC"],
        max_results=limit,
        output_format="list",
    )
    if not runs:
        return (
            f"no {'stage ' + stage if stage else 'stage'} runs in experiment {experiment!r} (tracking URI "
            f"{redact_text(tracking_uri())})"
        )
    if not metrics:
        names = sorted(runs[0].data.metrics)
        metrics = [m for m in names if "/ci_" not in m and not m.endswith("/loss")][:8]
    header = ["started (UTC)", "run", "stage", "cached", "cache key", *metrics]
    rows = []
    for r in runs:
        started = dt.datetime.fromtimestamp(r.info.start_time / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        tags = r.data.tags
        values = [fmt_metric(r.data.metrics.get(m)) for m in metrics]
        rows.append(
            [
                started,
                r.info.run_id[:8],
                tags.get(f"{TAG}stage_id", ""),
                tags.get(f"{TAG}cached", "") + ("" if r.info.status == "FINISHED" else f" ({r.info.status.lower()})"),
                tags.get(f"{TAG}cache_key", "")[:12],
                *values,
            ]
        )
    return "\n".join(text_table(header, rows))


def text_table(header: list[str], rows: list[list]) -> list[str]:
    """``header`` and ``rows`` as lines of left-aligned columns, the header underlined."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    return out + ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]


def fmt_metric(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value == int(value) and abs(value) >= 1 else f"{value:.4f}"
