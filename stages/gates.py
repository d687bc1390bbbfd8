"""Stage 9A — quality gates: PASS/FAIL thresholds on the metrics of the stages that measured the
bundle (stage 9's evaluation, and any upstream stage's: 2B's perplexity, 2D's token agreement,
2G's calibration error, ...), then the bundle stamped with the verdict.

Each gate names an input (a wired stage), one of its metrics, and a ``min`` and/or ``max``. A gate
whose metric the input does not have is a configuration error naming the metrics it does have. A
gate can be **waived** only by listing its name in ``waive`` (in the recipe or with
``make stage-9a ARGS=...``): the waiver is part of the cache key and recorded in the card and in
the bundle.

Outputs: ``bundle/`` — the input bundle (files hard-linked) in the recipe's ``profile`` (default:
only what its decoding defaults use on the recipe's ``backends``,
:func:`kibidango.bundle.with_profile`; full: everything), whose ``bundle.json`` carries the profile
and ``release``: ``releasable``, every gate's value and threshold, the failed and the waived ones (the
runtime warns when it loads a bundle that is not releasable); ``gates.json``; ``GATES_CARD.md``.
When a gate fails (not waived) the outputs are published and then **the flow fails** with the
table — metric, value, threshold, the stage it came from — so nothing downstream (packing) runs.
Either way the runner registers the stamped bundle as a version of ``kibidango-<preset>`` in the
MLflow Model Registry, and moves the alias ``champion`` to it only when it is releasable.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult

LIBRARIES = ()
REGISTERS = "bundle"  # the runner registers the judged bundle in the MLflow Model Registry (flows/model_registry.py)

log = logging.getLogger("kibidango.stage.9A")


class Gate(StageConfig):
    name: str = Field(description="What the gate is called in tables and in `waive`.")
    input: str = Field(description="The wired input whose metric is gated (e.g. evaluation, awq).")
    metric: str = Field(description="A metric in that input's manifest (e.g. humaneval/auto/pass_at_1).")
    min: float | None = Field(None, description="The metric passes at or above this.")
    max: float | None = Field(None, description="The metric passes at or below this.")

    @model_validator(mode="after")
    def _bounded(self) -> Gate:
        if self.min is None and self.max is None:
            raise ValueError(f"gate {self.name!r}: give min, max or both")
        return self


class Config(StageConfig):
    bundle_input: str = Field("bundle", description="The input holding bundle/ (stage 1F's tuned bundle).")
    gates: list[Gate] = Field(min_length=1, description="The thresholds, each on one wired input's metric.")
    waive: list[str] = Field([], description="Names of gates waived on purpose: recorded in the bundle.")
    profile: Literal["default", "full"] = Field(
        "default",
        description="What the released bundle ships: default, only what its decoding defaults, routing, calibration "
        "and cascade use on `backends` (kibidango.bundle.with_profile; bundle.json's `profile` lists what it left "
        "out); full, every part stage X assembled (torch checkpoints, unused tiers).",
    )
    backends: list[Literal["torch", "llamacpp"]] = Field(
        ["llamacpp"],
        min_length=1,
        description="The backends whose weight forms the default profile keeps; the first is the runtime's "
        "`--backend auto`.",
    )

    @model_validator(mode="after")
    def _names(self) -> Config:
        names = [g.name for g in self.gates]
        if len(set(names)) != len(names):
            raise ValueError("gates: two gates share a name")
        unknown = set(self.waive) - set(names)
        if unknown:
            raise ValueError(f"waive: no gate named {sorted(unknown)}; gates: {names}")
        return self


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from kibidango.bundle import load_bundle, with_profile

    if cfg.bundle_input not in inputs:
        raise KibidangoError(f"input {cfg.bundle_input!r} (the bundle) is not wired; inputs: {sorted(inputs)}")
    rows = []
    for g in cfg.gates:
        if g.input not in inputs:
            raise KibidangoError(f"gate {g.name!r}: input {g.input!r} is not wired; inputs: {sorted(inputs)}")
        manifest = json.loads((inputs[g.input] / "manifest.json").read_text())
        metrics = manifest.get("metrics", {})
        if g.metric not in metrics:
            near = sorted(m for m in metrics if g.metric.split("/")[0] in m)[:12] or sorted(metrics)[:12]
            raise KibidangoError(f"gate {g.name!r}: input {g.input!r} has no metric {g.metric!r}; it has {near}")
        value = float(metrics[g.metric])
        passed = (g.min is None or value >= g.min) and (g.max is None or value <= g.max)
        rows.append(
            {
                "name": g.name,
                "input": g.input,
                "stage": manifest.get("stage_id") or _stage_of(inputs[g.input]),
                "metric": g.metric,
                "value": value,
                "min": g.min,
                "max": g.max,
                "passed": passed,
                "waived": g.name in cfg.waive,
                "run_id": manifest.get("mlflow_run_id"),
            }
        )
    failed = [r["name"] for r in rows if not r["passed"] and not r["waived"]]
    waived = [r["name"] for r in rows if r["waived"]]
    release = {"releasable": not failed, "gates": rows, "failed": failed, "waived": waived}
    source = inputs[cfg.bundle_input] / "bundle"
    with_profile(source, out_dir / "bundle", cfg.profile, tuple(cfg.backends), release=release)
    shipped = load_bundle(out_dir / "bundle").manifest  # the runtime's own check of what it ships
    full_bytes = sum(f.size for f in load_bundle(source, verify=False).manifest.files)
    shipped_bytes = sum(f.size for f in shipped.files)
    left_out = shipped.profile.left_out if shipped.profile else []
    (out_dir / "gates.json").write_text(json.dumps(release, indent=2, sort_keys=True))
    table = gate_table(rows)
    (out_dir / "GATES_CARD.md").write_text(
        "# Stage 9A — quality gates\n\n"
        + ("**Releasable**" if not failed else f"**Not releasable**: {', '.join(failed)} failed")
        + (f"; waived on purpose: {', '.join(waived)}" if waived else "")
        + ".\n\n"
        + table
        + "\n\n"
        + f"Profile **{cfg.profile}** for {', '.join(cfg.backends)}: {len(shipped.files)} files, "
        + f"{shipped_bytes / 1e6:.1f} MB (every part stage X assembled: {full_bytes / 1e6:.1f} MB)."
        + "".join(f"\n- left out: {item}" for item in left_out)
        + "\n"
    )
    metrics = {
        "gates": float(len(rows)),
        "gates_failed": float(len(failed)),
        "gates_waived": float(len(waived)),
        "releasable": float(not failed),
        "bundle_bytes": float(shipped_bytes),
        "bundle_files": float(len(shipped.files)),
        "full_bundle_bytes": float(full_bytes),
        "parts_left_out": float(len(left_out)),
    }
    summary = (
        f"{len(rows) - len(failed)}/{len(rows)} gates pass"
        + (f" ({len(waived)} waived)" if waived else "")
        + f"; {cfg.profile} profile for {', '.join(cfg.backends)}: "
        + f"{shipped_bytes / 1e6:.1f} MB of {full_bytes / 1e6:.1f}"
    )
    failure = None
    if failed:
        failure = (
            f"quality gates failed: {', '.join(failed)}; the bundle is stamped not releasable "
            f"({out_dir.name}/bundle/bundle.json 'release')\n{table}\n"
            "Waive a gate on purpose with `waive: [NAME]` in the recipe (recorded in the bundle)."
        )
    return StageResult(metrics, ["GATES_CARD.md", "gates.json"], summary, failure=failure)


def _stage_of(path: Path) -> str:
    """The stage id of an artifact directory in the store (``<store>/<stage>/<key>``)."""
    return path.parent.name


def gate_table(rows: list[dict]) -> str:
    lines = [
        "| gate | stage | metric | value | threshold | outcome |",
        "|---|---|---|---:|---|---|",
    ]
    for r in rows:
        bound = " and ".join(
            b
            for b in (
                f">= {r['min']:g}" if r["min"] is not None else "",
                f"<= {r['max']:g}" if r["max"] is not None else "",
            )
            if b
        )
        outcome = "pass" if r["passed"] else ("FAIL (waived)" if r["waived"] else "**FAIL**")
        lines.append(f"| {r['name']} | {r['stage']} | {r['metric']} | {r['value']:.4g} | {bound} | {outcome} |")
    return "\n".join(lines)


def report_headline(artifact: Path) -> list[tuple[str, str]]:
    """This stage's rows of the report's summary (figure, value): the release verdict, and the
    shipped bundle's profile and size."""
    path = artifact / "gates.json"
    if not path.is_file():
        return []
    gates = json.loads(path.read_text())
    n_pass = sum(g["passed"] for g in gates["gates"])
    verdict = "**releasable**" if gates["releasable"] else "**not releasable**"
    failed = f"; failed: {', '.join(gates['failed'])}" if gates["failed"] else ""
    waived = f"; waived: {', '.join(gates['waived'])}" if gates["waived"] else ""
    rows = [("quality gates", f"{verdict}: {n_pass}/{len(gates['gates'])} pass{failed}{waived}")]
    bundle = artifact / "bundle" / "bundle.json"
    profile = json.loads(bundle.read_text()).get("profile") if bundle.is_file() else None
    if profile:
        size = sum(f["size"] for f in json.loads(bundle.read_text())["files"]) / 1e6
        rows.append(
            (
                f"the shipped bundle: {profile['name']} profile for {', '.join(profile['backends'])}",
                f"{size:.2f} MB; left out: {'; '.join(profile['left_out']) or 'nothing'}",
            )
        )
    return rows
