"""Run a measuring command and keep what it printed as a record for ``make report``.

    python -m eval.record NAME --title "what it measures" -- COMMAND [ARGS...]

The command's output (stdout and stderr together) is shown as it comes; when the command
succeeds, the output (progress bars dropped) is written with the command line, the commit, the
time and the wall time to ``<workspace>/reports/records/NAME.json`` (:mod:`core.measurements`), which
``make report`` prints under "Measurements". A failed command leaves the last good record in place
and exits with the command's status. The Makefile's measuring targets (``make eval-dedup``,
``make bench-dedup``, ``make fuzz-ingest``, ``make bench-runtime``, ``make bench-router``,
``make backend-agreement``, ``make loadtest``) run through it."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time

from core.measurements import write_record

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PROGRESS = re.compile(r"\d+%\|.*\|")  # a tqdm bar
_COUNTER = re.compile(r"^\s*\d+/\d+ [A-Za-z][A-Za-z ]*(, [\d.]+ s)?$")  # "  12/41 candidates": progress
_LIBRARY_WARNING = re.compile(r"^\[transformers\] |^\S+:\d+: \w*Warning: ")  # and Python's warnings


def clean(output: str, keep: int = 20_000) -> str:
    """The output as a reader would want it kept: carriage-return redraws collapsed to their final
    state, colour codes, progress bars and counters and libraries' warnings dropped, the last ``keep`` characters."""
    lines = []
    for line in _ANSI.sub("", output).split("\n"):
        line = line.rsplit("\r", 1)[-1].rstrip()
        if _PROGRESS.search(line) or _COUNTER.match(line) or _LIBRARY_WARNING.search(line):
            continue
        lines.append(line)
    text = "\n".join(lines).strip("\n")
    return text if len(text) <= keep else "...\n" + text[-keep:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m eval.record NAME --title TITLE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m eval.record", description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--title", required=True)
    parser.add_argument("--as", dest="shown", help="the command as the report shows it (default: the command run)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    started = time.monotonic()
    chunks = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        chunks.append(line)
    rc = proc.wait()
    if rc != 0:
        print(f"\n{args.name}: the command failed (exit {rc}); the last good record is kept", file=sys.stderr)
        return rc
    path = write_record(
        args.name,
        args.title,
        args.shown or shlex.join(command),
        output=clean("".join(chunks)),
        wall_s=round(time.monotonic() - started, 1),
    )
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
