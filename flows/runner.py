"""Run one stage through the cache: key -> store lookup -> (run into a staging dir -> publish),
with an MLflow child run either way (and, for a stage with ``REGISTERS``, a version in the MLflow
Model Registry: :mod:`flows.model_registry`). ``execute_stage`` is plain Python (tests call it
directly); ``stage_task`` is the Prefect task the flows use: it also shows each stage in
Prefect's UI — its card as a markdown artifact, its metrics as a table artifact, keyed
``<preset>-stage-<id>-card`` / ``-figures`` so the Artifacts page keeps every run's version."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from core.contract import TABLE_ROWS, KibidangoError, StageConfig, code_version, config_to_dict
from core.progress import metric_sink
from core.redaction import redact, redact_text
from core.remote import RemoteStore
from core.store import Artifact, ArtifactStore, cache_key
from flows.tracking import TAG, Tracker
from stages import load_stage, stage_name

__all__ = ["PublishedFailure", "RunContext", "execute_and_show", "execute_stage", "show_in_prefect", "stage_task"]

log = logging.getLogger("kibidango.runner")

CARD_CHARS = 100_000
"""At most this much of each card goes to Prefect's UI."""


class PublishedFailure(KibidangoError):
    """A stage that published its outputs and still fails the flow (a quality gate): ``artifact``
    is what it published."""

    def __init__(self, message: str, artifact: Artifact):
        super().__init__(message)
        self.artifact = artifact


@dataclass(frozen=True)
class RunContext:
    """What every stage of one flow run shares."""

    preset: str
    experiment: str
    store_root: str
    parent_run_id: str | None = None
    prefect_flow_run_id: str = ""
    force: tuple[str, ...] = field(default_factory=tuple)
    git_sha: str = "unknown"


@dataclass(frozen=True)
class StageKey:
    """A stage's cache key and what it was computed from, computed once per run of a stage and
    used for the lookup, the manifest and the MLflow tags alike."""

    key: str
    code_version: str
    config: dict
    digests: dict[str, str]


def stage_key(stage_id: str, cfg: StageConfig, inputs: dict[str, Artifact]) -> StageKey:
    module = load_stage(stage_id)
    digests = {name: a.digest for name, a in inputs.items()}
    if hasattr(module, "external_inputs"):
        digests.update(module.external_inputs(cfg))
    version, config = code_version(module), config_to_dict(cfg)
    return StageKey(cache_key(stage_id, version, config, digests), version, config, digests)


def execute_stage(stage_id: str, cfg: StageConfig, inputs: dict[str, Artifact], ctx: RunContext) -> Artifact:
    module = load_stage(stage_id)
    sk = stage_key(stage_id, cfg, inputs)
    key, digests, params = sk.key, sk.digests, sk.config
    store = ArtifactStore(ctx.store_root, RemoteStore.from_env())  # this machine's shared-store settings
    tracker = Tracker(ctx.experiment)
    tags = {
        f"{TAG}stage_id": stage_id,
        f"{TAG}stage_name": stage_name(stage_id),
        f"{TAG}cache_key": key,
        f"{TAG}input_keys": json.dumps({name: a.key for name, a in inputs.items()}, sort_keys=True),
        f"{TAG}input_digests": json.dumps(digests, sort_keys=True),
        f"{TAG}code_version": sk.code_version,
        f"{TAG}prefect_flow_run_id": ctx.prefect_flow_run_id,
        f"{TAG}preset": ctx.preset,
    }
    run_name = f"{stage_id}-{stage_name(stage_id)}"

    cached = store.get(stage_id, key)
    if cached is not None and stage_id not in ctx.force:
        return _record_hit(module, stage_id, cached, inputs, tracker, run_name, tags, params, ctx)
    with store.computing(
        stage_id,
        key,
        lambda who: log.info(
            f"stage {stage_id} ({stage_name(stage_id)}): key {key} is being computed by {who}; waiting"
        ),
    ) as waited:
        if waited and stage_id not in ctx.force:  # the other run may have published it
            cached = store.get(stage_id, key)
            if cached is not None:
                return _record_hit(module, stage_id, cached, inputs, tracker, run_name, tags, params, ctx)
        return _compute(module, stage_id, cfg, inputs, ctx, sk, store, tracker, run_name, tags, cached)


def _record_hit(module, stage_id, cached, inputs, tracker, run_name, tags, params, ctx) -> Artifact:
    name = stage_name(stage_id)
    manifest = cached.manifest
    run_id = tracker.start_run(
        run_name,
        {
            **tags,
            f"{TAG}cached": "yes",
            f"{TAG}source_run_id": manifest.get("mlflow_run_id") or "",
            f"{TAG}artifact": cached.path,
            f"{TAG}digest": cached.digest,
        },
        params,
        ctx.parent_run_id,
    )
    tracker.log_metrics(run_id, manifest.get("metrics", {}))
    _register(module, stage_id, cached, inputs, tracker, run_id, ctx)
    tracker.end_run(run_id, ok=True)
    log.info(f"stage {stage_id} ({name}): cache hit {cached.key} -> {cached.path}")
    if manifest.get("summary"):
        log.info(f"stage {stage_id} ({name}): {manifest['summary']}")
    if manifest.get("failure"):  # published, and still a reason to stop (a waiver changes the key)
        raise PublishedFailure(f"stage {stage_id} ({name}): {manifest['failure']}", cached)
    return cached


def _compute(module, stage_id, cfg, inputs, ctx, sk, store, tracker, run_name, tags, cached) -> Artifact:
    key, digests, params = sk.key, sk.digests, sk.config
    reason = "forced" if cached is not None else "no cached artifact"
    log.info(f"stage {stage_id} ({stage_name(stage_id)}): running ({reason}), key {key}")
    run_id = tracker.start_run(run_name, {**tags, f"{TAG}cached": "no"}, params, ctx.parent_run_id)
    if getattr(module, "SHIPS_INPUTS", False):  # nothing damaged is shipped: hash every input file
        for name, a in inputs.items():
            problem = store.verify(Path(a.path), full=True)
            if problem:
                tracker.end_run(run_id, ok=False)
                raise KibidangoError(
                    f"stage {stage_id}: input {name!r} ({a.path}) is damaged: {problem}; "
                    f"recompute it with make stage-{a.stage_id.lower()}"
                )
    staging = store.new_staging_dir(stage_id, key)
    resumable = getattr(module, "RESUMABLE", False)
    try:
        args = [cfg, {name: Path(a.path) for name, a in inputs.items()}, staging]
        if resumable:  # checkpoints of an earlier, interrupted attempt of this very key
            args.append(store.work_dir(stage_id, key))
        with metric_sink(lambda metrics, step: tracker.log_metrics(run_id, metrics, step)):
            result = module.run(*args)
        artifact = store.publish(
            stage_id,
            key,
            staging,
            redact(
                {
                    "stage_name": stage_name(stage_id),
                    "code_version": sk.code_version,
                    "config": params,
                    "inputs": {name: {"key": a.key, "digest": a.digest} for name, a in inputs.items()},
                    "external_inputs": {k: v for k, v in digests.items() if k not in inputs},
                    "mlflow_run_id": run_id,
                    "git_sha": ctx.git_sha,
                    "metrics": result.metrics,
                    "summary": result.summary,
                    **({"failure": result.failure} if result.failure else {}),
                }
            ),
        )
    except KibidangoError as e:
        store.discard(staging)
        tracker.end_run(run_id, ok=False)
        raise KibidangoError(f"stage {stage_id} ({stage_name(stage_id)}): {e}") from e
    except BaseException:
        store.discard(staging)
        tracker.end_run(run_id, ok=False)
        raise
    if resumable:
        shutil.rmtree(store.work_dir(stage_id, key), ignore_errors=True)
    tracker.set_tags(run_id, {f"{TAG}artifact": artifact.path, f"{TAG}digest": artifact.digest})
    tracker.log_metrics(run_id, result.metrics)
    tracker.log_files(run_id, Path(artifact.path), [*result.files_to_log, "manifest.json"])
    for name, rel in result.tables.items():
        tracker.log_table(run_id, Path(artifact.path) / rel, name, TABLE_ROWS)
    _register(module, stage_id, artifact, inputs, tracker, run_id, ctx)
    tracker.end_run(run_id, ok=result.failure is None)
    if result.summary:
        log.info(f"stage {stage_id} ({stage_name(stage_id)}): {result.summary}")
    if result.failure:
        raise PublishedFailure(f"stage {stage_id} ({stage_name(stage_id)}): {result.failure}", artifact)
    return artifact


def _register(
    module, stage_id: str, artifact: Artifact, inputs: dict[str, Artifact], tracker: Tracker, run_id: str, ctx
) -> None:
    """A stage with ``REGISTERS`` (a directory of its artifact holding a bundle): that bundle as a
    version of ``kibidango-<preset>`` in the MLflow Model Registry (once per bundle digest), its
    source runs those of the stages the bundle was built from and of this stage's inputs."""
    sub = getattr(module, "REGISTERS", None)
    if not sub:
        return
    from flows.model_registry import model_name, register_bundle, source_runs

    bundle = Path(artifact.path) / sub
    version, new = register_bundle(
        tracker.client,
        ctx.preset,
        bundle,
        run_id,
        source_runs(bundle, inputs, ArtifactStore(ctx.store_root)),
        {
            f"{TAG}preset": ctx.preset,
            f"{TAG}prefect_flow_run_id": ctx.prefect_flow_run_id,
            f"{TAG}mlflow_parent_run_id": ctx.parent_run_id or "",
            f"{TAG}git_sha": ctx.git_sha,
            f"{TAG}cache_key": artifact.key,
        },
    )
    where = f"models:/{model_name(ctx.preset)}/{version.version}"
    tracker.set_tags(run_id, {f"{TAG}registered_version": where})
    verdict = version.tags.get(f"{TAG}release", "")
    log.info(
        f"stage {stage_id} ({stage_name(stage_id)}): {'registered' if new else 'already registered'} {where} "
        f"({verdict})"
    )


def artifact_key(preset: str, stage_id: str) -> str:
    """``<preset>-stage-<id>``, as Prefect takes an artifact key: lowercase letters, digits and dashes
    (a later round's ``1B.2`` is ``1b-2``)."""
    slug = lambda text: re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")  # noqa: E731
    return f"{slug(preset) or 'preset'}-stage-{slug(stage_id)}"


def show_in_prefect(stage_id: str, artifact: Artifact, ctx: RunContext) -> None:
    """The stage's card(s) as a Prefect markdown artifact and its metrics as a table artifact, on
    the current flow run. A view: when Prefect refuses, a warning, and the stage's result stands."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = artifact_key(ctx.preset, stage_id)
    manifest = artifact.manifest
    run = manifest.get("mlflow_run_id")
    head = [
        f"# Stage {stage_id} ({stage_name(stage_id)})",
        "",
        manifest.get("summary") or "",
        "",
        f"Artifact `{artifact.path}`, cache key `{artifact.key}`"
        + (f", computed in MLflow run `{run}`." if run else "."),
        *([f"\n**Failed:** {manifest['failure']}"] if manifest.get("failure") else []),
    ]
    cards = []
    for card in sorted(Path(artifact.path).glob("*.md")):
        text = card.read_text(encoding="utf-8", errors="replace")[:CARD_CHARS]
        # figures are files beside the card, which the UI cannot show: name them instead
        text = re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", lambda m: f"*(figure {m[2]} in {artifact.path})*", text)
        cards += ["", "---", "", f"`{card.name}`", "", text]
    metrics = manifest.get("metrics", {})
    rows = [{"metric": k, "value": v if math.isfinite(v) else str(v)} for k, v in sorted(metrics.items())]
    try:
        create_markdown_artifact(
            redact_text("\n".join(head + cards)), key=f"{key}-card", description=f"stage {stage_id}"
        )
        if rows:
            create_table_artifact(rows, key=f"{key}-figures", description=f"stage {stage_id}: every metric")
    except Exception as e:  # noqa: BLE001 - the UI is a view of what is already published
        log.warning(f"stage {stage_id}: could not show it in Prefect's UI ({type(e).__name__}: {e})")


def execute_and_show(stage_id: str, cfg: StageConfig, inputs: dict[str, Artifact], ctx: RunContext) -> Artifact:
    """:func:`execute_stage`, then :func:`show_in_prefect` — also for a stage that published its
    outputs and failed the flow (the gates' card is what a user opens Prefect to read)."""
    try:
        artifact = execute_stage(stage_id, cfg, inputs, ctx)
    except PublishedFailure as e:
        show_in_prefect(stage_id, e.artifact, ctx)
        raise
    show_in_prefect(stage_id, artifact, ctx)
    return artifact


@task(name="stage", task_run_name="stage-{stage_id}", cache_policy=NO_CACHE)
def stage_task(stage_id: str, cfg: StageConfig, inputs: dict[str, Artifact], ctx: RunContext) -> Artifact:
    return execute_and_show(stage_id, cfg, inputs, ctx)
