"""The code judge on every benchmark's reference solution: each must pass, and what a task costs.

    python -m eval.judge_references [--shared ../shared] [--limit N]

Judges MBPP's and HumanEval's reference solutions (``../shared/data``) with the code judge as the
stages build it (its default settings, bubblewrap), one after another, and prints how many passed,
the ones that did not (with why), and the mean wall milliseconds per task. A reference that does
not pass is a judge bug (or a task's): it exits 1. Timings are this machine's: compare only runs
made side by side."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from eval.shared_data import SHARED
    from methods.benchmarks import load_tasks
    from methods.judges import make_judge

    parser = argparse.ArgumentParser(prog="python -m eval.judge_references", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=SHARED)
    parser.add_argument("--limit", type=int, default=None, help="tasks per benchmark (default: all)")
    args = parser.parse_args(argv)
    files = {
        "mbpp": args.shared / "data" / "mbpp" / "mbpp.jsonl",
        "humaneval": args.shared / "data" / "humaneval" / "HumanEval.jsonl.gz",
    }
    judge = make_judge("code")
    failed, seconds, n = [], 0.0, 0
    for benchmark, path in files.items():
        tasks = load_tasks(benchmark, path)[: args.limit]
        started = time.monotonic()
        for bt in tasks:
            t = bt.task
            verdict = judge(t, t.reference if benchmark == "mbpp" else t.prompt + t.reference)
            if not verdict.passed:
                failed.append(f"{t.id}: {verdict.outcome}: {verdict.reason[:200]}")
        took = time.monotonic() - started
        seconds += took
        n += len(tasks)
        print(f"{benchmark}: {len(tasks)} reference solutions judged, {1000 * took / max(1, len(tasks)):.1f} ms a task")
    print(f"all: {n - len(failed)}/{n} passed, {1000 * seconds / max(1, n):.1f} ms a task")
    for line in failed:
        print(f"  NOT PASSED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
