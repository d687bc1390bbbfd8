"""Command line of the pipeline: ``python -m flows {run,compare,clean-cache,verify,report,schedule,worker}``.
The Makefile targets (``make demo``, ``make stage-<id>``, ...) call these."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from flows.workspace import configure_environment

configure_environment()  # before Prefect is imported

from core.contract import KibidangoError  # noqa: E402
from core.redaction import install_log_redaction, redact_text  # noqa: E402


def _run(args: argparse.Namespace) -> None:
    from flows.plan import describe_plan
    from flows.preset import load_preset
    from stages import stage_ids

    plan = load_preset(args.preset, args.set)
    if args.resend_unconfirmed:  # read by the stage at run time; not part of any cache key
        os.environ["KIBIDANGO_RESEND_UNCONFIRMED"] = "1"
    args.force = [sid for given in args.force for sid in stage_ids(given, plan.order())]
    if args.dry_run:
        print(describe_plan(plan, args.force))
        return
    # Preflight: missing or empty sources fail here, with a plain message, before Prefect starts.
    describe_plan(plan, args.force)

    from core.redaction import redact_text
    from flows.stage_flow import pipeline, preset_flows
    from flows.workspace import home, reap_orphan_prefect_servers, tracking_uri

    _quiet_user_errors()
    for pid in reap_orphan_prefect_servers():
        print(
            f"stopped Prefect's temporary server (pid {pid}), left running by a killed flow of this workspace",
            file=sys.stderr,
        )

    routes = _routes(args.pool)
    plan.check_routes(routes, "--pool")
    for sid in plan.order():
        pool = plan.pool(sid, routes)
        if pool:
            print(f"stage {sid} runs on a worker of work pool {pool!r}", file=sys.stderr)
    flow_fn = preset_flows().get(plan.name, pipeline)
    artifacts = flow_fn(preset=args.preset, force=args.force, overrides=args.set, pools=routes)
    print("\n== where things are ==")
    print(f"workspace       {home()}")
    for sid, a in artifacts.items():
        print(f"stage {sid:<9} {a.path}")
        card = Path(a.path) / "data_card.md"
        if card.is_file():
            print(f"  data card     {card}")
    print(
        f"MLflow          {redact_text(tracking_uri())}  experiment '{plan.experiment}'  (make mlflow-ui; make compare)"
    )
    from flows.showcase import show_bundle

    show_bundle(artifacts)
    print(
        f"\nevery figure of this run, with plots and the run each came from: make report PRESET={args.preset} "
        f"(writes {home() / 'reports' / plan.name / 'REPORT.md'})"
    )


class _UserErrorFilter(logging.Filter):
    """Keeps Prefect's console from printing the tracebacks of a :class:`KibidangoError` (four of
    them, 137 lines, for one bad source): the CLI prints its one-line message at the end. The
    records still reach Prefect's API (its UI shows them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KibidangoError):
            return False
        return not (record.name.startswith("prefect") and "KibidangoError" in record.getMessage())


def _quiet_user_errors() -> None:
    quiet = _UserErrorFilter()
    names = ["", *(n for n in logging.root.manager.loggerDict if n.startswith("prefect"))]
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if type(handler).__name__ != "APILogHandler":
                handler.addFilter(quiet)


def _routes(items: list[str]) -> dict[str, str]:
    routes = {}
    for item in items:
        key, eq, pool = item.partition("=")
        if not eq or not key or not pool:
            raise KibidangoError(f"--pool {item!r}: expected STAGE_OR_TAG=POOL, e.g. --pool gpu=gpu-pool")
        routes[key] = pool
    return routes


def _worker(args: argparse.Namespace) -> None:
    from flows.pools import start_worker

    start_worker(args.pool)


def _compare(args: argparse.Namespace) -> None:
    from flows.compare import EVALUATION, compare_table

    print(compare_table(args.experiment, args.metrics.split(",") if args.metrics else None, args.stage, args.limit))
    if args.preset and not args.stage and not args.metrics:  # the evaluation view: and the registered bundles
        from mlflow.tracking import MlflowClient

        from flows.model_registry import versions_table
        from flows.workspace import tracking_uri

        print()
        print(versions_table(MlflowClient(tracking_uri()), args.preset, EVALUATION, args.limit))


def _clean(args: argparse.Namespace) -> None:
    from flows.clean_cache import clean_cache
    from flows.workspace import store

    print(clean_cache(store(), args.dry_run, args.stage, args.older_than_days))


def _verify(args: argparse.Namespace) -> None:
    from flows.workspace import store

    s = store()
    damaged = checked = 0
    for artifact in s.artifacts(args.stage):
        checked += 1
        problem = s.verify(artifact, full=True)
        if problem:
            damaged += 1
            print(f"DAMAGED {artifact}: {problem}")
    print(
        f"{checked} artifacts hashed, {damaged} damaged"
        + (" (a damaged artifact is recomputed by the next run)" if damaged else "")
    )
    if damaged:
        raise SystemExit(1)


def _report(args: argparse.Namespace) -> None:
    from flows.preset import load_preset
    from flows.report import publish, write_report

    report = write_report(args.preset)
    print(f"written: {report}")
    if args.publish:
        for path in publish(load_preset(args.preset).name, report):
            print(f"written: {path}")


def _schedule(args: argparse.Namespace) -> None:
    from flows.preset import load_preset
    from flows.stage_flow import preset_flows

    plan = load_preset(args.preset)
    flow_fn = preset_flows()[plan.name]
    print(f"serving flow kibidango-{plan.name} on cron '{args.cron}' (Ctrl-C stops)")
    flow_fn.serve(name=f"{plan.name}-scheduled", cron=args.cron, parameters={"preset": args.preset})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a preset's flow")
    run.add_argument("--preset", default="tiny", help="preset name (recipes/presets/NAME.yaml) or a .yaml path")
    run.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STAGE",
        help="recompute this stage (an id, 2G, or a name, calibrate) even if cached",
    )
    run.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE", help="override one config value")
    run.add_argument("--dry-run", action="store_true", help="resolve and print the stage plan; run nothing")
    run.add_argument(
        "--resend-unconfirmed",
        action="store_true",
        help="1D: charge every paid request whose fate a killed attempt left unknown its worst case and send it "
        "again (a journal line cut by the kill otherwise stops the stage)",
    )
    run.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="STAGE_OR_TAG=POOL",
        help="run that stage (or every stage with that tag, e.g. gpu) on a worker of that Prefect work pool",
    )
    run.set_defaults(func=_run)

    work = sub.add_parser("worker", help="deploy the stage flow to a work pool and run a worker for it")
    work.add_argument("--pool", required=True, help="the work pool (created, type process, if missing)")
    work.set_defaults(func=_worker)

    cmp_ = sub.add_parser("compare", help="table of metrics across an experiment's stage runs")
    cmp_.add_argument("--experiment", default="kibidango-tiny")
    cmp_.add_argument("--stage", default=None, help="only this stage id (default: 9, the evaluation)")
    cmp_.add_argument(
        "--metrics",
        default=None,
        help="comma list (default: the evaluation's headline metrics for stage 9, else the stage's first 8)",
    )
    cmp_.add_argument("--limit", type=int, default=20)
    cmp_.add_argument("--preset", default=None, help="also list the registered bundles of kibidango-PRESET")
    cmp_.set_defaults(func=_compare)

    clean = sub.add_parser("clean-cache", help="delete cached artifacts (list them with --dry-run)")
    clean.add_argument("--dry-run", action="store_true")
    clean.add_argument("--stage", default=None)
    clean.add_argument("--older-than-days", type=float, default=None)
    clean.set_defaults(func=_clean)

    ver = sub.add_parser("verify", help="hash every file of every cached artifact and report the damaged ones")
    ver.add_argument("--stage", default=None)
    ver.set_defaults(func=_verify)

    rep = sub.add_parser("report", help="REPORT.md and plots for the latest flow run of a preset")
    rep.add_argument("--preset", default="tiny")
    rep.add_argument(
        "--publish",
        action="store_true",
        help="also copy it to docs/report/<preset>/ and rewrite the README's summary block for the preset",
    )
    rep.set_defaults(func=_report)

    sched = sub.add_parser("schedule", help="serve a preset's flow on a cron schedule")
    sched.add_argument("--preset", default="tiny")
    sched.add_argument("--cron", default="0 3 * * *")
    sched.set_defaults(func=_schedule)

    args = parser.parse_args(argv)
    install_log_redaction()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("kibidango").setLevel(logging.INFO)
    try:
        args.func(args)
    except KibidangoError as e:
        print(f"error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
