"""The Prefect flow: one task per stage of a preset, wired by the preset's ``needs``. Only
wiring lives here; stages do the work, the runner does caching and lineage."""

from __future__ import annotations

import os
import subprocess

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from core.store import Artifact
from flows.pools import pool_stage_task
from flows.preset import PRESETS_DIR, REPO_ROOT, load_preset
from flows.runner import RunContext, stage_task
from flows.tracking import TAG, Tracker
from flows.workspace import store, tracking_uri

__all__ = ["pipeline", "preset_flows"]


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _resolve_lazy_imports() -> None:
    """transformers resolves its top-level names lazily, and that is not thread-safe: two stage
    tasks importing ``AutoTokenizer`` at the same moment failed with "cannot import name
    'AutoTokenizer' from 'transformers'". Resolve the names the stages use once, before any task
    thread starts — where tasks run side by side (``KIBIDANGO_STAGE_WORKERS`` > 1): with one, no two
    imports race, and a flow whose stages never load a model does not spend ~6 s importing them."""
    if STAGE_WORKERS < 2:
        return
    import transformers

    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "LlamaConfig", "LlamaForCausalLM"):
        getattr(transformers, name)


STAGE_WORKERS = int(os.environ.get("KIBIDANGO_STAGE_WORKERS", "1"))
"""Stages that may run at once (Prefect task threads). One by default: llm-compressor's oneshot
traces models with torch.fx, which patches ``torch.nn.Module.__call__`` for the whole process, so
any other stage's forward pass during 2A-2C failed ("module is not installed as a submodule");
and on a 2-core machine parallel stages only share the cores (axolotl runs one at a time anyway)."""


# No ``log_prints``: it patches ``print`` for every thread of the flow, so a library printing into its own
# ``redirect_stdout`` (dill's pickling trace under datasets' fingerprinting, in 1B-1D) landed in the run's
# logs instead of its buffer. The flow logs through Prefect's run logger; stages through ``kibidango``.
@flow(name="kibidango", task_runner=ThreadPoolTaskRunner(max_workers=STAGE_WORKERS))
def pipeline(
    preset: str = "tiny",
    force: list[str] | None = None,
    overrides: list[str] | None = None,
    pools: dict[str, str] | None = None,
) -> dict[str, Artifact]:
    """Run a preset's stages; ``force`` recomputes those stage ids even on a cache hit,
    ``overrides`` (``STAGE.KEY=VALUE``) change single config values for this run, and ``pools``
    (stage id or tag -> work pool) add to the preset's routes (:mod:`flows.pools`)."""
    log = get_run_logger()
    plan = load_preset(preset, overrides)
    tracker = Tracker(plan.experiment)
    for run_id in tracker.reap_orphans():
        log.warning("MLflow run %s was left RUNNING by a process that is gone: marked KILLED", run_id)
    prefect_id = str(flow_run.get_id() or "")
    git_sha = _git_sha()  # recorded in every manifest this run publishes; stage X reads it from there
    parent = tracker.start_run(
        f"{plan.name}-{flow_run.get_name() or 'run'}",
        {
            f"{TAG}preset": plan.name,
            f"{TAG}prefect_flow_run_id": prefect_id,
            f"{TAG}git_sha": git_sha,
            f"{TAG}force": ",".join(force or []),
            f"{TAG}overrides": ";".join(overrides or []),
        },  # redacted by the tracker
    )
    ctx = RunContext(plan.name, plan.experiment, str(store().root), parent, prefect_id, tuple(force or ()), git_sha)
    ok = False
    _resolve_lazy_imports()
    try:
        futures = {}
        for sid in plan.order():
            inputs = {name: futures[up] for name, up in plan.needs(sid).items()}
            pool = plan.pool(sid, pools)
            if pool is None:
                futures[sid] = stage_task.submit(sid, plan.configs[sid], inputs, ctx)
            else:  # on a worker of that pool, through the shared store
                futures[sid] = pool_stage_task.submit(
                    sid, plan.configs[sid], inputs, ctx, pool, str(plan.path), list(overrides or [])
                )
        artifacts = {sid: f.result() for sid, f in futures.items()}
        ok = True
    finally:
        tracker.end_run(parent, ok)
    log.info(
        "MLflow: %s  experiment '%s'  parent run %s  (browse: make mlflow-ui)", tracking_uri(), plan.experiment, parent
    )
    for sid, a in artifacts.items():
        log.info("stage %s: %s", sid, a.path)
    return artifacts


def preset_flows() -> dict:
    """One named flow per shipped preset (``kibidango-tiny``, ...), for deployments and the UI."""
    return {p.stem: pipeline.with_options(name=f"kibidango-{p.stem}") for p in sorted(PRESETS_DIR.glob("*.yaml"))}
