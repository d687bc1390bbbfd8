"""``make report``: ``REPORT.md`` and its plots for the latest flow run of a preset, from MLflow, the
artifacts that run used and the workspace's measurement records; every figure is followed by
where it came from: the stage, MLflow run id and artifact (a cache hit points at the run that
computed it), or the command, commit and time of a measurement.

Sections, as far as the run has the stages: a summary of the headline figures; the stages
(cached or computed, summary); data (0); training (P, 1A, 1R, 1E, the domain adapters 3-5, loss
curves); failure mining and the teachers (1B, 1C, 1D); compression and the bundle (X, 2D, 2E, a
size/quality plot); routing, calibration and escalation (6A, 2G, 6B, 6C); the evaluation (9, with
acceptance per decoding mode) and the quality gates (9A); then every measurement recorded in the
workspace (``make eval-dedup``, ``make bench-runtime``, ``make eval-cascade``, ``make loadtest``,
...; :mod:`core.measurements`), with a warning where one was measured on another bundle than this run's.

Written to ``<workspace>/reports/<preset>/`` (``REPORT.md`` and PNGs beside it). ``--publish``
also copies it to ``docs/report/<preset>/`` in the repository and rewrites the README's summary
block (between ``<!-- report-summary:<preset> -->`` and ``<!-- /report-summary -->``) with the
same summary, so that the figures the README keeps come from this code."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
from pathlib import Path

from core.contract import KibidangoError
from core.measurements import read_records, shown_path
from core.paths import REPO_ROOT, home
from flows.preset import load_preset
from flows.tracking import TAG
from flows.workspace import tracking_uri
from stages import STAGES, base_id, load_stage

__all__ = ["write_report", "publish", "summary_table"]

# report sections: (title, intro, [(stage, card file, images to copy)])
_SECTIONS = [
    ("Data (stage 0)", "", [("0", "data_card.md", ["length_histogram.png"])]),
    (
        "Training (stages P, 1A, 1R, 1E, 3-5)",
        "",
        [("P", "family.md", []), ("1A", None, []), ("1R", "RETRAIN_CARD.md", []), ("1E", "family.md", [])],
    ),
    (
        "Failure mining and the cascaded teachers (stages 1B, 1C, 1T, 1D)",
        "",
        [
            ("1B", "MINING_CARD.md", []),
            ("1C", "FAILURE_CARD.md", []),
            ("1T", None, []),
            ("1D", "COST_CARD.md", ["cost_per_tier.png"]),
        ],
    ),
    (
        "Compression, decoding tuning and the bundle (stages 2A-2F, X, 1F, 2E)",
        "",
        [
            ("X", "bundle/BUNDLE_CARD.md", []),
            ("2D", "gguf_report.md", []),
            ("1F", "TUNING_CARD.md", ["speedup_vs_tau.png"]),
            ("2E", "pack_report.md", []),
        ],
    ),
    (
        "Routing, calibration and escalation (stages 6A, 2G, 6B, 6C)",
        "",
        [
            ("6A", "ROUTER_CARD.md", []),
            ("2G", "CALIBRATION_CARD.md", ["reliability_answers.png", "reliability_tokens.png"]),
            ("6B", "ESCALATION_CARD.md", []),
            ("6C", "THRESHOLDS_CARD.md", ["frontier.png"]),
        ],
    ),
    ("Evaluation on held-out tasks (stage 9)", "", [("9", "EVALUATION_CARD.md", [])]),
    ("Quality gates (stage 9A)", "", [("9A", "GATES_CARD.md", [])]),
]
# measurements in reading order (data, routing, runtime, cascade, server); others follow by name
_MEASUREMENTS = [
    "eval-dedup",
    "bench-dedup",
    "fuzz-ingest",
    "bench-router",
    "backend-agreement",
    "bench-runtime-torch",
    "bench-runtime-torch-instructions",
    "bench-runtime-llamacpp",
    "bench-runtime-llamacpp-instructions",
    "bench-runtime-llamacpp-f32",
    "tune-runtime-llamacpp",
    "bench-kv-cache",
    "eval-cascade",
    "loadtest",
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


def _artifacts(runs: dict) -> dict[str, str]:
    """Stage id -> the artifact directory each run names (its tag), where it is on disk."""
    where = {sid: r.data.tags.get(f"{TAG}artifact") for sid, r in runs.items()}
    return {sid: a for sid, a in where.items() if a and Path(a).is_dir()}


def _source(run) -> str:
    """The run that computed the artifact (a cache hit's source run), as a short reference."""
    tags = run.data.tags
    return tags.get(f"{TAG}source_run_id") or run.info.run_id


def _compute_minutes(client, run) -> float | None:
    """How long the run that computed the stage's artifact took (a cache hit's source run)."""
    try:
        source = run if _source(run) == run.info.run_id else client.get_run(_source(run))
    except Exception:  # noqa: BLE001 - a source run from another tracking store
        return None
    if not source.info.end_time or source.info.status != "FINISHED":
        return None
    return (source.info.end_time - source.info.start_time) / 60000


def _cite(sid: str, run, artifact: str | None) -> str:
    cached = run.data.tags.get(f"{TAG}cached") == "yes"
    where = f", artifact `{shown_path(artifact)}`" if artifact else ""
    return f"*(stage {sid}, MLflow run `{_source(run)}`{' (a cache hit in this flow run)' if cached else ''}{where})*"


def _card(card: str) -> tuple[str | None, str]:
    """A card under a report section: its first heading (the section's title), and the rest with
    its YAML front matter dropped and its other headings one level down."""
    text = card.strip()
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        text = text[end + 4 :].strip() if end != -1 else text
    lines = text.splitlines()
    heading = None
    if lines and lines[0].startswith("# "):
        heading, lines = lines[0][2:].strip(), lines[1:]
    return heading, "\n".join("##" + line if re.match(r"#+ ", line) else line for line in lines).strip()


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _plt().close(fig)


def _loss_plot(client, runs: dict, out: Path) -> list[str]:
    """Every ``*/loss`` metric history of the stages' source runs in one figure; the runs used."""
    plt = _plt()
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
    _save(fig, out)
    return used


def _acceptance_plot(evaluation: dict, out: Path) -> bool:
    rows = [r for r in (evaluation.get("speed") or {}).get("rows", []) if r.get("acceptance")]
    bars = [(f"{r['mode']}: {t}", a) for r in rows for t, a in r["acceptance"].items() if a is not None]
    if not bars:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([b[0] for b in bars], [b[1] for b in bars])
    ax.set_xlim(0, 1)
    ax.set_xlabel("acceptance rate (drafted tokens accepted)")
    _save(fig, out)
    return True


def _size_quality_points(x_artifact: Path) -> list[tuple[str, str, float, float]]:
    """(tier, format, MB on disk, validation perplexity) for the full-precision, AWQ and
    quantized GGUF form of every tier (the bundle card's figures, :func:`tier_figures`)."""
    from methods.compression.card import lineage, tier_figures

    points = []
    for tier, f in tier_figures(lineage({"bundle": x_artifact})).items():
        forms = [
            ("full precision", f["hf_bytes"], f["ppl_full"]),
            ("AWQ", f["awq_bytes"], f["ppl_awq"]),
            ("GGUF quantized", f["gguf_bytes"], f["ppl_gguf"]),
        ]
        points += [(tier, form, size / 1e6, ppl) for form, size, ppl in forms if size and ppl]
    return points


def _size_quality_plot(points: list[tuple[str, str, float, float]], out: Path) -> bool:
    if not points:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    markers = {"full precision": "o", "AWQ": "s", "GGUF quantized": "^"}
    colors = {"draft": "tab:blue", "qualifier": "tab:orange", "target": "tab:green"}
    for tier, form, mb, ppl in points:
        ax.scatter(mb, ppl, marker=markers.get(form, "o"), color=colors.get(tier, "k"), label=f"{tier}, {form}")
    ax.set_xscale("log")
    ax.set_xlabel("size on disk (MB, log scale)")
    ax.set_ylabel("validation perplexity (lower is better)")
    ax.legend(fontsize=7)
    _save(fig, out)
    return True


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summary_table(flow, runs: dict, minutes: dict, artifacts: dict, records: list[dict]) -> list[str]:
    """The headline figures, each with where it came from: the flow run (stages computed and
    cached, wall time), each stage's own rows (its ``report_headline``: the release verdict, pass
    rates with intervals, size, speed, ...), and the measurements' headline (cascade, server)."""
    rows = []
    computed = sum(r.data.tags.get(f"{TAG}cached") != "yes" for r in runs.values())
    if flow.info.end_time:
        wall = (flow.info.end_time - flow.info.start_time) / 60000
        spent = [m for m in minutes.values() if m is not None]
        rows.append(
            f"| this flow run | {len(runs)} stages: {computed} computed, {len(runs) - computed} cache hits; "
            f"{wall:.1f} min wall; the stages' own compute time (the runs that computed them, one at a time): "
            f"{sum(spent):.1f} min | flow run `{flow.info.run_id}` |"
        )

    def cite(sid: str) -> str:
        return f"stage {sid}, run `{_source(runs[sid])}`"

    for sid in reversed([sid for sid in STAGES if artifacts.get(sid)]):  # the product first: 9A, 9, 1F, ... 2D
        headline = getattr(load_stage(sid), "report_headline", None)
        if headline is not None:
            rows += [f"| {figure} | {value} | {cite(sid)} |" for figure, value in headline(Path(artifacts[sid]))]
    by_name = {r["name"]: r for r in records}
    cascade = by_name.get("eval-cascade", {}).get("data")
    if cascade and "cascade" in cascade:
        c = cascade["cascade"]
        rows.append(
            f"| runtime cascade on {cascade['queries']} fresh queries: local share; judged quality cascade / "
            f"local / cloud stand-in; $ per 1K queries | {_pct(c['tiers']['local'])}; {_pct(c['quality'])} / "
            f"{_pct(cascade['local_only']['quality'])} / {_pct(cascade['cloud_only']['quality'])}; "
            f"{c['usd_per_1k_queries']:.2f} | `{by_name['eval-cascade']['command']}` |"
        )
    load = by_name.get("loadtest", {}).get("data", {}).get("runs")  # "queue N" keys: records before batching
    if load:
        shown = "; ".join(
            f"{q}: {s['outcomes'].get('200', 0)} answered, {s['outcomes'].get('429', 0)} refused with 429, "
            f"{s['outcomes'].get('lost', 0)} lost"
            + (f", {s['answered_per_s']} answered/s" if s.get("answered_per_s") else "")
            + (f", p50 / p99 {s['p50_s']:.2f} / {s['p99_s']:.2f} s" if s["p50_s"] is not None else "")
            for q, s in load.items()
        )
        rows.append(f"| the server under load | {shown} | `{by_name['loadtest']['command']}` |")
    if not rows:
        return []
    return ["| figure | value | from |", "|---|---|---|", *rows]


def _metrics(artifacts: dict, sid: str) -> dict:
    manifest = _json(Path(artifacts[sid]) / "manifest.json") if sid in artifacts else None
    return (manifest or {}).get("metrics", {})


def _ci(r: dict) -> str:
    return f"{r['rate']:.0%} [{r['ci'][0]:.0%}, {r['ci'][1]:.0%}]"


def _rounds_lines(runs: dict, artifacts: dict) -> list[str]:
    """Each round of the loop (``rounds:`` in the preset): its pairs by tier, and its 1R against
    the student it started from (the last round's 1R) on the same held-out tasks."""
    later = sorted((int(sid.split(".")[1]), sid) for sid in artifacts if sid != "1R" and base_id(sid) == "1R")
    if not later:
        return []
    out = [
        "",
        "### Each round of the loop",
        "",
        "Round r mines, teaches and retrains round r-1's student on mining tasks no earlier round saw; each 1R is "
        "compared with the student it started from on its own held-out evaluation tasks (exact McNemar), and "
        "with that round's random control (the same budget of gold answers to tasks drawn at random from what "
        "its 1B answered).",
        "",
        "| round | pairs (by first passing tier) | student | 1R | 1R only / student only, p | power (10 points) "
        "| random control | 1R only / random only, p |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r, sid in ([(1, "1R")] if "1R" in artifacts else []) + later:
        comparison = (_json(Path(artifacts[sid]) / "retrain.json") or {}).get("comparison") or {}
        teach = _metrics(artifacts, sid.replace("1R", "1D"))
        tiers = ", ".join(f"{k.split('/', 1)[1]} {int(v)}" for k, v in teach.items() if k.startswith("answered_by/"))
        test = (comparison.get("mcnemar") or {}).get("1A")
        models = comparison.get("models") or {}
        if not test or "1A" not in models:
            continue
        control = (comparison.get("mcnemar") or {}).get("random")
        versus = "-" if control is None else f"{control['a_only']} / {control['b_only']}, p = {control['p']:.3f}"
        out.append(
            f"| {r} | {int(teach.get('pairs', 0))} ({tiers}) | {_ci(models['1A'])} | {_ci(models['1R'])} | "
            f"{test['a_only']} / {test['b_only']}, p = {test['p']:.3f} | {test.get('power_10pt', 0):.0%} | "
            f"{_ci(models['random']) if 'random' in models else '-'} | {versus} |"
        )
    return [*out, "", " ".join(_cite(sid, runs[sid], artifacts[sid]) for _, sid in later if sid in runs)]


_ARMS = ("1A", "replay", "pairs25", "pairs50", "1R", "random", "gold")
"""The study's arms in the order its table reads: the student, the sample-efficiency curve (0, 25,
50, 100% of the pairs), then the controls 1R must beat (random) and match (gold-only)."""


def _study_figures(client, plan, retrained_key: str | None = None) -> dict | None:
    """The latest ``<preset>-study`` flow run's stage 1S (or the preset's own run's, for a study
    preset's report): its run, artifact, comparison and, with a
    gold-only arm, 1R minus gold-only over the same tasks (paired bootstrap); None without one.
    ``earlier``: the study's 1R cache key where it is not ``retrained_key`` (this report's 1R): a study
    of an earlier loop, whose figures the report labels as such."""
    runs = {}
    for preset in (f"{plan.name}-study", plan.name):  # a study preset's own report: its own run's 1S
        try:
            runs = _stage_runs(client, _latest_flow_run(client, plan.experiment, preset))
        except KibidangoError:
            continue
        if "1S" in runs:
            break
    where = runs["1S"].data.tags.get(f"{TAG}artifact") if "1S" in runs else None
    if not where or not Path(where).is_dir():
        return None
    comparison = (_json(Path(where) / "retrain.json") or {}).get("comparison") or {}
    if "1R" not in (comparison.get("models") or {}):
        return None
    study = {"run": runs["1S"], "where": where, "comparison": comparison, "gold": None, "earlier": None}
    study["adapters"] = _study_adapters(runs)
    input_keys = runs["1S"].data.tags.get(f"{TAG}input_keys")
    studied = json.loads(input_keys).get("retrained") if input_keys else None
    if retrained_key and studied and studied != retrained_key:
        study["earlier"] = studied
    rows = _jsonl(Path(where) / "evaluation.jsonl")
    if "gold" in comparison["models"] and rows:
        pairs = [
            (r["passed"]["1R"], r["passed"]["gold"])
            for r in rows
            if None not in (r["passed"].get("1R"), r["passed"].get("gold"))
        ]
        diff, ci = _paired_difference(pairs)
        study["gold"] = {"diff": diff, "ci": ci, "tasks": len(pairs)}
    return study


def _study_adapters(runs: dict) -> list[dict]:
    """The domain adapters (3-5) a study trained, where the preset's own run leaves them out: each
    one's held-out check (adapter.json) with its run and artifact."""
    out = []
    for sid, run in runs.items():
        where = run.data.tags.get(f"{TAG}artifact")
        manifest = _json(Path(where) / "adapter.json") if where and base_id(sid) in ("3", "4", "5") else None
        if manifest and manifest.get("check"):
            out.append({"sid": sid, "run": run, "where": where, "domain": manifest["domain"], **manifest["check"]})
    return out


def _adapter_lines(adapters: list[dict]) -> list[str]:
    """The study's domain adapters: each against the weights it modifies on its domain's held-out tasks."""
    if not adapters:
        return []
    lines = [
        "",
        "### The domain adapters (stages 3-5, in the study)",
        "",
        "Each adapter against 1R's weights on its own domain's held-out tasks (mining part, less what 1B mined), "
        "greedy; it ships only if it passes more by an exact McNemar test at its recipe's `ship_p`, and 6A "
        "routes only to those that ship.",
        "",
        "| stage | domain | tasks | 1R alone | with the adapter | adapter only / 1R only, p | ships |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for a in adapters:
        lines.append(
            f"| {a['sid']} | {a['domain']} | {a['tasks']} | {a['base_passes']} | {a['adapter_passes']} | "
            f"{a['adapter_only']} / {a['base_only']}, p = {a['p']:.3f} | {'yes' if a['ships'] else 'no'} |"
        )
    return [*lines, "", " ".join(_cite(a["sid"], a["run"], a["where"]) for a in adapters)]


def _cache_key(runs: dict, sid: str) -> str | None:
    """The cache key of stage ``sid``'s run among a flow run's ``runs`` (None: the flow ran no such stage)."""
    return runs[sid].data.tags.get(f"{TAG}cache_key") if sid in runs else None


def _later_rounds(client, plan, retrained_key: str | None) -> tuple[dict, dict]:
    """The loop's later rounds (``1B.2`` ... ``1R.2``, ...) of the latest ``<preset>-rounds`` flow run
    (``make study-loop``), when its first round is this report's (its 1R's cache key is
    ``retrained_key``: a rounds run of an earlier loop says nothing about this one); the caller reads
    a preset's own later rounds (``rounds:``) from its own run instead. Returns (runs, artifacts) by
    stage id: those whose artifact is on disk."""
    try:
        flow = _latest_flow_run(client, plan.experiment, f"{plan.name}-rounds")
    except KibidangoError:
        return {}, {}
    runs = _stage_runs(client, flow)
    if retrained_key is None or _cache_key(runs, "1R") != retrained_key:
        return {}, {}
    later = {sid: r for sid, r in runs.items() if "." in sid}
    artifacts = _artifacts(later)
    return {sid: later[sid] for sid in artifacts}, artifacts


def _study_section(study: dict | None) -> list[str]:
    """``make study-loop``'s figures: every arm on the same held-out tasks, 1R against each
    (McNemar), 1R against gold-only for non-inferiority (the plan: within 3 points at the cascade's
    lower cost)."""
    if study is None:
        return []
    comparison = study["comparison"]
    models = comparison["models"]
    lines = [
        "",
        "### The study: every arm on the same tasks (`make study-loop`)",
        "",
        "1R's own model beside arms trained with the same recipe and budget: `replay` (no pairs), `pairs25` and "
        "`pairs50` (a quarter and half of the pairs: the sample-efficiency curve), `random` (gold answers to randomly "
        "drawn mined tasks) and `gold` (the same failures taught by the top tier alone). Wilson 95% intervals; "
        "exact McNemar of 1R against each.",
        "",
        "| arm | pass rate | 1R only / arm only, p | power (10 points) |",
        "|---|---:|---:|---:|",
    ]
    for arm in [a for a in _ARMS if a in models]:
        test = (comparison.get("mcnemar") or {}).get(arm)
        versus = "-" if test is None else f"{test['a_only']} / {test['b_only']}, p = {test['p']:.3f}"
        power = "-" if test is None else f"{test.get('power_10pt', 0):.0%}"
        lines.append(f"| {arm} | {_ci(models[arm])} | {versus} | {power} |")
    gold = study["gold"]
    if gold:
        verdict = (
            "non-inferior (the interval's lower end above -3 points)"
            if gold["ci"][0] > -0.03
            else "not shown non-inferior"
        )
        lines += [
            "",
            f"1R (cascade pairs) minus gold-only: {gold['diff']:+.1%} [{gold['ci'][0]:+.1%}, {gold['ci'][1]:+.1%}] "
            f"(paired bootstrap over {gold['tasks']} tasks): {verdict}.",
        ]
    if study.get("earlier"):
        lines += [
            "",
            f"**This study trained its arms beside an earlier 1R** (cache key `{study['earlier']}`, not this "
            "report's): the loop has been recomputed since; `make study-loop` reruns the study on this one.",
        ]
    return [*lines, "", _cite("1S", study["run"], study["where"]), *_adapter_lines(study.get("adapters") or [])]


Claim = tuple[str, str, str, str]
"""One row of the claims table: the claim, its goal, what was measured, and yes / no / - (not measured)."""


def _gain(comparison: dict) -> tuple[float, dict, str]:
    """1R against the student it started from (``1A`` in its comparison): the gain, the McNemar
    test, and both in words."""
    m, t = comparison["models"], comparison["mcnemar"]["1A"]
    gain = m["1R"]["rate"] - m["1A"]["rate"]
    return gain, t, f"{gain * 100:+.1f} points ({_pct(m['1A']['rate'])} -> {_pct(m['1R']['rate'])}), p = {t['p']:.3f}"


def _retrain_claims(retrain: dict | None, study: dict | None) -> list[Claim]:
    """1R against 1A (1R's own test), the controls (the study's where it ran, with 1R's own beside
    it: the study has the tasks to show the claim), and the held-out critical failures."""
    comparison = (retrain or {}).get("comparison") or {}
    tests = dict(comparison.get("mcnemar") or {})
    rows: list[Claim] = []
    if "1A" in tests:
        gain, t, words = _gain(comparison)
        rows.append(
            (
                "1R beats 1A on the ladder's evaluation part",
                ">= 10 points, p < 0.01",
                f"{words}, {t['n']} tasks",
                "yes" if gain >= 0.10 and t["p"] < 0.01 else "no",
            )
        )
    studied = (study or {}).get("comparison", {}).get("mcnemar") or {}
    for arm in ("random", "replay"):
        claim = (f"1R beats the {arm} control", "p < 0.05")
        # the study's test where it ran (the experiment sized for the claim), 1R's own beside it
        t, own = (studied[arm], tests.get(arm)) if arm in studied else (tests.get(arm), None)
        if t is None:
            rows.append((*claim, "not measured (make study-loop)", "-"))
            continue
        met = t["a_only"] > t["b_only"] and t["p"] < 0.05
        words = f"{t['a_only']} / {t['b_only']} discordant, p = {t['p']:.3f}"
        if arm in studied:
            words += _study_label(study, f", {t['n']:,} tasks" if t.get("n") else "")
            if own is not None:
                words += f"; 1R's own {own['n']} tasks: {own['a_only']} / {own['b_only']}, p = {own['p']:.3f}"
        rows.append((*claim, words, "yes" if met else "no"))
    if retrain and retrain.get("before"):
        before, after = retrain["before"]["rate"], retrain["after"]["rate"]
        rows.append(
            (
                f"held-out critical failures (1D's holdout, {retrain['before']['judged']})",
                "failure rate halved or better",
                f"{_pct(before)} -> {_pct(after)}",
                "yes" if after <= before / 2 else "no",
            )
        )
    return rows


def _teaching_claims(retrain: dict | None, cost: dict | None, study: dict | None) -> list[Claim]:
    """1D: the self tier's share of the pairs, dollars per pair against gold-only, and 1R on the
    cascade's pairs against 1R on gold-only pairs (the study)."""
    rows: list[Claim] = []
    tiers = (retrain or {}).get("pair_tiers") or {}
    if cost and cost.get("pairs"):
        # every tier that samples the student (`kind: self`; a cost.json from before kinds were
        # recorded names it `self`), a hinted one (STaR's rationalization) shown apart
        kinds = {n: v for n, v in (cost.get("tiers") or {}).items() if v.get("kind") == "self"}
        kinds = kinds or {"self": {}}
        own = sum(tiers.get(n, 0) for n in kinds)
        shown = {"answer": "shown the answer", "feedback": "shown its failing program's result"}
        hinted = {h: sum(tiers.get(n, 0) for n, v in kinds.items() if v.get("hint") == h) for h in shown}
        share = own / max(1, sum(tiers.values()))
        parts = [f"{n} {shown[h]}" for h, n in hinted.items() if n]
        split = f" ({own - sum(hinted.values())} unaided, {', '.join(parts)})" if parts else ""
        rows.append(
            (
                "pairs from the self tier",
                ">= 40%",
                f"{own} of {sum(tiers.values())} ({share:.0%}){split}",
                "yes" if share >= 0.4 else "no",
            )
        )
        if cost.get("top_tier_only_usd"):
            ratio = cost["spend_usd"] / cost["top_tier_only_usd"]
            rows.append(
                (
                    "dollars per corrected pair against gold-only",
                    "<= 50%",
                    f"${cost['spend_usd'] / cost['pairs']:.4f} against "
                    f"${cost['top_tier_only_usd'] / cost['pairs']:.4f} ({ratio:.0%})",
                    "yes" if ratio <= 0.5 else "no",
                )
            )
    claim = ("1R on cascade pairs within 3 points of 1R on gold-only pairs", "interval's lower end > -3 points")
    gold = (study or {}).get("gold")
    if not gold:
        return [*rows, (*claim, "not measured (make study-loop)", "-")]
    ci = gold["ci"]
    measured = f"{gold['diff'] * 100:+.1f} points [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]{_study_label(study)}"
    return [*rows, (*claim, measured, "yes" if ci[0] > -0.03 else "no")]


def _study_label(study: dict | None, detail: str = "") -> str:
    """What a figure drawn from the study says of it (and ``detail``): nothing more, or that its 1R
    was an earlier one."""
    return f" (the study, beside an earlier 1R{detail})" if (study or {}).get("earlier") else f" (the study{detail})"


def _round_claims(artifacts: dict) -> list[Claim]:
    """Each later round (1R.2, ...) against the student it started from (the round before)."""
    goal = "a gain, p < 0.05 (or the figure)"
    later = sorted((sid for sid in artifacts if sid.startswith("1R.")), key=lambda sid: int(sid.split(".")[1]))
    if not later:
        return [("round 2 adds a further gain", goal, "not run (`make study-loop` runs round 2)", "-")]
    rows: list[Claim] = []
    for sid in later:
        comparison = (_json(Path(artifacts[sid]) / "retrain.json") or {}).get("comparison") or {}
        if "1A" in (comparison.get("mcnemar") or {}):
            gain, t, words = _gain(comparison)
            met = gain > 0 and t["p"] < 0.05
            rows.append((f"round {sid.split('.')[1]} adds a further gain", goal, words, "yes" if met else "no"))
    return rows


def _cascade_claims(records: list[dict]) -> list[Claim]:
    """``make eval-cascade``'s record: APGR with its interval, and 6C's predicted escalation share."""
    cascade = next((r.get("data") for r in records if r["name"] == "eval-cascade"), None) or {}
    claim = ("the runtime cascade recovers the local-to-cloud gap (APGR)", ">= 0.7, interval above 0.5")
    a = cascade.get("apgr") or {}
    if a.get("apgr") is None or not a.get("apgr_ci"):
        rows: list[Claim] = [(*claim, "not measured (make eval-cascade)", "-")]
    else:
        ci = a["apgr_ci"]
        measured = f"{a['apgr']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] on {a['queries']} fresh queries"
        if a.get("apgr_oracle") is not None:  # the ceiling: the best any escalation order reaches there
            measured += f" (the oracle's ordering: {a['apgr_oracle']:.3f})"
        rows = [(*claim, measured, "yes" if a["apgr"] >= 0.7 and ci[0] > 0.5 else "no")]
    against = cascade.get("against_6c") or {}
    if against.get("expected_escalated") is not None:
        rows.append(
            (
                "6C's predicted escalation share holds on fresh queries",
                "within 5 points",
                f"predicted {_pct(against['expected_escalated'])}, measured {_pct(against['escalated'])}",
                "yes" if against["within_5_points"] else "no",
            )
        )
    return rows


def _claims(artifacts: dict, study: dict | None, records: list[dict]) -> list[str]:
    """The loop's claims (the plan's, as its issue states them), each with its goal, what this run
    measured and whether it is met: yes, no, or not measured (the stage or command that would say)."""
    retrain = _json(Path(artifacts["1R"]) / "retrain.json") if "1R" in artifacts else None
    cost = _json(Path(artifacts["1D"]) / "cost.json") if "1D" in artifacts else None
    rows = [
        *_retrain_claims(retrain, study),
        *_teaching_claims(retrain, cost, study),
        *_round_claims(artifacts),
        *_cascade_claims(records),
    ]
    return [
        "",
        "### The loop's claims, met or not",
        "",
        "Each goal as the issue that asked for the loop states it (the plan's numbers are claims, not results); "
        "the sections below give each figure's run.",
        "",
        "| claim | goal | measured | met |",
        "|---|---|---|---|",
        *(f"| {c} | {g} | {m} | {v} |" for c, g, m, v in rows),
    ]


def _paired_difference(pairs: list[tuple[bool, bool]], rounds: int = 2000, seed: int = 0) -> tuple[float, list[float]]:
    """Mean of a - b over paired outcomes, with a bootstrap 95% interval over the pairs."""
    import numpy as np

    d = np.array([float(a) - float(b) for a, b in pairs])
    if not len(d):
        return 0.0, [0.0, 0.0]
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(rounds, len(d)))].mean(axis=1)
    return float(d.mean()), [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def _bundle_policy(evaluation: dict | None) -> str:
    """The policy stage 9 answered by as the bundle does: the router's adapter (``auto``), or the base
    weights where no adapter ships (``none``)."""
    return "auto" if "auto" in (evaluation or {}).get("policies", ["auto"]) else "none"


_LADDERS = {"ladder_math": "math", "ladder_code": "code"}


def _paired_claim(pairs: list[tuple[bool, bool]], a: str, b: str) -> tuple[float, list[float], str]:
    """``a`` minus ``b`` on the same tasks: the difference, its paired bootstrap interval, and both in
    words with the discordant counts and the exact McNemar p."""
    from methods.evaluation import mcnemar

    diff, ci = _paired_difference(pairs)
    test = mcnemar({i: x for i, (x, _) in enumerate(pairs)}, {i: y for i, (_, y) in enumerate(pairs)})
    rate = lambda k: sum(p[k] for p in pairs) / len(pairs)  # noqa: E731
    words = (
        f"{diff * 100:+.1f} points [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}] ({_pct(rate(0))} vs {_pct(rate(1))}, "
        f"{len(pairs)} tasks; {a} only {test['a_only']} / {b} only {test['b_only']}, p = {test['p']:.3g})"
    )
    return diff, ci, words


def _mining_by_domain(chosen: dict, table: list[dict]) -> dict[str, str]:
    """2D's chosen row on its mining-part ladder, per domain, against the reference's: 'math 27/48
    against the reference's 30 (-5 +2)'."""
    from types import SimpleNamespace

    from methods.compression.fidelity import ladder_by_domain

    ref = next(r for r in table if r["reference"])
    if len(ref.get("ladder_domains") or []) != len(ref["ladder"]) or len(chosen["ladder"]) != len(ref["ladder"]):
        return {}  # a table from before the domains were kept
    # the table as gguf.json keeps it: the fields the paired test reads
    ref, chosen = (SimpleNamespace(**r) for r in (ref, chosen))
    return {  # the reference passed what the row did, less what the row won, plus what it lost
        d: f"{d} {n}/{k} against the reference's {n - won + lost} (-{lost} +{won})"
        for d, n, k, lost, won, _ in ladder_by_domain(ref, chosen)
    }


def _bundle_claims(artifacts: dict) -> list[Claim]:
    """The bundle against the model it started from and against the uncompressed 1R, goal by goal as
    the issue that asked for it states them: the target's size, the default bundle's, bits per weight,
    perplexity, the ladder kept (per domain, paired against 1R on the evaluation part), the ladder
    gained over the input (paired), tokens/s and peak RSS beside the input. A missed goal names the
    row of 2D's fidelity table that shows why."""
    ev = _json(Path(artifacts["9"]) / "evaluation.json") if "9" in artifacts else None
    shipped = artifacts.get("9A") or artifacts.get("X")  # the stamped bundle, or X's before 9A ran
    bundle = _json(Path(shipped) / "bundle" / "bundle.json") if shipped else None
    gguf = (_json(Path(artifacts["2D"]) / "gguf.json") if "2D" in artifacts else None) or {}
    table = (gguf.get("fidelity") or {}).get("target") or []
    chosen = next((r for r in table if r["chosen"]), None)
    beside = (ev or {}).get("input_model")
    rows: list[Claim] = []
    sizes = {f["path"]: f["size"] for f in (bundle or {}).get("files", [])}
    target = ((bundle or {}).get("tiers", {}).get("target") or {}).get("gguf")
    if target in sizes:
        t_mb = sizes[target] / 1e6
        if beside:
            i_mb = beside["bytes"] / 1e6
            goal = f"<= the input's file ({i_mb:.1f} MB)"
            rows.append(
                ("the default bundle's target", goal, f"{t_mb:.1f} MB ({Path(target).name})", _yes(t_mb <= i_mb))
            )
        total = sum(sizes.values()) / 1e6
        profile = ((bundle or {}).get("profile") or {}).get("name", "full")
        rows.append(
            (
                f"the whole bundle ({profile} profile)",
                "<= 1.3x its target",
                f"{total:.1f} MB, {total / t_mb:.2f}x",
                _yes(total <= 1.3 * t_mb and profile == "default"),
            )
        )
    if chosen:
        lowest = min(table, key=lambda r: r["bits_per_weight"])
        why = (
            ""
            if chosen["bits_per_weight"] <= 4.5
            else (
                f"; the table's fewest bits, {lowest['name']} at {lowest['bits_per_weight']:.2f}: "
                + ("; ".join(lowest["why_not"]) or "kept every bound")
            )
        )
        rows.append(
            (
                "bits per weight of the target",
                "<= 4.5",
                f"{chosen['bits_per_weight']:.2f} ({chosen['name']}){why}",
                _yes(chosen["bits_per_weight"] <= 4.5),
            )
        )
        rows.append(
            (
                "perplexity against the uncompressed 1R (2D, held-out tokens)",
                "<= 1.05x",
                f"{chosen['ppl_ratio']:.3f}x",
                _yes(chosen["ppl_ratio"] <= 1.05),
            )
        )
    answers = {r["id"]: r for r in _jsonl(Path(artifacts["9"]) / "answers.jsonl")} if "9" in artifacts else {}
    policy = _bundle_policy(ev)
    retrained = _jsonl(Path(artifacts["1R"]) / "evaluation.jsonl") if "1R" in artifacts else []
    mining = _mining_by_domain(chosen, table) if chosen else {}
    for sample, domain in _LADDERS.items():
        pairs = [
            (answers[r["id"]]["answers"][policy]["passed"], r["passed"]["1R"])
            for r in retrained
            if r["sample"] == sample and r["id"] in answers and policy in answers[r["id"]]["answers"]
        ]
        if not pairs:
            continue
        claim = (f"{domain} ladder kept: the bundle against the uncompressed 1R", "within 2 points (interval above -2)")
        diff, ci, words = _paired_claim(pairs, "bundle", "1R")
        met = _shown(diff, ci[0], -0.02)
        if met != "yes" and domain in mining:
            words += f"; 2D's mining part: {mining[domain]}"
        rows.append((*claim, words, met))
    if beside:
        pairs = [
            (r["answers"][policy]["passed"], r["answers"]["input"]["passed"])
            for r in answers.values()
            if r["sample"] in _LADDERS and policy in r["answers"] and "input" in r["answers"]
        ]
        if pairs:
            diff, ci, words = _paired_claim(pairs, "bundle", "input")
            rows.append(("more ladder tasks passed than the input", "a gain, interval above 0", words, _yes(ci[0] > 0)))
        sp = beside["speed"]
        rows.append(
            (
                "tokens/s against the input's on stage 9's backend, side by side: the target's weights (ar steps)",
                ">= 1.0x",
                f"{sp['ratio']:.2f}x [{sp['ci'][0]:.2f}, {sp['ci'][1]:.2f}] ({sp['prompts']} prompts x "
                f"{sp['new_tokens']} tokens x {sp['rounds']} rounds"
                + (f"; the bundle's K/V cache at {ev['kv_cache']})" if ev.get("kv_cache", "f16") != "f16" else ")"),
                _shown(sp["ratio"], sp["ci"][0], 1.0),
            )
        )
        if run := sp.get("as_run"):  # an evaluation from before it was measured has none
            rows.append(
                (
                    f"the same, as each runs: the bundle in its tuned mode ({run['mode']}), the input in ar; "
                    "whole greedy requests",
                    ">= 1.0x",
                    f"{run['ratio']:.2f}x [{run['ci'][0]:.2f}, {run['ci'][1]:.2f}] (the same prompts and rounds)",
                    _shown(run["ratio"], run["ci"][0], 1.0),
                )
            )
        rows += _rss_claim(ev, beside)
    return rows


def _rss_claim(ev: dict, beside: dict) -> list[Claim]:
    """Stage 9's peak RSS against the input model's, with the K/V cache each ran with (none measured: no row)."""
    if beside.get("peak_rss_mb") is None or ev.get("peak_rss_mb") is None:
        return []
    mine, theirs = ev["peak_rss_mb"], beside["peak_rss_mb"]
    kv, at_f16 = ev.get("kv_cache", "f16"), beside.get("bundle_peak_rss_mb_at_input_kv_cache")
    cache = (
        f"; the bundle's K/V cache at {kv} (1F), the input's at llama.cpp's f16"
        + (f"; the bundle at f16: {at_f16:.1f} MB ({at_f16 / theirs - 1:+.1%})" if at_f16 else "")
        if kv != "f16"
        else ""
    )
    return [
        (
            "peak RSS loading and generating, against the input's",
            "no higher (within 1%: pages)",
            f"{mine:.1f} MB against {theirs:.1f} MB ({mine / theirs - 1:+.1%}){cache}",
            _yes(mine <= 1.01 * theirs),
        )
    ]


def _shown(estimate: float, low: float, goal: float) -> str:
    """A ratio's goal met (its interval's lower end at or above it), missed (the estimate below it),
    or not shown (the estimate meets it, the interval does not)."""
    return "yes" if low >= goal else "no" if estimate < goal else "not shown"


def _yes(met: bool) -> str:
    return "yes" if met else "no"


def _bundle_section(artifacts: dict) -> list[str]:
    """Does the bundle beat the model it started from? Its claims table (:func:`_bundle_claims`)."""
    rows = _bundle_claims(artifacts)
    if not rows:
        return []
    return [
        "",
        "## Does the bundle beat its input?",
        "",
        "### The bundle's claims, met or not",
        "",
        "Each goal as the issue that asked for the bundle states it. The ladder rows pair the shipped bundle "
        "(stage 9, on llama.cpp) with the uncompressed 1R (1R's own evaluation, on transformers) and with the "
        "input model, task by task on the ladder's evaluation part: the difference, its paired bootstrap 95% "
        "interval, the discordant tasks and the exact McNemar p. `not shown`: the point estimate is within the "
        "goal, the interval is not.",
        "",
        "| claim | goal | measured | met |",
        "|---|---|---|---|",
        *(f"| {c} | {g} | {m} | {v} |" for c, g, m, v in rows),
    ]


def _loop_section(runs: dict, artifacts: dict, study: dict | None = None, records: list[dict] = ()) -> list[str]:
    """Does the quality loop work? Per ladder level: 1A, 1R's controls and 1R on the same held-out
    evaluation tasks (1R's card), and the shipped bundle (stage 9); each round; then each stage's
    own part (its ``report_loop``: the teachers' tier split and cost cut, answer calibration, the
    cascade against random escalation, the adapters on the ladder). Each figure cites its stage and run."""
    out: list[str] = _claims(artifacts, study, list(records)) if "1R" in artifacts else []
    retrain = _json(Path(artifacts["1R"]) / "retrain.json") if "1R" in artifacts else None
    comparison = (retrain or {}).get("comparison") or {}
    evaluation = _json(Path(artifacts["9"]) / "evaluation.json") if "9" in artifacts else None
    quality = (evaluation or {}).get("quality", {})
    if comparison:
        models = list(comparison["models"])
        groups = sorted({g for m in comparison["models"].values() for g in m["groups"]})
        # the policy the bundle answers by: the router's adapter, or the base where no adapter ships
        policy = _bundle_policy(evaluation)
        shipped = f"shipped bundle (9, policy {policy})" if any(g in quality for g in groups) else None
        out += [
            "",
            "### Pass rate per ladder level: 1A, the controls, 1R and the shipped bundle",
            "",
            "Held-out evaluation tasks of the task ladder (no stage trains or mines on them); Wilson 95% intervals. "
            "`random`: the same retraining budget on gold answers to randomly drawn mined tasks; `replay`: on "
            "replay rows alone. Levels above the training cut-off (stage 0's recipe) are reachable only through "
            "the loop.",
            "",
            "| tasks | n | " + " | ".join(models) + (f" | {shipped} | n |" if shipped else " |"),
            "|---|---:|" + "---:|" * len(models) + ("---:|---:|" if shipped else ""),
        ]
        for g in [*groups, "all"]:
            rows = [comparison["models"][m] if g == "all" else comparison["models"][m]["groups"][g] for m in models]
            cells = " | ".join(_ci(r) for r in rows)
            extra = ""
            if shipped:
                key = g if g != "all" else None
                q = quality.get(key) if key else None
                extra = f" | {_ci(q['policies'][policy])} | {q['n']} |" if q and policy in q["policies"] else " | - | |"
            out.append(f"| {g} | {rows[0]['n']} | {cells}{extra if shipped else ' |'}")
        out += [
            "",
            "Exact McNemar tests (1R passed and the other failed / the reverse; the power to show a 10-point gain "
            "at p < 0.01 with these tasks): "
            + "; ".join(
                f"1R vs {name}: {t['a_only']} / {t['b_only']}, p = {t['p']:.3f}"
                + (f" (power {t['power_10pt']:.0%})" if "power_10pt" in t else "")
                for name, t in comparison["mcnemar"].items()
            )
            + ".",
            "",
            _cite("1R", runs["1R"], artifacts["1R"]) + (" " + _cite("9", runs["9"], artifacts["9"]) if shipped else ""),
        ]
    out += _rounds_lines(runs, artifacts)
    for sid in [sid for sid in STAGES if sid in artifacts and sid in runs]:  # each stage's own part
        part = getattr(load_stage(sid), "report_loop", None)
        lines = part(Path(artifacts[sid])) if part is not None else []
        if lines:
            out += ["", *lines, "", _cite(sid, runs[sid], artifacts[sid])]
    if out:
        out = ["", "## Does the loop work?", *out]
    return out


def _measurements(records: list[dict], bundles: list[str]) -> list[str]:
    lines = []
    ours = {Path(b).resolve() for b in bundles}
    for r in records:
        lines += ["", f"### {r['title']}", ""]
        used = (r.get("data") or {}).get("bundle")
        if used and ours and Path(used).resolve() not in ours:
            lines += [
                f"**Measured on another bundle** (`{shown_path(used)}`) than this flow run's "
                f"(`{shown_path(bundles[0])}`): "
                f"run `{r['command']}` again to measure this one.",
                "",
            ]
        lines += [r["markdown"].strip()] if r.get("markdown") else ["```text", r["output"].strip(), "```"]
        wall = f", {r['wall_s']:.0f} s wall" if r.get("wall_s") is not None else ""
        lines += [
            "",
            f"*(`{r['command']}`, commit `{r['git_sha'][:12]}`, {r['finished']}{wall}; `{shown_path(r['path'])}`)*",
        ]
    return lines


def _header(plan, flow) -> list[str]:
    started = dt.datetime.fromtimestamp(flow.info.start_time / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# kibidango report — preset `{plan.name}`",
        "",
        f"Flow run `{flow.info.run_id}` ({flow.info.status}), started {started}, git "
        f"`{flow.data.tags.get(f'{TAG}git_sha', '?')[:12]}`; experiment `{plan.experiment}`. Artifact paths "
        "are relative to the workspace (`$KIBIDANGO_HOME`, default `.kibidango`). Regenerate with "
        f"`make report PRESET={plan.name}` after `make demo`{' PRESET=' + plan.name if plan.name != 'tiny' else ''}.",
    ]


def _stages_table(runs: dict, artifacts: dict, minutes: dict) -> list[str]:
    """One row per stage of the flow run: computed or cached, its run, its minutes, its summary."""
    lines = [
        "",
        "## Stages",
        "",
        "| stage | name | computed or cached | MLflow run (source) | compute time | summary |",
        "|---|---|---|---|---:|---|",
    ]
    for sid, run in runs.items():
        tags = run.data.tags
        art = artifacts.get(sid)
        summary_line = ""
        if art and (Path(art) / "manifest.json").is_file():
            summary_line = json.loads((Path(art) / "manifest.json").read_text()).get("summary", "")
            summary_line = (
                summary_line.strip().splitlines()[0].rstrip(":").replace("|", "/") if summary_line.strip() else ""
            )
        status = "cached" if tags.get(f"{TAG}cached") == "yes" else "computed"
        if run.info.status != "FINISHED":
            status += f" ({run.info.status.lower()})"
        lines.append(
            f"| {sid} | {tags.get(f'{TAG}stage_name', '')} | {status} | `{_source(run)}` | "
            f"{'-' if minutes[sid] is None else f'{minutes[sid]:.1f} min'} | {summary_line[:300]} |"
        )
    return lines


def _figure(sid: str, run, art: str, made: bool, caption: str, image: str, alt: str) -> list[str]:
    """A plot the report made from the stage's artifact, with its caption and source (nothing if not made)."""
    return ["", caption, "", f"![{alt}]({image})", "", _cite(sid, run, art)] if made else []


def _stage_part(sid: str, name: str | None, images: list[str], run, art: str, out_dir: Path) -> list[str]:
    """A stage's part of a report section: its card (and plots) or, without a card, its metrics."""
    if name is None:  # no card: the stage's metrics
        metrics = json.loads((Path(art) / "manifest.json").read_text()).get("metrics", {})
        if not metrics:
            return []
        return [
            "",
            f"### Stage {sid} ({run.data.tags.get(f'{TAG}stage_name', '')})",
            "",
            "| metric | value |",
            "|---|---:|",
            *[f"| {k} | {v:.4g} |" for k, v in metrics.items()],
            "",
            _cite(sid, run, art),
        ]
    if not (Path(art) / name).is_file():
        return []
    heading, text = _card((Path(art) / name).read_text())
    body = ["", f"### {heading or 'Stage ' + sid}", "", text]
    for image in images:
        if (Path(art) / image).is_file():
            shutil.copy2(Path(art) / image, out_dir / f"{sid}-{image}")
            body += ["", f"![{image}]({sid}-{image})"]
    body += ["", _cite(sid, run, art)]
    if sid == "X":
        made = _size_quality_plot(_size_quality_points(Path(art)), out_dir / "size_quality.png")
        caption = "Size on disk against validation perplexity, every form of every tier:"
        body += _figure(sid, run, art, made, caption, "size_quality.png", "size and quality")
    if sid == "9":
        evaluation = json.loads((Path(art) / "evaluation.json").read_text())
        made = _acceptance_plot(evaluation, out_dir / "acceptance.png")
        body += _figure(
            sid,
            run,
            art,
            made,
            "Acceptance per decoding mode and tier (stage 9's speed benchmark):",
            "acceptance.png",
            "acceptance",
        )
    return body


def _stage_sections(client, runs: dict, artifacts: dict, out_dir: Path) -> list[str]:
    """The report's sections (:data:`_SECTIONS`), each with its stages' parts; training's with the loss curves."""
    lines: list[str] = []
    for title, intro, parts in _SECTIONS:
        body: list[str] = []
        for sid, name, images in parts:
            if sid in runs and artifacts.get(sid):
                body += _stage_part(sid, name, images, runs[sid], artifacts[sid], out_dir)
        if title.startswith("Training"):
            used = _loss_plot(client, runs, out_dir / "loss_curves.png")
            if used:
                body += [
                    "",
                    "### Training loss curves",
                    "",
                    "![loss curves](loss_curves.png)",
                    "",
                    "*(" + "; ".join(used) + ")*",
                ]
        if body:
            lines += ["", f"## {title}", *([intro] if intro else []), *body]
    return lines


def write_report(preset: str, out_dir: Path | None = None) -> Path:
    plan = load_preset(preset)
    client = _client()
    flow = _latest_flow_run(client, plan.experiment, plan.name)
    runs = _stage_runs(client, flow)
    out_dir = out_dir or home() / "reports" / plan.name
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a stale plot must not outlive the run it came from
    out_dir.mkdir(parents=True)
    artifacts = _artifacts(runs)
    order = {name: i for i, name in enumerate(_MEASUREMENTS)}
    records = sorted(read_records(plan.name), key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    minutes = {sid: _compute_minutes(client, r) for sid, r in runs.items()}
    summary = summary_table(flow, runs, minutes, artifacts, records)
    lines = _header(plan, flow)
    if summary:
        lines += ["", "## Summary", "", *summary]
    lines += _stages_table(runs, artifacts, minutes)
    retrained_key = _cache_key(runs, "1R")
    study = _study_figures(client, plan, retrained_key)
    own_rounds = any("." in sid for sid in artifacts)
    later_runs, later = ({}, {}) if own_rounds else _later_rounds(client, plan, retrained_key)
    lines += _loop_section({**runs, **later_runs}, {**artifacts, **later}, study, records)
    lines += _study_section(study)
    lines += _bundle_section(artifacts)
    lines += _stage_sections(client, runs, artifacts, out_dir)
    # the flow run's bundles: stage X's, and the copies that 1F tuned and 9A stamped (stage 9 evaluates 1F's)
    bundles = [str(Path(a) / "bundle") for s, a in artifacts.items() if s in ("X", "1F", "9A") and a]
    if records:
        lines += [
            "",
            "## Measurements",
            "",
            "Run outside the flow, each by the command printed under it (at that commit and time; the "
            "Makefile's measuring targets keep their output here).",
            *_measurements(records, bundles),
        ]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out_dir / "summary.md").write_text("\n".join(summary) + "\n", encoding="utf-8")
    return path


def publish(preset: str, report: Path, repo: Path = REPO_ROOT) -> list[Path]:
    """Copy the report to ``docs/report/<preset>/`` and put its summary into the README's block
    for the preset (when the README has one). Returns what was written."""
    target = repo / "docs" / "report" / preset
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(report.parent, target)
    written = [target / "REPORT.md"]
    readme = repo / "README.md"
    begin, end = f"<!-- report-summary:{preset} -->", "<!-- /report-summary -->"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        if end not in rest:
            raise KibidangoError(f"{readme}: {begin} without {end}")
        tail = rest.split(end, 1)[1]
        summary = (report.parent / "summary.md").read_text(encoding="utf-8").strip()
        readme.write_text(f"{head}{begin}\n{summary}\n{end}{tail}", encoding="utf-8")
        written.append(readme)
    return written
