"""MLflow lineage: the flow run is a parent run, each stage a child run.

Uses ``MlflowClient`` with explicit run ids rather than the fluent API's thread-local active
run, because Prefect runs tasks in worker threads.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.time import get_current_time_millis

from core.processes import pid_alive
from core.redaction import is_secret_key, redact_text
from flows.workspace import default_artifact_location, tracking_uri

__all__ = ["Tracker", "flatten_params", "TAG"]

_PARAM_NAME = re.compile(r"[\w\-. /]+")
"""What MLflow accepts in a parameter's name: alphanumerics, underscores, dashes, periods, spaces, slashes."""

TAG = "kibidango."
PARENT_TAG = "mlflow.parentRunId"
_BATCH = 100  # MLflow's limit of params per log_batch call


def flatten_params(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"dedup.threshold": "0.5", "sources.0.name": ...}``. Values of keys
    that look like secrets, and values in the format of a known key, are masked (presets refuse
    them before a run starts; this is the second guard)."""
    out: dict[str, str] = {}
    if isinstance(value, dict) and not all(isinstance(k, str) and _PARAM_NAME.fullmatch(k) for k in value):
        # keys MLflow cannot name a parameter with (2D's tensor patterns: `blk\.(0|1)\.ffn_(gate|up)`):
        # the mapping is one value, its secret-looking keys masked
        masked = {k: "***" if is_secret_key(str(k)) and v else v for k, v in value.items()}
        out[prefix.rstrip(".")] = redact_text(json.dumps(masked, default=str))
    elif isinstance(value, dict):
        for k, v in value.items():
            key = f"{prefix}{k}"
            out.update({key: "***"} if is_secret_key(k) and v else flatten_params(v, key + "."))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            out.update(flatten_params(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = redact_text(json.dumps(value) if isinstance(value, (list, dict)) else str(value))
    return out


def _cell(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        value = json.dumps(value, ensure_ascii=False)
    return redact_text(value) if isinstance(value, str) else value


class Tracker:
    def __init__(self, experiment: str):
        self.client = MlflowClient(tracking_uri())
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=default_artifact_location()
            )
        else:
            self.experiment_id = exp.experiment_id

    def start_run(
        self, name: str, tags: dict[str, str], params: dict[str, Any] | None = None, parent: str | None = None
    ) -> str:
        owner = {f"{TAG}host": socket.gethostname(), f"{TAG}pid": str(os.getpid())}
        all_tags = {k: redact_text(v) for k, v in {**tags, **owner, **({PARENT_TAG: parent} if parent else {})}.items()}
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        if params:
            items = [Param(k, v[:6000]) for k, v in flatten_params(params).items()]
            for i in range(0, len(items), _BATCH):
                self.client.log_batch(run.info.run_id, params=items[i : i + _BATCH])
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        now = get_current_time_millis()
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, redact_text(v)) for k, v in tags.items()])

    def log_files(self, run_id: str, root: Path, files: list[str]) -> None:
        for rel in files:
            path = root / rel
            if path.is_file():
                self.client.log_artifact(run_id, str(path), artifact_path=str(Path(rel).parent) if "/" in rel else None)

    def log_table(self, run_id: str, path: Path, artifact_file: str, max_rows: int) -> None:
        """The first ``max_rows`` rows of the JSONL file ``path`` as an MLflow table (columns of
        nested values are stored as JSON text; strings are redacted)."""
        rows = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(rows) >= max_rows:
                    break
                rows.append(json.loads(line))
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = {c: [_cell(r.get(c)) for r in rows] for c in columns}
        self.client.log_table(run_id, data=data, artifact_file=artifact_file)

    def reap_orphans(self) -> list[str]:
        """Mark KILLED the runs left RUNNING by a process of this host that no longer exists
        (a flow killed with kill -9 cannot end its own runs). Returns their ids."""
        host = socket.gethostname()
        reaped = []
        for run in self.client.search_runs(
            [self.experiment_id],
            filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG}host` = '{host}'",
            max_results=1000,
        ):
            pid = int(run.data.tags.get(f"{TAG}pid", "0") or 0)
            if pid and not pid_alive(pid):
                self.client.set_terminated(run.info.run_id, "KILLED")
                reaped.append(run.info.run_id)
        return reaped

    def end_run(self, run_id: str, ok: bool) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
