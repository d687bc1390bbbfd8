"""``make report``: ``REPORT.md`` and its plots for the latest flow run of a preset, from MLflow and
the artifacts that run used; every figure is followed by the stage, MLflow run id and artifact it
came from (a cache hit points at the run that computed it).

Sections, as far as the run has the stages: the stages (cached or computed, summary); the bundle's
sizes and perplexities (X); the evaluation (9) and the quality gates (9A); training loss curves
(every ``*/loss`` metric history of the training stages); acceptance per decoding mode (9's
speed benchmark); calibration reliability (2G); the cascade's threshold frontier (6C); cost per
teacher tier (1D); the runtime cascade against its baselines (``make eval-cascade``, when run).

Written to ``<workspace>/reports/<preset>/`` (``REPORT.md`` and PNGs beside it)."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

from core.contract import KibidangoError
from core.paths import home
from flows.preset import load_preset
from flows.tracking import TAG
from flows.workspace import tracking_uri

__all__ = ["write_report"]

# (stage, card file, title, images to copy) in report order
_CARDS = [
    ("9", "EVALUATION_CARD.md", "Evaluation on held-out tasks (stage 9)", []),
    ("9A", "GATES_CARD.md", "Quality gates (stage 9A)", []),
    ("2G", "CALIBRATION_CARD.md", "Calibration (stage 2G)", ["reliability_answers.png", "reliability_tokens.png"]),
    ("6C", "THRESHOLDS_CARD.md", "Cascade thresholds (stage 6C)", ["frontier.png"]),
    ("1D", "COST_CARD.md", "Cascaded teachers: cost per tier (stage 1D)", ["cost_per_tier.png"]),
]


def _client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri())


def _latest_flow_run(client, experiment: str, preset: str):
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise KibidangoError(f"no MLflow experiment {experiment!r}: run `make demo` (or the preset's flow) first")
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{TAG}preset` = '{preset}'",
        order_by=["attributes.start_time DESC"],
        max_results=2000,
    )
    flows = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not flows:
        raise KibidangoError(f"no flow run of preset {preset!r} in experiment {experiment!r}: run it first")
    return flows[0]


def _stage_runs(client, flow) -> dict[str, object]:
    children = client.search_runs(
        [flow.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{flow.info.run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=500,
    )
    return {r.data.tags.get(f"{TAG}stage_id", ""): r for r in children if r.data.tags.get(f"{TAG}stage_id")}


def _source(run) -> str:
    """The run that computed the artifact (a cache hit's source run), as a short reference."""
    tags = run.data.tags
    return tags.get(f"{TAG}source_run_id") or run.info.run_id


def _cite(sid: str, run, artifact: str | None) -> str:
    cached = run.data.tags.get(f"{TAG}cached") == "yes"
    where = f", artifact `{artifact}`" if artifact else ""
    return f"*(stage {sid}, MLflow run `{_source(run)}`{' (a cache hit in this flow run)' if cached else ''}{where})*"


def _body(card: str) -> str:
    """A card without its first heading (the report gives its own)."""
    lines = card.strip().splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines).strip()


def _loss_plot(client, runs: dict, out: Path) -> list[str]:
    """Every ``*/loss`` metric history of the stages' source runs in one figure; the runs used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    used = []
    for sid, run in runs.items():
        source = _source(run)
        try:
            keys = [k for k in client.get_run(source).data.metrics if k.endswith("/loss")]
        except Exception:  # noqa: BLE001 - a source run from another tracking store: skip it
            continue
        for key in keys:
            history = client.get_metric_history(source, key)
            if len(history) < 2:
                continue
            steps = [m.step for m in history]
            ax.plot(steps, [m.value for m in history], label=f"{sid}: {key}")
            used.append(f"stage {sid} `{key}` (run `{source}`)")
    if not used:
        plt.close(fig)
        return []
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return used


def _acceptance_plot(evaluation: dict, out: Path) -> bool:
    rows = [r for r in (evaluation.get("speed") or {}).get("rows", []) if r.get("acceptance")]
    bars = [(f"{r['mode']}: {t}", a) for r in rows for t, a in r["acceptance"].items() if a is not None]
    if not bars:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([b[0] for b in bars], [b[1] for b in bars])
    ax.set_xlim(0, 1)
    ax.set_xlabel("acceptance rate (drafted tokens accepted)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def write_report(preset: str, out_dir: Path | None = None) -> Path:
    plan = load_preset(preset)
    client = _client()
    flow = _latest_flow_run(client, plan.experiment, plan.name)
    runs = _stage_runs(client, flow)
    out_dir = out_dir or home() / "reports" / plan.name
    out_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.fromtimestamp(flow.info.start_time / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    artifacts = {sid: r.data.tags.get(f"{TAG}artifact") for sid, r in runs.items()}
    lines = [
        f"# kibidango report — preset `{plan.name}`",
        "",
        f"Flow run `{flow.info.run_id}` ({flow.info.status}), started {started}, git "
        f"`{flow.data.tags.get(f'{TAG}git_sha', '?')[:12]}`; experiment `{plan.experiment}`, tracking "
        f"`{tracking_uri()}`. Regenerate with `make report PRESET={plan.name}`.",
        "",
        "## Stages",
        "",
        "| stage | name | computed or cached | MLflow run (source) | summary |",
        "|---|---|---|---|---|",
    ]
    for sid, run in runs.items():
        tags = run.data.tags
        art = artifacts.get(sid)
        summary = ""
        if art and (Path(art) / "manifest.json").is_file():
            summary = json.loads((Path(art) / "manifest.json").read_text()).get("summary", "")
            summary = summary.strip().splitlines()[0].rstrip(":").replace("|", "/") if summary.strip() else ""
        status = "cached" if tags.get(f"{TAG}cached") == "yes" else "computed"
        if run.info.status != "FINISHED":
            status += f" ({run.info.status.lower()})"
        lines.append(f"| {sid} | {tags.get(f'{TAG}stage_name', '')} | {status} | `{_source(run)}` | {summary[:300]} |")

    if "X" in runs and artifacts.get("X"):
        card = Path(artifacts["X"]) / "bundle" / "BUNDLE_CARD.md"
        if card.is_file():
            lines += ["", "## The bundle: sizes and perplexity (stage X)", "", _body(card.read_text()), "",
                      _cite("X", runs["X"], artifacts["X"])]  # fmt: skip
    for sid, name, title, images in _CARDS:
        art = artifacts.get(sid)
        if sid not in runs or not art or not (Path(art) / name).is_file():
            continue
        lines += ["", f"## {title}", "", _body((Path(art) / name).read_text())]
        for image in images:
            if (Path(art) / image).is_file():
                shutil.copy2(Path(art) / image, out_dir / f"{sid}-{image}")
                lines += ["", f"![{image}]({sid}-{image})"]
        lines += ["", _cite(sid, runs[sid], art)]
        if sid == "9":
            evaluation = json.loads((Path(art) / "evaluation.json").read_text())
            if _acceptance_plot(evaluation, out_dir / "acceptance.png"):
                lines += ["", "Acceptance per decoding mode and tier (stage 9's speed benchmark):", "",
                          "![acceptance](acceptance.png)", "", _cite(sid, runs[sid], art)]  # fmt: skip
    used = _loss_plot(client, runs, out_dir / "loss_curves.png")
    if used:
        lines += ["", "## Training loss curves", "", "![loss curves](loss_curves.png)", "",
                  "*(" + "; ".join(used) + ")*"]  # fmt: skip
    cascade = home() / "reports" / "eval-cascade.md"  # written by make eval-cascade beside its JSON
    if cascade.is_file():
        lines += ["", "## The runtime cascade against its baselines (`make eval-cascade`)", "",
                  cascade.read_text().strip(), "", f"*({cascade}, {cascade.with_suffix('.json')})*"]  # fmt: skip
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
