"""Measurement records (``eval.record``, :mod:`core.measurements`) and publishing the report
(``make report PUBLISH=1``): what a measuring command printed is kept with its command, and the
README's summary block is rewritten from the report, nothing around it touched. The report
itself is built from a real flow run in tests/test_flow.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.contract import KibidangoError
from eval.record import clean
from flows.report import _measurements, publish
from tests.conftest import REPO


def _record(home, *args):
    env = {"KIBIDANGO_HOME": str(home), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "eval.record", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_measurement_is_recorded_and_a_failed_rerun_keeps_it(tmp_path):
    ok = _record(tmp_path, "rows", "--title", "Rows per second", "--", sys.executable, "-c", "print('42 rows/s')")
    assert ok.returncode == 0, ok.stderr
    assert "42 rows/s" in ok.stdout  # shown as it comes
    path = tmp_path / "reports" / "records" / "rows.json"
    record = json.loads(path.read_text())
    assert record["output"] == "42 rows/s" and record["title"] == "Rows per second"
    assert (
        record["command"].endswith("-c 'print('\"'\"'42 rows/s'\"'\"')'")
        and record["git_sha"]
        and record["wall_s"] >= 0
    )

    failed = _record(
        tmp_path, "rows", "--title", "Rows", "--", sys.executable, "-c", "import sys; print('0 rows/s'); sys.exit(3)"
    )
    assert failed.returncode == 3 and "the last good record is kept" in failed.stderr
    assert json.loads(path.read_text())["output"] == "42 rows/s"

    bad = _record(tmp_path, "Bad Name", "--title", "x", "--", sys.executable, "-c", "pass")
    assert bad.returncode != 0 and "record name 'Bad Name'" in bad.stderr


def test_progress_bars_and_redraws_are_not_kept():
    printed = (
        "loading\n 10%|#    | 1/10\r100%|#####| 10/10\nstep 1\rstep 2\rdone: 3 rows\n\x1b[32mgreen\x1b[0m\n"
        "[transformers] Passing `generation_config` together with ... is deprecated\n"
        "/x/y.py:3: FutureWarning: soon\n"
        "  12/41 candidates\n  10/106 queries, 7 s\nidentical greedy outputs: 8/8 prompts\n"
    )
    assert clean(printed) == "loading\ndone: 3 rows\ngreen\nidentical greedy outputs: 8/8 prompts"
    assert clean("x" * 50, keep=10) == "...\n" + "x" * 10


def test_a_measurement_on_another_bundle_says_so(tmp_path):
    record = {
        "title": "Cascade",
        "command": "make eval-cascade",
        "git_sha": "abc123",
        "finished": "2026-11-23 09:00 UTC",
        "wall_s": 12.0,
        "markdown": "| a |\n|---|\n| 1 |",
        "output": "",
        "data": {"bundle": str(tmp_path / "old" / "bundle")},
        "path": str(tmp_path / "r.json"),
    }
    text = "\n".join(_measurements([record], [str(tmp_path / "new" / "bundle")]))
    assert "**Measured on another bundle**" in text and "make eval-cascade" in text and "| 1 |" in text
    same = "\n".join(_measurements([record], [str(tmp_path / "new" / "bundle"), str(tmp_path / "old" / "bundle")]))
    assert "another bundle" not in same and "commit `abc123`" in same


def test_publish_rewrites_only_the_readme_block(tmp_path):
    report_dir = tmp_path / "ws" / "reports" / "tiny"
    report_dir.mkdir(parents=True)
    (report_dir / "REPORT.md").write_text("# report\n")
    (report_dir / "summary.md").write_text("| figure | value |\n|---|---|\n| gates | releasable |\n")
    (report_dir / "plot.png").write_bytes(b"\x89PNG")
    repo = tmp_path / "repo"
    (repo / "docs" / "report" / "tiny").mkdir(parents=True)
    (repo / "docs" / "report" / "tiny" / "stale.png").write_bytes(b"old")
    before, after = "# Project\n\nintro\n\n", "\n\n## Next section\nkept\n"
    block = "<!-- report-summary:tiny -->\nold figures\n<!-- /report-summary -->"
    (repo / "README.md").write_text(before + block + after)

    written = publish("tiny", report_dir / "REPORT.md", repo=repo)
    assert repo / "README.md" in written
    readme = (repo / "README.md").read_text()
    assert readme.startswith(before) and readme.endswith(after)
    assert "| gates | releasable |" in readme and "old figures" not in readme
    assert sorted(p.name for p in (repo / "docs" / "report" / "tiny").iterdir()) == [
        "REPORT.md",
        "plot.png",
        "summary.md",
    ]  # the stale plot is gone

    (repo / "README.md").write_text("<!-- report-summary:tiny -->\nno end marker\n")
    with pytest.raises(KibidangoError, match="without <!-- /report-summary -->"):
        publish("tiny", report_dir / "REPORT.md", repo=repo)


def test_a_measurement_of_one_presets_bundle_is_kept_apart(tmp_path, monkeypatch):
    """The presets share a workspace: eval-cascade of the small bundle must not replace tiny's
    record, and the command it shows is the one a user types."""
    from core.measurements import make_command, read_records, write_record

    monkeypatch.setenv("KIBIDANGO_HOME", str(tmp_path))
    write_record("bench-dedup", "Dedup", "make bench-dedup")
    write_record("eval-cascade", "Cascade", "make eval-cascade", data={"n": 1}, preset="tiny")
    write_record("eval-cascade", "Cascade", "make eval-cascade PRESET=small", data={"n": 2}, preset="small")
    assert {r["name"]: r["data"].get("n") for r in read_records("small")} == {"bench-dedup": None, "eval-cascade": 2}
    assert {r["name"]: r["data"].get("n") for r in read_records("tiny")} == {"bench-dedup": None, "eval-cascade": 1}
    assert make_command("eval-cascade", ["--preset", "small", "--per-sample", "4"]) == (
        "make eval-cascade PRESET=small ARGS='--per-sample 4'"
    )
    assert make_command("eval-harness", ["--preset", "tiny"]) == "make eval-harness"


def test_a_measuring_command_finds_its_presets_artifacts(tmp_path):
    """Stage 9 of the small preset, published last, is not tiny's newest; tiny's 1T is found up the
    lineage of tiny's bundle, and the small preset (no 1T) has none."""
    import os

    from core.store import ArtifactStore
    from eval.lineage import newest, upstream

    store = ArtifactStore(tmp_path / "store")

    def publish(stage: str, key: str, inputs: dict[str, str], config: dict | None = None, at: int = 0):
        staging = store.new_staging_dir(stage, key)
        fields = {"config": config or {}, "inputs": {n: {"key": k} for n, k in inputs.items()}}
        found = Path(store.publish(stage, key, staging, fields).path)
        os.utime(found / "manifest.json", (at, at))
        return found

    teacher = publish("1T", "t1", {})
    chain = [("1D", "teachers", "t1"), ("1R", "pairs", "d1"), ("2A", "model", "r1"), ("2B", "model", "a1")]
    chain += [("2G", "target", "b1"), ("6C", "calibration", "g1")]
    for (stage, name, up), key in zip(chain, ["d1", "r1", "a1", "b1", "g1", "c1"], strict=True):
        publish(stage, key, {name: up})
    tiny_x = publish("X", "x1", {"cascade": "c1"}, {"preset": "tiny"}, at=100)
    publish("1F", "f1", {"bundle": "x1"}, at=100)
    tiny_9 = publish("9", "e1", {"bundle": "f1"}, at=100)
    small_x = publish("X", "x2", {"cascade": "c2"}, {"preset": "small"}, at=200)
    publish("1F", "f2", {"bundle": "x2"}, at=200)
    small_9 = publish("9", "e2", {"bundle": "f2"}, at=200)
    assert newest(store, "9", "tiny") == tiny_9 and newest(store, "9", "small") == small_9
    assert newest(store, "X", "tiny", need="cascade") == tiny_x and newest(store, "X", "small") == small_x
    assert newest(store, "X", "tiny", need="router") is None
    assert upstream(store, tiny_x, "1T") == teacher  # X <- 6C <- 2G <- 2B <- 2A <- 1R <- 1D <- 1T
    assert upstream(store, small_x, "1T") is None


def test_the_report_shows_each_round_of_the_loop(tmp_path):
    """With ``rounds: 2`` the report's loop section has a row per round: the pairs by tier, and
    that round's 1R against the student it started from, with the McNemar test and its power."""
    from types import SimpleNamespace

    from flows.report import _rounds_lines

    def stage(sid: str, retrain: dict | None, metrics: dict) -> str:
        where = tmp_path / sid
        where.mkdir()
        if retrain is not None:
            (where / "retrain.json").write_text(json.dumps(retrain))
        (where / "manifest.json").write_text(json.dumps({"metrics": metrics}))
        return str(where)

    def compared(before: float, after: float, p: float, random: float | None = None) -> dict:
        cell = lambda r: {"rate": r, "ci": [r - 0.05, r + 0.05], "n": 200, "groups": {}}  # noqa: E731
        test = {"n": 200, "a_only": 30, "b_only": 10, "p": p, "power_10pt": 0.9}
        models, mcnemar = {"1A": cell(before), "1R": cell(after)}, {"1A": test}
        if random is not None:
            models["random"] = cell(random)
            mcnemar["random"] = {"n": 200, "a_only": 12, "b_only": 23, "p": 0.09, "power_10pt": 0.6}
        return {"comparison": {"models": models, "mcnemar": mcnemar}}

    artifacts = {
        "1R": stage("1R", compared(0.20, 0.30, 0.002), {}),
        "1R.2": stage("1R.2", compared(0.30, 0.33, 0.4, random=0.40), {}),
        "1D": stage("1D", None, {"pairs": 300, "answered_by/self": 150, "answered_by/gold": 150}),
        "1D.2": stage("1D.2", None, {"pairs": 200, "answered_by/self": 120, "answered_by/gold": 80}),
    }
    run = SimpleNamespace(data=SimpleNamespace(tags={}), info=SimpleNamespace(run_id="r"))
    lines = "\n".join(_rounds_lines({sid: run for sid in artifacts}, artifacts))
    assert "### Each round of the loop" in lines
    first = "| 1 | 300 (self 150, gold 150) | 20% [15%, 25%] | 30% [25%, 35%] | 30 / 10, p = 0.002 | 90% | - | - |"
    assert first in lines
    assert "| 2 | 200 (self 120, gold 80) | 30%" in lines and "p = 0.400" in lines
    assert "| 40% [35%, 45%] | 12 / 23, p = 0.090 |" in lines  # round 2's random control
    assert _rounds_lines({}, {"1R": artifacts["1R"]}) == []  # one round: no such table


def test_the_report_reads_the_later_rounds_of_make_study_loop(tmp_path):
    """The latest ``<preset>-rounds`` flow run's round-2 stages (not its round 1: the preset's own),
    and none when that run's round 1 is not this report's 1R (a rounds run of an earlier loop)."""
    from types import SimpleNamespace

    from flows.report import _later_rounds
    from flows.tracking import TAG

    run = lambda tags, **info: SimpleNamespace(data=SimpleNamespace(tags=tags), info=SimpleNamespace(**info))  # noqa: E731
    flow = run({}, run_id="flow", experiment_id="e")
    stages = []
    for sid in ("1R", "1R.2", "1D.2"):
        (tmp_path / sid).mkdir()
        tags = {f"{TAG}stage_id": sid, f"{TAG}artifact": str(tmp_path / sid), f"{TAG}cache_key": f"key-{sid}"}
        stages.append(run(tags, run_id=sid))
    asked = []

    class Client:
        def get_experiment_by_name(self, name):
            return SimpleNamespace(experiment_id="e")

        def search_runs(self, ids, filter_string, **kw):
            asked.append(filter_string)
            return stages if "parentRunId" in filter_string else [flow]

    plan = SimpleNamespace(experiment="kibidango-tiny", name="tiny")
    runs, artifacts = _later_rounds(Client(), plan, "key-1R")
    assert sorted(artifacts) == sorted(runs) == ["1D.2", "1R.2"]
    assert "'tiny-rounds'" in asked[0]
    assert _later_rounds(Client(), plan, "key-of-a-newer-1R") == ({}, {})
    assert _later_rounds(Client(), plan, None) == ({}, {})


def test_the_report_has_the_study_when_make_study_loop_ran(tmp_path):
    """The latest ``<preset>-study`` flow run's 1S: every arm's pass rate, 1R against each, and 1R
    against gold-only with a paired bootstrap for non-inferiority."""
    from types import SimpleNamespace

    from flows.report import _paired_difference, _study_figures, _study_section
    from flows.tracking import TAG

    rates = {"1A": 0.2, "replay": 0.21, "pairs25": 0.24, "pairs50": 0.27, "1R": 0.30, "random": 0.22, "gold": 0.31}
    models = {m: {"rate": r, "ci": [r - 0.05, r + 0.05], "n": 100, "groups": {}} for m, r in rates.items()}
    tests = {m: {"n": 100, "a_only": 12, "b_only": 4, "p": 0.08, "power_10pt": 0.3} for m in rates if m != "1R"}
    where = tmp_path / "1S"
    where.mkdir()
    (where / "retrain.json").write_text(json.dumps({"comparison": {"models": models, "mcnemar": tests}}))
    with open(where / "evaluation.jsonl", "w") as f:
        for i in range(100):
            f.write(json.dumps({"id": f"t{i}", "passed": {"1R": i < 30, "gold": i < 31}}) + "\n")

    run = lambda tags, **info: SimpleNamespace(data=SimpleNamespace(tags=tags), info=SimpleNamespace(**info))  # noqa: E731
    flow = run({}, run_id="flow", experiment_id="e")
    stage = run({f"{TAG}stage_id": "1S", f"{TAG}artifact": str(where), "mlflow.parentRunId": "flow"}, run_id="s")
    math = tmp_path / "4"  # a domain adapter the study trained (the preset's own run leaves 3-5 out)
    math.mkdir()
    check = {"tasks": 48, "base_passes": 24, "adapter_passes": 23, "adapter_only": 2, "base_only": 3, "p": 1.0}
    (math / "adapter.json").write_text(json.dumps({"domain": "math", "check": {**check, "ships": False}}))
    adapter = run({f"{TAG}stage_id": "4", f"{TAG}artifact": str(math), "mlflow.parentRunId": "flow"}, run_id="m")

    class Client:
        def get_experiment_by_name(self, name):
            return SimpleNamespace(experiment_id="e")

        def search_runs(self, ids, filter_string, **kw):
            return [stage, adapter] if "parentRunId" in filter_string else [flow]

    plan = SimpleNamespace(experiment="kibidango-tiny", name="tiny")
    study = _study_figures(Client(), plan)
    lines = "\n".join(_study_section(study))
    assert "### The study" in lines and "| pairs25 | 24% [19%, 29%] | 12 / 4, p = 0.080 | 30% |" in lines
    assert "1R (cascade pairs) minus gold-only: -1.0%" in lines and "non-inferior" in lines
    assert "earlier 1R" not in lines
    assert "### The domain adapters (stages 3-5, in the study)" in lines
    assert "| 4 | math | 48 | 24 | 23 | 2 / 3, p = 1.000 | no |" in lines
    # A study whose arms were trained beside another 1R than the report's says so.
    stage.data.tags[f"{TAG}input_keys"] = json.dumps({"retrained": "aaa", "student": "bbb"})
    assert _study_figures(Client(), plan, "aaa")["earlier"] is None
    study = _study_figures(Client(), plan, "ccc")
    assert study["earlier"] == "aaa" and "beside an earlier 1R** (cache key `aaa`" in "\n".join(_study_section(study))
    diff, ci = _paired_difference([(True, False)] * 10 + [(False, False)] * 10)
    assert diff == pytest.approx(0.5) and ci[0] <= 0.5 <= ci[1]


def test_the_report_says_per_claim_whether_the_loop_met_it(tmp_path):
    """ "Does the loop work?" opens with a table: each of the loop's goals, what the run measured and
    yes / no — or "not measured" with the command that would measure it."""
    from flows.report import _claims

    def cell(r: float) -> dict:
        return {"rate": r, "ci": [r - 0.05, r + 0.05], "n": 300, "groups": {}}

    for sid in ("1R", "1D"):
        (tmp_path / sid).mkdir()
    (tmp_path / "1R" / "retrain.json").write_text(
        json.dumps(
            {
                "comparison": {
                    "models": {"1A": cell(0.30), "1R": cell(0.42), "random": cell(0.33)},
                    "mcnemar": {
                        "1A": {"n": 300, "a_only": 50, "b_only": 14, "p": 0.00001},
                        "random": {"n": 300, "a_only": 30, "b_only": 25, "p": 0.59},
                    },
                },
                "before": {"rate": 1.0, "judged": 99},
                "after": {"rate": 0.6, "judged": 99},
                "pair_tiers": {"self": 150, "gold": 150},
            }
        )
    )
    (tmp_path / "1D" / "cost.json").write_text(json.dumps({"pairs": 300, "spend_usd": 7.6, "top_tier_only_usd": 15.0}))
    artifacts = {sid: str(tmp_path / sid) for sid in ("1R", "1D")}
    lines = "\n".join(_claims(artifacts, None, []))
    assert (
        "| 1R beats 1A on the ladder's evaluation part | >= 10 points, p < 0.01 | +12.0 points (30.0% -> 42.0%)"
        in lines
    )
    assert "p = 0.000, 300 tasks | yes |" in lines
    assert "| 1R beats the random control | p < 0.05 | 30 / 25 discordant, p = 0.590 | no |" in lines
    assert "| 1R beats the replay control | p < 0.05 | not measured (make study-loop) | - |" in lines
    assert "| 100.0% -> 60.0% | no |" in lines  # not halved
    assert "| pairs from the self tier | >= 40% | 150 of 300 (50%) | yes |" in lines
    assert "| dollars per corrected pair against gold-only | <= 50% | $0.0253 against $0.0500 (51%) | no |" in lines
    # a hinted self tier (STaR's rationalization) counts as the student's own, shown apart
    retrain = json.loads((tmp_path / "1R" / "retrain.json").read_text())
    retrain["pair_tiers"] = {"self": 90, "self-hint": 60, "gold": 150}
    (tmp_path / "1R" / "retrain.json").write_text(json.dumps(retrain))
    kinds = {"self": {"kind": "self", "hint": None}, "self-hint": {"kind": "self", "hint": "answer"}}
    tiers = {**kinds, "gold": {"kind": "reference"}}
    cost = {"pairs": 300, "spend_usd": 7.6, "top_tier_only_usd": 15.0, "tiers": tiers}
    (tmp_path / "1D" / "cost.json").write_text(json.dumps(cost))
    hinted = "\n".join(_claims(artifacts, None, []))
    assert "| pairs from the self tier | >= 40% | 150 of 300 (50%) (90 unaided, 60 shown the answer) | yes |" in hinted
    assert "not measured (make eval-cascade)" in lines
    assert (
        "| round 2 adds a further gain | a gain, p < 0.05 (or the figure) | "
        "not run (`make study-loop` runs round 2) | - |" in lines
    )
    record = {
        "name": "eval-cascade",
        "data": {
            "apgr": {"apgr": 0.81, "apgr_ci": [0.74, 0.88], "queries": 120, "apgr_oracle": 0.86},
            "against_6c": {"expected_escalated": 0.2, "escalated": 0.28, "within_5_points": False},
        },
    }
    study = {
        "comparison": {"mcnemar": {"replay": {"a_only": 40, "b_only": 10, "p": 0.0001}}},
        "gold": {"diff": -0.01, "ci": [-0.05, 0.03], "tasks": 300},
    }
    (tmp_path / "1R.2").mkdir()
    later = {"1A": cell(0.42), "1R": cell(0.47)}
    (tmp_path / "1R.2" / "retrain.json").write_text(
        json.dumps(
            {"comparison": {"models": later, "mcnemar": {"1A": {"n": 300, "a_only": 30, "b_only": 15, "p": 0.036}}}}
        )
    )
    artifacts["1R.2"] = str(tmp_path / "1R.2")
    lines = "\n".join(_claims(artifacts, study, [record]))
    assert (
        "| round 2 adds a further gain | a gain, p < 0.05 (or the figure) | +5.0 points (42.0% -> 47.0%), "
        "p = 0.036 | yes |" in lines
    )
    assert "| 1R beats the replay control | p < 0.05 | 40 / 10 discordant, p = 0.000 (the study) | yes |" in lines
    # the study's random control, on its 1,010 tasks, before 1R's own 300
    study["comparison"]["mcnemar"]["random"] = {"n": 1010, "a_only": 90, "b_only": 50, "p": 0.001}
    lines = "\n".join(_claims(artifacts, study, [record]))
    assert (
        "| 1R beats the random control | p < 0.05 | 90 / 50 discordant, p = 0.001 (the study, 1,010 tasks); "
        "1R's own 300 tasks: 30 / 25, p = 0.590 | yes |" in lines
    )
    assert "| -1.0 points [-5.0, +3.0] (the study) | no |" in lines
    assert "| 0.810 [0.740, 0.880] on 120 fresh queries (the oracle's ordering: 0.860) | yes |" in lines
    assert "| predicted 20.0%, measured 28.0% | no |" in lines


def test_each_stage_supplies_its_own_summary_rows(tmp_path):
    """The summary's rows come from the stages (``report_headline``), read from their artifacts: an
    artifact without the file gives none; the gates' verdict and the shipped profile read as written."""
    from stages import STAGES, load_stage

    suppliers = [sid for sid in STAGES if hasattr(load_stage(sid), "report_headline")]
    assert {"9A", "9", "1F", "2D"} <= set(suppliers)
    for sid in suppliers:
        assert load_stage(sid).report_headline(tmp_path) == [], sid
    loop_parts = [sid for sid in STAGES if hasattr(load_stage(sid), "report_loop")]
    assert {"1D", "2G", "6C", "9"} <= set(loop_parts)
    for sid in loop_parts:
        assert load_stage(sid).report_loop(tmp_path) == [], sid
    gates = {
        "gates": [{"passed": True}, {"passed": False}],
        "releasable": False,
        "failed": ["ladder_math"],
        "waived": [],
    }
    (tmp_path / "gates.json").write_text(json.dumps(gates))
    (tmp_path / "bundle").mkdir()
    profile = {"name": "default", "backends": ["llamacpp"], "left_out": ["draft"]}
    (tmp_path / "bundle" / "bundle.json").write_text(json.dumps({"profile": profile, "files": [{"size": 2_500_000}]}))
    assert load_stage("9A").report_headline(tmp_path) == [
        ("quality gates", "**not releasable**: 1/2 pass; failed: ladder_math"),
        ("the shipped bundle: default profile for llamacpp", "2.50 MB; left out: draft"),
    ]


def test_the_loop_table_shows_the_bundle_under_the_policy_it_answers_by(tmp_path):
    """A preset that ships no domain adapter answers stage 9 under `none` only: the per-level table's
    bundle column reads that policy (it read `auto` alone and showed '-' on every row)."""
    from types import SimpleNamespace

    from flows.report import _loop_section

    cell = {"rate": 0.5, "ci": [0.4, 0.6], "n": 20}
    level = {**cell, "groups": {"ladder_code/L1": cell}}
    test = {"n": 20, "a_only": 5, "b_only": 1, "p": 0.2, "power_10pt": 0.3}
    for sid, name, body in (
        ("1R", "retrain.json", {"comparison": {"models": {"1A": level, "1R": level}, "mcnemar": {"1A": test}}}),
        (
            "9",
            "evaluation.json",
            {
                "policies": ["none", "input"],
                "quality": {
                    "ladder_code/L1": {
                        "n": 20,
                        "policies": {
                            "none": {"rate": 0.75, "ci": [0.5, 0.9]},
                            "input": {"rate": 0.25, "ci": [0.1, 0.5]},
                        },
                    }
                },
            },
        ),
    ):
        (tmp_path / sid).mkdir()
        (tmp_path / sid / name).write_text(json.dumps(body))
    artifacts = {sid: str(tmp_path / sid) for sid in ("1R", "9")}
    run = SimpleNamespace(data=SimpleNamespace(tags={}), info=SimpleNamespace(run_id="r"))
    lines = "\n".join(_loop_section({"1R": run, "9": run}, artifacts))
    assert "| shipped bundle (9, policy none) | n |" in lines
    assert "| ladder_code/L1 | 20 | 50% [40%, 60%] | 50% [40%, 60%] | 75% [50%, 90%] | 20 |" in lines


def test_the_report_says_per_goal_whether_the_bundle_beats_its_input(tmp_path):
    """ "Does the bundle beat its input?": each of the bundle's goals, measured from the artifacts of 9A
    (sizes), 2D (bits, perplexity), 9 (speed, RSS, answers) and 1R (its per-task verdicts): the ladder
    rows pair the bundle with the uncompressed 1R and with the input task by task, and a missed goal
    names what in 2D's table shows why."""
    from flows.report import _bundle_claims, _bundle_section, _shown

    for sid in ("1R", "2D", "9", "9A/bundle"):
        (tmp_path / sid).mkdir(parents=True)
    target = "tiers/target/gguf/target-Q4_0-mix.gguf"
    files = [{"path": target, "size": 96_000_000}, {"path": "router/router.json", "size": 4_000_000}]
    profile = {"name": "default", "backends": ["llamacpp"], "left_out": []}
    bundle = {"files": files, "profile": profile, "tiers": {"target": {"gguf": target}}}
    (tmp_path / "9A" / "bundle" / "bundle.json").write_text(json.dumps(bundle))
    domains = ["math"] * 4 + ["code"] * 4

    def row(name, bits, ratio, ladder, reference=False, chosen=False, why_not=()):
        return {
            "name": name,
            "bits_per_weight": bits,
            "ppl_ratio": ratio,
            "ladder": ladder,
            "ladder_domains": domains,
            "ladder_passed": sum(ladder),
            "ladder_tasks": len(ladder),
            "reference": reference,
            "chosen": chosen,
            "why_not": list(why_not),
        }

    table = [
        row("reference F16", 16.0, 1.0, [True] * 8, reference=True),
        row("mix", 5.7, 1.04, [False, True, True, True] + [True] * 4, chosen=True),
        row("Q4_0", 5.4, 1.2, [False] * 8, why_not=["perplexity ratio 1.200 > 1.05"]),
    ]
    (tmp_path / "2D" / "gguf.json").write_text(json.dumps({"fidelity": {"target": table}}))
    as_run = {"mode": "lookup", "ratio": 0.97, "ci": [0.9, 1.04]}
    speed = {"ratio": 1.02, "ci": [0.99, 1.05], "prompts": 16, "new_tokens": 32, "rounds": 3, "as_run": as_run}
    input_model = {"bytes": 98_400_000, "peak_rss_mb": 380.0, "speed": speed}
    evaluation = {"policies": ["none", "input"], "input_model": input_model, "peak_rss_mb": 379.0}
    (tmp_path / "9" / "evaluation.json").write_text(json.dumps(evaluation))
    # 20 math tasks: 1R passes 10, the bundle 6 of those and 1 other; the input 2; 20 code tasks: all pass
    verdicts = [("math", i, i < 10, i < 6 or i == 19, i < 2) for i in range(20)]
    verdicts += [("code", i, True, True, False) for i in range(20)]
    answers, evaluated = [], []
    for domain, i, retrained, shipped, came in verdicts:
        tid, sample = f"ladder-{domain}-{i}", f"ladder_{domain}"
        evaluated.append({"id": tid, "sample": sample, "passed": {"1A": False, "1R": retrained}})
        answers.append(
            {"id": tid, "sample": sample, "answers": {"none": {"passed": shipped}, "input": {"passed": came}}}
        )
    (tmp_path / "1R" / "evaluation.jsonl").write_text("\n".join(json.dumps(r) for r in evaluated))
    (tmp_path / "9" / "answers.jsonl").write_text("\n".join(json.dumps(r) for r in answers))
    artifacts = {sid: str(tmp_path / sid) for sid in ("1R", "2D", "9", "9A")}
    rows = {claim: (measured, met) for claim, _, measured, met in _bundle_claims(artifacts)}
    assert rows["the default bundle's target"] == ("96.0 MB (target-Q4_0-mix.gguf)", "yes")
    assert rows["the whole bundle (default profile)"] == ("100.0 MB, 1.04x", "yes")
    measured, met = rows["bits per weight of the target"]
    assert met == "no" and measured.endswith("the table's fewest bits, Q4_0 at 5.40: perplexity ratio 1.200 > 1.05")
    assert rows["perplexity against the uncompressed 1R (2D, held-out tokens)"] == ("1.040x", "yes")
    measured, met = rows["math ladder kept: the bundle against the uncompressed 1R"]
    assert met == "no" and measured.startswith("-15.0 points [")  # 7/20 against 10/20
    assert "(35.0% vs 50.0%, 20 tasks; bundle only 1 / 1R only 4, p = 0.375)" in measured
    assert measured.endswith("2D's mining part: math 3/4 against the reference's 4 (-1 +0)")
    assert rows["code ladder kept: the bundle against the uncompressed 1R"] == (
        "+0.0 points [+0.0, +0.0] (100.0% vs 100.0%, 20 tasks; bundle only 0 / 1R only 0, p = 1)",
        "yes",
    )
    measured, met = rows["more ladder tasks passed than the input"]
    assert met == "yes" and "(67.5% vs 5.0%, 40 tasks; bundle only 25 / input only 0" in measured
    weights = "tokens/s against the input's on stage 9's backend, side by side: the target's weights (ar steps)"
    assert rows[weights] == (
        "1.02x [0.99, 1.05] (16 prompts x 32 tokens x 3 rounds)",
        "not shown",  # the estimate meets the goal, its interval does not
    )
    as_run = "the same, as each runs: the bundle in its tuned mode (lookup), the input in ar; whole greedy requests"
    assert rows[as_run] == ("0.97x [0.90, 1.04] (the same prompts and rounds)", "no")
    assert _shown(1.10, 1.01, 1.0) == "yes" and _shown(1.0, 1.0, 1.0) == "yes"
    assert rows["peak RSS loading and generating, against the input's"] == ("379.0 MB against 380.0 MB (-0.3%)", "yes")
    # a bundle whose K/V cache 1F quantized: both rows say so, and the RSS row gives the bundle at f16 too
    input_model["bundle_peak_rss_mb_at_input_kv_cache"] = 383.8
    (tmp_path / "9" / "evaluation.json").write_text(
        json.dumps({**evaluation, "kv_cache": "q8_0", "peak_rss_mb": 296.4, "input_model": input_model})
    )
    rows = {claim: (measured, met) for claim, _, measured, met in _bundle_claims(artifacts)}
    assert rows["peak RSS loading and generating, against the input's"] == (
        "296.4 MB against 380.0 MB (-22.0%); the bundle's K/V cache at q8_0 (1F), the input's at llama.cpp's f16; "
        "the bundle at f16: 383.8 MB (+1.0%)",
        "yes",
    )
    assert rows[weights][0].endswith("3 rounds; the bundle's K/V cache at q8_0)")
    assert "## Does the bundle beat its input?" in _bundle_section(artifacts)
    assert _bundle_section({}) == []  # a run without these stages has no such section
