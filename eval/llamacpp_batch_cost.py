"""What a multi-token forward costs on llama.cpp, in one-token steps: the price of an sd
verification (k drafted tokens + 1), which ``kibidango bench`` reports for one k only.

    python -m eval.llamacpp_batch_cost --gguf target.gguf [--threads 1] [--sizes 1,2,3,5,8,16,32]

Loads the GGUF through the runtime's llama.cpp backend (its thread counts and buffer types) and,
for each size, times one-token steps (the unit) and n-token forwards after a 40-token prefix, the
cache cropped back to it before each (as sd does after a rejection): ``kibidango bench``'s own
measurement (:func:`kibidango.tools.bench.step_costs`), medians over repeated rounds. Leviathan's
speed-up model assumes a verification costs one step; on a CPU where the matmuls are
compute-bound it costs more, and how much tells which k can pay off. Printed as a
table; nothing is written."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def batch_costs(gguf: Path, sizes: list[int], threads: int = 1, repeats: int = 7) -> tuple[float, dict[int, float]]:
    """Seconds of one one-token step (the median over sizes), and each size's forward in units of
    the steps measured beside it (:func:`kibidango.tools.bench.step_costs`, ``repeats`` rounds)."""
    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.tools.bench import step_costs

    models = {"target": LlamaCppModel(gguf, threads=threads)}
    prefix = [10 + i % 400 for i in range(40)]
    steps, costs = [], {}
    for n in sizes:
        step, forward = step_costs(models, prefix, rounds=repeats, batch=n)
        steps.append(step["target"])
        costs[n] = forward / step["target"]
    return statistics.median(steps), costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.llamacpp_batch_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (steps and batches alike)")
    parser.add_argument("--sizes", default="1,2,3,5,8,16,32", help="tokens per forward, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (each 16 steps and 16 forwards)")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if not args.gguf.is_file() or min(sizes) < 1:
        parser.error(f"--gguf {args.gguf}: no such file" if not args.gguf.is_file() else "--sizes: positive integers")
    one, costs = batch_costs(args.gguf, sizes, args.threads, args.repeats)
    print(
        f"{args.gguf.name}, {args.threads} thread(s): one-token step {one * 1e3:.2f} ms ({args.repeats} rounds a size)"
    )
    print("| tokens per forward | cost in one-token steps | per token |")
    print("|---:|---:|---:|")
    for n, cost in costs.items():
        print(f"| {n} | {cost:.2f} | {cost / n:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
