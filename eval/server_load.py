"""``make loadtest``: the server under load, as a user would run it. Starts ``kibidango serve`` on
the newest stage-X bundle of the workspace (127.0.0.1, a free port), drives it with ``kibidango
loadtest``'s client (``REQUESTS`` chat requests of ``MAX_TOKENS`` tokens from ``CONCURRENCY``
clients, greedy), once with a queue that holds them all and once with a short one, and prints the
outcomes, latency and throughput of each; the server is stopped with SIGTERM after each run. The
table goes to ``make report`` as the record ``loadtest``."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from core.contract import KibidangoError
from core.paths import home
from core.records import make_command, shown_path, write_record
from core.store import ArtifactStore
from eval.lineage import newest
from methods.serving import free_port, wait_ready


def serve_bundle(bundle: Path, port: int, log: Path, *options: str, timeout_s: float = 180) -> subprocess.Popen:
    """``kibidango serve`` on 127.0.0.1:``port`` with ``options``, its log in ``log`` (a pipe nobody
    reads would fill and stall the server), once ``/health`` answers."""
    exe = Path(sys.executable).with_name("kibidango")
    cmd = [str(exe), "serve", "--bundle", str(bundle), "--port", str(port), *options]
    print("$ " + shlex.join(cmd), flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s, "kibidango serve")
    except KibidangoError as e:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{e}: {log.read_text(errors='replace')[-2000:]}") from None
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then a kill after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    from kibidango.server.loadtest import format_load, run_load

    parser = argparse.ArgumentParser(prog="python -m eval.server_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="whose bundle (default: tiny; make passes PRESET)")
    parser.add_argument("--bundle", help="a bundle directory (default: the preset's newest stage-X bundle)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--queues", default="64,4", help="the --max-queue of each run")
    args = parser.parse_args(argv)

    x = newest(ArtifactStore(home() / "store"), "X", args.preset)
    if args.bundle is None and x is None:
        print("no stage-X bundle in the workspace: run `make demo` first", file=sys.stderr)
        return 1
    bundle = Path(args.bundle) if args.bundle else x / "bundle"
    body = {
        "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    rows = [
        "| server | outcomes | lost | p50 / p99 latency | throughput |",
        "|---|---|---:|---:|---:|",
    ]
    summaries = {}
    logs = home() / "cache" / "loadtest"  # the servers' logs, kept for a look after the run
    logs.mkdir(parents=True, exist_ok=True)
    for queue in [int(q) for q in args.queues.split(",")]:
        port = free_port()
        proc = serve_bundle(bundle, port, logs / f"serve-queue-{queue}.log", "--max-queue", str(queue))
        try:
            result = run_load(f"http://127.0.0.1:{port}", body, args.requests, args.concurrency)
        finally:
            stop_server(proc)
        print(format_load(result), flush=True)
        s = result.summary()
        summaries[str(queue)] = s
        outcomes = ", ".join(f"{v} x {k}" for k, v in s["outcomes"].items())
        latency = "-" if s["p50_s"] is None else f"{s['p50_s']:.2f} s / {s['p99_s']:.2f} s"
        rows.append(
            f"| `--max-queue {queue}` | {outcomes} ({s['seconds']:.1f} s) | {result.lost} | {latency} | "
            f"{s['answered_per_s']} answered/s |"
        )
    table = "\n".join(rows)
    text = (
        f"{args.requests} chat requests of {args.max_tokens} tokens (greedy) from {args.concurrency} clients "
        f"against `kibidango serve --bundle <bundle> --max-queue N` on 127.0.0.1; bundle `{shown_path(bundle)}`. "
        "429: refused at once with Retry-After (the queue was full).\n\n" + table
    )
    print(table)
    command = make_command("loadtest", sys.argv[1:] if argv is None else argv)
    data = {"bundle": str(bundle), "runs": summaries}
    path = write_record("loadtest", "The server under load", command, markdown=text, data=data, preset=args.preset)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
