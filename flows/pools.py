"""Stages on Prefect work pools: a stage routed to a pool runs as a flow run of the
``kibidango-stage`` deployment on a worker of that pool, on whatever machine the worker runs.

Routing: the preset's ``pools`` (and ``python -m flows run --pool KEY=POOL``) map a stage id or a
stage tag (:data:`stages.TAGS`: the training and compression stages are tagged ``gpu``) to a work
pool. A routed stage's task computes the stage's cache key here, starts the deployment of that
pool with the stage id, the preset, each input's (stage, key) and the run context, and waits. The
worker's flow run resolves the inputs from its own store or the shared one, runs the stage through
the same runner (cache lookup, MLflow child run under the flow's parent run, publication), and the
artifact reaches the flow through the shared store (``KIBIDANGO_STORE_URL``), pulled and
hash-checked like any other. Nothing is passed between machines but names and keys.

Everything here is Prefect's own: work pools of the ``process`` type, deployments made with
``flow.from_source(...).deploy(...)`` from this checkout, ``prefect worker start``, and
``run_deployment``. Both the flow and the workers need a Prefect server (``PREFECT_API_URL``), the
shared store and, for one set of runs, one MLflow server (``MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from core.contract import KibidangoError, StageConfig
from core.paths import REPO_ROOT
from core.store import Artifact
from flows.preset import load_preset
from flows.runner import RunContext, execute_and_show, stage_key
from flows.workspace import store

__all__ = ["STAGE_FLOW", "deploy", "pool_stage_task", "stage_flow", "start_worker"]

STAGE_FLOW = "kibidango-stage"


def _need_server(what: str) -> None:
    if not os.environ.get("PREFECT_API_URL"):
        raise KibidangoError(
            f"{what} needs a Prefect server that the flow and the workers share: start one with "
            "`prefect server start` and set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api) everywhere"
        )


@flow(name=STAGE_FLOW)
def stage_flow(stage_id: str, preset: str, overrides: list[str], inputs: dict[str, dict], ctx: dict) -> dict:
    """One stage on this worker: ``inputs`` maps an input name to ``{"stage_id", "key"}``."""
    logging.getLogger("kibidango").setLevel(logging.INFO)  # progress lines, as the CLI shows them
    plan = load_preset(preset, overrides)
    here = store()
    resolved: dict[str, Artifact] = {}
    for name, ref in inputs.items():
        artifact = here.get(ref["stage_id"], ref["key"])
        if artifact is None:
            raise KibidangoError(
                f"stage {stage_id}: input {name!r} (stage {ref['stage_id']}, key {ref['key']}) is neither in this "
                f"worker's store ({here.root}) nor in a shared store: set KIBIDANGO_STORE_URL on the flow's machine "
                "and on every worker"
            )
        resolved[name] = artifact
    context = RunContext(**{**ctx, "store_root": str(here.root), "force": tuple(ctx.get("force", ()))})
    artifact = execute_and_show(stage_id, plan.configs[stage_id], resolved, context)
    return {"stage_id": artifact.stage_id, "key": artifact.key, "digest": artifact.digest}


@task(name="stage-on-pool", task_run_name="stage-{stage_id}@{pool}", cache_policy=NO_CACHE)
def pool_stage_task(
    stage_id: str,
    cfg: StageConfig,
    inputs: dict[str, Artifact],
    ctx: RunContext,
    pool: str,
    preset: str,
    overrides: list[str],
) -> Artifact:
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    _need_server(f"stage {stage_id} on work pool {pool!r}")
    here = store()
    if here.remote is None:
        raise KibidangoError(
            f"stage {stage_id} on work pool {pool!r}: the worker's artifact must reach this flow through a shared "
            "store; set KIBIDANGO_STORE_URL (and the same on every worker)"
        )
    key = stage_key(stage_id, cfg, inputs).key
    refs = {name: {"stage_id": a.stage_id, "key": a.key} for name, a in inputs.items()}
    context = {k: v for k, v in dataclasses.asdict(ctx).items() if k != "store_root"}
    try:
        run = run_deployment(
            f"{STAGE_FLOW}/{pool}",
            parameters={"stage_id": stage_id, "preset": preset, "overrides": overrides, "inputs": refs, "ctx": context},
            timeout=None,
            as_subflow=True,
        )
    except ObjectNotFound:
        raise KibidangoError(
            f"stage {stage_id}: no deployment {STAGE_FLOW}/{pool} on the Prefect server; start a worker for the pool "
            f"(make worker POOL={pool}), which deploys it"
        ) from None
    if not run.state.is_completed():
        raise KibidangoError(
            f"stage {stage_id} on work pool {pool!r}: flow run {run.name} ended {run.state.type.value}: "
            f"{run.state.message or 'see the worker log'}"
        )
    artifact = here.sync(stage_id, key)  # the worker's publication, even over an older local copy
    if artifact is None:
        raise KibidangoError(
            f"stage {stage_id} on work pool {pool!r}: flow run {run.name} completed but key {key} is not in the "
            f"shared store {here.remote.url}: is the worker's checkout at another commit (other code, other "
            "keys), or its KIBIDANGO_STORE_URL another store?"
        )
    return artifact


def deploy(pool: str) -> str:
    """The process work pool ``pool`` (created if missing) and the stage flow deployed to it from
    this checkout; returns the deployment's name."""
    _need_server("a work pool")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:  # another worker created it meanwhile
                pass
    source = flow.from_source(source=str(REPO_ROOT), entrypoint="flows/pools.py:stage_flow")
    source.deploy(name=pool, work_pool_name=pool, build=False, push=False, print_next_steps=False)
    return f"{STAGE_FLOW}/{pool}"


def start_worker(pool: str) -> None:
    """Deploy the stage flow to ``pool`` and run a Prefect process worker for it (until stopped)."""
    name = deploy(pool)
    print(f"deployment {name} on work pool {pool!r}; starting a worker (Ctrl-C stops it)", flush=True)
    prefect = shutil.which("prefect", path=os.path.dirname(sys.executable)) or "prefect"
    os.execvp(prefect, [prefect, "worker", "start", "--pool", pool, "--type", "process"])
