"""``make loadtest``: the server under load, as a user would run it. Starts ``kibidango serve`` on
the newest stage-X bundle of the workspace (127.0.0.1, a free port) and drives it with ``kibidango
loadtest``'s client (chat requests, greedy) at 1, 4 and 16 concurrent clients: the serial server
(one request decodes at a time) and the batching one (``--parallel N``) side by side in one run,
then the serial server with a short queue (429s, none lost). Prints outcomes, p50/p99 latency and
throughput of each and the batching server's throughput over the serial one's; each server is
stopped with SIGTERM after its runs. The table goes to ``make report`` as the record ``loadtest``."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from core.contract import KibidangoError
from core.measurements import make_command, shown_path, write_record
from core.paths import home
from core.store import ArtifactStore
from eval.lineage import newest
from methods.local_server import free_port, wait_ready


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
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients of each run, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=12, help="requests of a run: this x its clients")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=16, help="the batching server's --parallel")
    parser.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
    parser.add_argument("--threads", type=int, default=2, help="the server's CPU threads (both servers alike)")
    parser.add_argument("--short-queue", type=int, default=4, help="--max-queue of the run that must see 429s")
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
    clients = [int(c) for c in args.clients.split(",")]
    most = max(clients)
    # (name, serve options, client counts): the serial server and the batching one at every
    # client count, side by side in this run; then the serial server with a short queue under
    # the most clients (429 + Retry-After, none lost).
    servers = [
        ("serial", ["--max-queue", "64"], clients),
        (f"parallel {args.parallel}", ["--max-queue", "64", "--parallel", str(args.parallel)], clients),
        (f"serial, queue {args.short_queue}", ["--max-queue", str(args.short_queue)], [most]),
    ]
    rows = [
        "| server | clients | outcomes | lost | p50 / p99 latency | throughput |",
        "|---|---:|---|---:|---:|---:|",
    ]
    summaries: dict[str, dict] = {}
    logs = home() / "cache" / "loadtest"  # the servers' logs, kept for a look after the run
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--backend", args.backend, "--threads", str(args.threads)]
    for name, options, counts in servers:
        port = free_port()
        log = logs / f"serve-{args.backend}-{name.replace(' ', '-').replace(',', '')}.log"
        proc = serve_bundle(bundle, port, log, *common, *options)
        try:
            for c in counts:
                result = run_load(f"http://127.0.0.1:{port}", body, args.requests_per_client * c, c)
                print(format_load(result), flush=True)
                s = result.summary()
                summaries[f"{name} @ {c}"] = {"server": name, "options": options, "clients": c, **s}
                outcomes = ", ".join(f"{v} x {k}" for k, v in s["outcomes"].items())
                latency = "-" if s["p50_s"] is None else f"{s['p50_s']:.2f} s / {s['p99_s']:.2f} s"
                rows.append(
                    f"| `{' '.join(options)}` | {c} | {outcomes} ({s['seconds']:.1f} s) | {result.lost} | {latency} | "
                    f"{s['answered_per_s']} answered/s |"
                )
        finally:
            stop_server(proc)
    ratios = []
    for c in clients:
        a, b = summaries.get(f"serial @ {c}"), summaries.get(f"parallel {args.parallel} @ {c}")
        if a and b and a["answered_per_s"] and b["answered_per_s"]:
            ratios.append(f"{c} client(s): {b['answered_per_s'] / a['answered_per_s']:.2f}x")
    table = "\n".join(rows)
    text = (
        f"Chat requests of {args.max_tokens} tokens (greedy), {args.requests_per_client} per client, against "
        f"`kibidango serve --bundle <bundle> {' '.join(common)}` on 127.0.0.1, the serial server (one request "
        "decodes at a time) and "
        f"the batching one (`--parallel {args.parallel}`: continuous batching) side by side in one run; bundle "
        f"`{shown_path(bundle)}`. 429: refused at once with Retry-After (the queue was full). Throughput of the "
        f"batching server over the serial one: {'; '.join(ratios) or '-'}.\n\n" + table
    )
    print(table)
    command = make_command("loadtest", sys.argv[1:] if argv is None else argv)
    data = {
        "bundle": str(bundle),
        "backend": args.backend,
        "runs": summaries,
        "parallel": args.parallel,
        "clients": clients,
    }
    path = write_record("loadtest", "The server under load", command, markdown=text, data=data, preset=args.preset)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
