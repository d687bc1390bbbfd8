"""The Prefect flow through the real CLI (ephemeral Prefect server, sqlite MLflow), in a
subprocess as a user runs it: cache hits on a rerun, kill -9 recovery, schedules, errors."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import yaml

from core.store import ArtifactStore
from flows.tracking import TAG
from tests.conftest import REPO, cli_env, seed_workspace, start_flow, write_jsonl


def _cli(home: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows", *args],
        cwd=REPO,
        env=cli_env(seed_workspace(home)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _preset(tmp_path: Path, source: Path, **stage0) -> Path:
    path = tmp_path / "preset.yaml"
    config = {"sources": [{"name": "src", "path": str(source), "format": "alpaca", "license": "MIT"}], **stage0}
    path.write_text(
        yaml.safe_dump({"name": "flowtest", "experiment": "kibidango-flowtest", "stages": {"0": {"config": config}}})
    )
    return path


def _stage_runs(home: Path) -> list:
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    return mlflow.search_runs(
        experiment_names=["kibidango-flowtest"],
        filter_string=f"tags.`{TAG}stage_id` = '0'",
        order_by=["attributes.start_time ASC"],
        output_format="list",
    )


def test_second_run_is_all_cache_hits(tmp_path):
    rows = [
        {"instruction": f"Describe the colour number {i} of a sunset.", "output": f"It is shade {i} of orange."}
        for i in range(50)
    ]
    preset = _preset(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows))
    home = tmp_path / "home"
    first = _cli(home, "run", "--preset", str(preset))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "running (no cached artifact)" in first.stderr
    assert "data card" in first.stdout and "MLflow" in first.stdout
    second = _cli(home, "run", "--preset", str(preset))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "cache hit" in second.stderr and "running (" not in second.stderr
    runs = _stage_runs(home)
    assert [r.data.tags[f"{TAG}cached"] for r in runs] == ["no", "yes"]
    prefect_ids = [r.data.tags[f"{TAG}prefect_flow_run_id"] for r in runs]
    assert all(prefect_ids) and prefect_ids[0] != prefect_ids[1]
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 2  # one parent run per flow run
    # Prefect's UI: each flow run carries the stage's card (markdown) and its figures (table), one
    # version per run under the same key, computed and cache hit alike
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        shown = db.execute("select key, type, data, flow_run_id from artifact order by created").fetchall()
    cards = [(json.loads(data), run) for key, kind, data, run in shown if key == "flowtest-stage-0-card"]
    tables = [json.loads(data) for key, kind, data, _ in shown if key == "flowtest-stage-0-figures" and kind == "table"]
    assert [run for _, run in cards] == prefect_ids and len(tables) == 2
    assert "# Stage 0 (curate)" in cards[1][0] and "50 valid rows in" in cards[1][0] and "## Sources" in cards[1][0]
    figures = {row["metric"]: row["value"] for row in json.loads(tables[1])}  # Prefect keeps the table as JSON text
    assert figures["rows_in"] == 50 and figures["rows_out"] == 1

    # make report: the latest flow run, its stage a cache hit citing the run that computed it, its
    # card, and a measurement recorded in the workspace with its command.
    recorded = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.record",
            "rows",
            "--title",
            "Rows counted",
            "--as",
            "make rows",
            "--",
            sys.executable,
            "-c",
            "print('counted 50 rows')",
        ],
        cwd=REPO,
        env=cli_env(seed_workspace(home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert recorded.returncode == 0, recorded.stderr
    report = _cli(home, "report", "--preset", str(preset))
    assert report.returncode == 0, report.stderr[-3000:]
    text = (home / "reports" / "flowtest" / "REPORT.md").read_text()
    latest = runs[1].data.tags["mlflow.parentRunId"]
    assert f"Flow run `{latest}`" in text and "| 0 | curate | cached |" in text
    assert f"`{runs[0].info.run_id}`" in text and "50 valid rows in" in text  # the source run, its summary
    assert "## Data (stage 0)" in text and "#### Sources" in text  # the data card, headings one level down
    measured = text.split("## Measurements", 1)[1]
    assert "### Rows counted" in measured and "counted 50 rows" in measured and "(`make rows`, commit" in measured
    assert "no stage 9 runs" in _cli(home, "compare", "--experiment", "kibidango-flowtest").stdout

    # A same-size byte change inside the published dataset: make verify reports it, and the next
    # run does not take it as a hit but recomputes (with a warning naming the artifact).
    (artifact,) = ArtifactStore(home / "store").artifacts("0")
    arrow = next(artifact.rglob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0x01
    arrow.write_bytes(bytes(data))
    verify = _cli(home, "verify")
    assert verify.returncode == 1 and f"DAMAGED {artifact}" in verify.stdout, verify.stdout
    third = _cli(home, "run", "--preset", str(preset))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"{artifact}: {arrow.relative_to(artifact).as_posix()} does not match its sha256" in third.stderr
    assert "running (no cached artifact)" in third.stderr
    assert _cli(home, "verify").returncode == 0


def test_kill_9_in_the_middle_of_stage_0_then_rerun(tmp_path):
    rng = random.Random(0)
    words = [f"w{n}" for n in range(5000)]
    rows = [
        {"instruction": " ".join(rng.choices(words, k=12)), "output": " ".join(rng.choices(words, k=30))}
        for _ in range(30000)
    ]
    preset = _preset(tmp_path, write_jsonl(tmp_path / "big.jsonl", rows), language={"enabled": False})
    home = tmp_path / "home"
    stage_dir = home / "store" / "0"
    proc = start_flow(preset, home)
    try:
        deadline = time.monotonic() + 180
        while not (stage_dir.is_dir() and any(p.name.startswith(".tmp-") for p in stage_dir.iterdir())):
            assert proc.poll() is None, "the flow ended before stage 0 started writing"
            assert time.monotonic() < deadline, "stage 0 never started"
            time.sleep(0.2)
        time.sleep(1.0)  # well inside stage 0: it ingests, then deduplicates 30k rows
        assert proc.poll() is None, "stage 0 finished before the kill; make the input larger"
        os.kill(proc.pid, signal.SIGKILL)  # the flow process alone, as `kill -9 <pid>` does
        proc.wait()
        orphans = _prefect_servers(proc.pid)
        assert orphans, "expected Prefect's temporary server to outlive the killed flow"
        _run_and_check_rerun(home, preset, stage_dir, orphans)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group if the test failed
        except ProcessLookupError:
            pass
        proc.wait()


def _prefect_servers(session: int) -> list[int]:
    """Pids of Prefect server processes in process group ``session``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and os.getpgid(int(entry.name)) == session
                and b"prefect.server" in (entry / "cmdline").read_bytes()
            ):
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def _run_and_check_rerun(home: Path, preset: Path, stage_dir: Path, orphans: list[int]) -> None:
    leftovers = [p.name for p in stage_dir.iterdir() if not p.name.startswith(".lock-")]  # locks die with their holder
    assert leftovers and all(name.startswith(".tmp-") for name in leftovers)  # nothing published
    key = leftovers[0][len(".tmp-") :].split("-")[0]
    assert ArtifactStore(home / "store").get("0", key) is None  # the half artifact is never read

    rerun = _cli(home, "run", "--preset", str(preset))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "running (no cached artifact)" in rerun.stderr
    assert [p.name for p in stage_dir.iterdir() if not p.name.startswith(".lock-")] == [key]  # staging dir gone
    artifact = ArtifactStore(home / "store").get("0", key)
    assert artifact is not None and artifact.manifest["metrics"]["rows_in"] == 30000
    killed = [r for r in _stage_runs(home) if r.info.status == "KILLED"]
    assert len(killed) == 1 and "marked KILLED" in rerun.stderr + rerun.stdout  # the killed run is not left RUNNING
    assert f"stopped Prefect's temporary server (pid {orphans[0]})" in rerun.stderr
    assert not [
        pid
        for pid in orphans
        if Path(f"/proc/{pid}").exists() and (Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z")
    ]


def test_schedule_builds_a_cron_deployment():
    from flows.stage_flow import preset_flows

    deployment = preset_flows()["tiny"].to_deployment(
        name="tiny-scheduled", cron="0 3 * * *", parameters={"preset": "tiny"}
    )
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *" and deployment.parameters == {"preset": "tiny"}
    assert deployment.flow_name == "kibidango-tiny"


def test_a_stage_error_prints_one_line_not_prefect_tracebacks(tmp_path):
    preset = _preset(tmp_path, write_jsonl(tmp_path / "bad.jsonl", [{"question": "no instruction"}] * 3))
    r = _cli(tmp_path / "home", "run", "--preset", str(preset))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "yielded no valid rows" in line]
    assert len(errors) == 1 and errors[0].startswith("error: stage 0 (curate): source 'src'")


def test_cli_errors_are_one_clear_line(tmp_path):
    home = tmp_path / "home"
    bad_key = _preset(tmp_path, tmp_path / "x.jsonl", dedupp={"threshold": 0.5})
    r = _cli(home, "run", "--preset", str(bad_key))
    assert r.returncode == 2 and "stage 0: unknown key 'dedupp'" in r.stderr and "Traceback" not in r.stderr
    missing = _preset(tmp_path, tmp_path / "nowhere.jsonl")
    r = _cli(home, "run", "--preset", str(missing))
    assert r.returncode == 2 and f"source 'src': file not found: {tmp_path}/nowhere.jsonl" in r.stderr
    (tmp_path / "empty.jsonl").write_text("")
    r = _cli(home, "run", "--preset", str(_preset(tmp_path, tmp_path / "empty.jsonl")))
    assert r.returncode == 2 and "is empty (0 bytes)" in r.stderr and "Traceback" not in r.stderr
    r = _cli(home, "run", "--preset", "tiny", "--force", "2x")
    assert r.returncode == 2 and "stage '2x' is not in this preset" in r.stderr


def test_clean_cache_lists_before_it_deletes(tmp_path):
    store = ArtifactStore(tmp_path / "home" / "store")
    staging = store.new_staging_dir("0", "abc")
    (staging / "f.txt").write_text("data")
    store.publish("0", "abc", staging, {})
    dry = _cli(tmp_path / "home", "clean-cache", "--dry-run")
    assert "would delete 0/abc" in dry.stdout and (tmp_path / "home" / "store" / "0" / "abc").is_dir()
    real = _cli(tmp_path / "home", "clean-cache")
    assert "deleted 0/abc" in real.stdout and not (tmp_path / "home" / "store" / "0" / "abc").exists()


def test_a_later_rounds_stage_gets_an_artifact_key_prefect_takes():
    import re

    from flows.runner import artifact_key

    assert artifact_key("small-rounds", "1B.2") == "small-rounds-stage-1b-2"  # Prefect refused "1b.2"
    assert artifact_key("My Preset", "0") == "my-preset-stage-0"
    assert all(re.fullmatch(r"[a-z0-9-]+", artifact_key(p, s)) for p in ("tiny", "x.y") for s in ("1R.3", "9A"))
