"""The MLflow Model Registry: every bundle a stage with ``REGISTERS`` judges (stage 9A: the
bundle stamped with the gates' verdict) becomes a version of the registered model
``kibidango-<preset>``, and the alias ``champion`` moves only to a releasable one.

A version's files are its MLflow run's artifacts (``bundle/``: downloaded by
``models:/kibidango-tiny@champion`` through MLflow's artifact store, see
:mod:`kibidango.bundle.registry`); its tags: the verdict (``kibidango.release``, the failed and waived
gates), bundle.json's sha256 (``kibidango.bundle_sha256``: the runtime refuses a download that
differs), the flow run (Prefect and MLflow parent), and the MLflow runs of the stages the bundle
was built from (``kibidango.source_runs``). A bundle already registered (same digest) is not
registered again, so a cache hit of 9A adds no version. ``make compare`` lists the versions with
the evaluation figures of the stage-9 run behind each (:func:`versions_table`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from core.store import Artifact, ArtifactStore
from flows.compare import fmt_metric, text_table
from flows.tracking import TAG

__all__ = ["CHAMPION", "DIGEST_TAG", "model_name", "register_bundle", "source_runs", "versions_table"]

CHAMPION = "champion"
DIGEST_TAG = f"{TAG}bundle_sha256"  # the runtime's kibidango.bundle.registry.DIGEST_TAG


def model_name(preset: str) -> str:
    return "kibidango-" + re.sub(r"[^A-Za-z0-9_-]+", "-", preset).strip("-")


def _versions(client: MlflowClient, name: str) -> list[ModelVersion]:
    return sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def source_runs(bundle_dir: Path, inputs: dict[str, Artifact], store: ArtifactStore) -> dict[str, str]:
    """Stage id -> the MLflow run that computed it: the stages in the bundle's lineage
    (``stage_cache_keys``) and the registering stage's own inputs (stage 9's evaluation)."""
    meta = json.loads((bundle_dir / "bundle.json").read_text())
    runs = {}
    for stage, key in (meta.get("stage_cache_keys") or {}).items():
        manifest = store.path(stage, key) / "manifest.json"
        if manifest.is_file():
            runs[stage] = json.loads(manifest.read_text()).get("mlflow_run_id") or ""
    for a in inputs.values():
        runs[a.stage_id] = a.manifest.get("mlflow_run_id") or ""
    return dict(sorted(runs.items()))


def register_bundle(
    client: MlflowClient, preset: str, bundle_dir: Path, run_id: str, sources: dict[str, str], tags: dict[str, str]
) -> tuple[ModelVersion, bool]:
    """Register ``bundle_dir`` (logged as ``bundle/`` of MLflow run ``run_id``) as a version of
    ``kibidango-<preset>``, unless a version with its digest exists; point ``champion`` at it
    when it is new and releasable. Returns the version and whether it is new."""
    from kibidango.integrity import sha256_file

    name = model_name(preset)
    meta = json.loads((bundle_dir / "bundle.json").read_text())
    digest = sha256_file(bundle_dir / "bundle.json")
    try:
        client.create_registered_model(
            name,
            tags={f"{TAG}preset": preset},
            description=f"kibidango bundles of the {preset} preset, one version per bundle judged by stage 9A; "
            f"the alias {CHAMPION} is the newest releasable one.",
        )
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    for v in _versions(client, name):
        if v.tags.get(DIGEST_TAG) == digest:
            return v, False
    release = meta.get("release") or {}
    releasable = bool(release.get("releasable"))
    client.log_artifacts(run_id, str(bundle_dir), artifact_path="bundle")
    version = client.create_model_version(
        name,
        f"{client.get_run(run_id).info.artifact_uri}/bundle",
        run_id=run_id,
        tags={
            **tags,
            DIGEST_TAG: digest,
            f"{TAG}release": "releasable" if releasable else "not releasable",
            f"{TAG}gates_failed": ",".join(release.get("failed") or []),
            f"{TAG}gates_waived": ",".join(release.get("waived") or []),
            f"{TAG}source_runs": json.dumps(sources, sort_keys=True),
        },
        description=f"bundle.json sha256 {digest}; {'releasable' if releasable else 'NOT releasable'}",
    )
    if releasable:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return version, True


def versions_table(client: MlflowClient, preset: str, metrics: list[str], limit: int = 20) -> str:
    """The registered versions, newest first: alias, verdict, digest, flow run, and ``metrics``
    of the stage-9 run the bundle was evaluated in (from ``kibidango.source_runs``)."""
    name = model_name(preset)
    try:
        aliases = client.get_registered_model(name).aliases or {}
    except MlflowException:
        return f"no registered model {name!r} (stage 9A registers one on its first run)"
    by_version = {str(v): a for a, v in aliases.items()}
    header = ["version", "alias", "release", "bundle sha256", "flow run", *metrics]
    rows = []
    for v in reversed(_versions(client, name)[-limit:]):
        evaluation = json.loads(v.tags.get(f"{TAG}source_runs", "{}")).get("9")
        values = client.get_run(evaluation).data.metrics if evaluation else {}
        rows.append(
            [
                v.version,
                by_version.get(str(v.version), ""),
                v.tags.get(f"{TAG}release", ""),
                v.tags.get(DIGEST_TAG, "")[:12],
                v.tags.get(f"{TAG}prefect_flow_run_id", "")[:8],
                *(fmt_metric(values.get(m)) for m in metrics),
            ]
        )
    return "\n".join([f"registered model {name} ({len(rows)} versions shown)", *text_table(header, rows)])
