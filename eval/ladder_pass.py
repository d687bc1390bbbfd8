"""Held-out math-ladder pass rate of one transformers checkpoint, greedy: the quick check between
compression stages (which of pruning, quantization or a recipe change costs the ladder what 1R
taught), without running stage 9 on a whole bundle.

    python -m eval.ladder_pass MODEL_DIR [MODEL_DIR ...] [--levels 1,2,3,4] [--per-level 12] [--part mining]

Each MODEL_DIR is a stage's checkpoint in the store (1R's, 2A's ``target/``, 2B's compressed-tensors
``target/``: transformers decompresses it). The tasks are the ladder's **mining** part by default —
a recipe chosen with this table must not have read the evaluation part, on which stage 9 judges the
bundle and 9A gates it (no stage trains or mines on that one); ``--part evaluation`` reads stage 9's own
tasks (levels 1-4, 12 a level: the same draw), to explain a verdict, not to choose. Answered as stage 1R
evaluates a checkpoint (the runtime's greedy decoding in the model's own chat template, every task in
one batch) and judged by the math judge (the final number). Printed as a table with Wilson 95%
intervals; nothing is written."""

from __future__ import annotations

import argparse
import time


def pass_rates(
    model_dir: str, levels: list[int], per_level: int, max_new_tokens: int = 96, part: str = "mining"
) -> dict[int, list[bool]]:
    """``{level: [passed, ...]}`` for ``per_level`` tasks of ``part`` at each math level, answered
    as stage 1R evaluates a checkpoint (:class:`methods.measure.generate.Answerer`: the runtime's
    greedy decoding, all tasks batched together)."""
    from concurrent.futures import ThreadPoolExecutor

    from methods.judges.math import MathJudge
    from methods.ladder import ladder_rows
    from methods.measure.generate import Answerer

    rows = ladder_rows("math", levels, part, per_level * len(levels))
    answerer = Answerer(model_dir, max_new_tokens, parallel=max(2, len(rows)))
    try:
        with ThreadPoolExecutor(len(rows)) as pool:
            texts = list(pool.map(lambda r: answerer(r["instruction"], r["input"]).text, rows))
    finally:
        answerer.close()
    judge = MathJudge()
    passed: dict[int, list[bool]] = {level: [] for level in levels}
    for row, text in zip(rows, texts, strict=True):
        passed[row["level"]].append(judge(row["task"], text).passed)
    return passed


def main(argv: list[str] | None = None) -> None:
    import torch

    from methods.evaluation import wilson

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="transformers checkpoint directories")
    p.add_argument("--levels", default="1,2,3,4", help="math ladder levels (comma-separated)")
    p.add_argument("--per-level", type=int, default=12, help="tasks per level")
    p.add_argument("--part", choices=["mining", "evaluation"], default="mining", help="the ladder part read")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    print("| model | " + " | ".join(f"L{level}" for level in levels) + " | all (95% Wilson) | seconds |")
    print("|---|" + "---:|" * (len(levels) + 2))
    for model in args.models:
        started = time.monotonic()
        passed = pass_rates(model, levels, args.per_level, part=args.part)
        every = [ok for level in levels for ok in passed[level]]
        lo, hi = wilson(sum(every), len(every))
        cells = " | ".join(f"{sum(passed[level])}/{len(passed[level])}" for level in levels)
        print(
            f"| {model} | {cells} | {sum(every)}/{len(every)} [{lo:.0%}, {hi:.0%}] | "
            f"{time.monotonic() - started:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
