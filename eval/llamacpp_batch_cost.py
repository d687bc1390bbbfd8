"""What a multi-token forward costs on llama.cpp, in one-token steps: the price of an sd
verification (k drafted tokens + 1), which ``kibidango bench`` reports for one k only.

    python -m eval.llamacpp_batch_cost --gguf target.gguf [--threads 1] [--sizes 1,2,3,5,8,16,32]

Loads the GGUF through the runtime's llama.cpp backend (its thread counts and buffer types), feeds
a 40-token prefix, then times, as medians over repeats: eight one-token steps (the unit), and one
n-token forward for each size, the cache cropped back to the prefix before each (as sd does after
a rejection). Leviathan's speed-up model assumes a verification costs one step; on a CPU where the
matmuls are compute-bound it costs more, and how much tells which k can pay off. Printed as a
table; nothing is written."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def batch_costs(gguf: Path, sizes: list[int], threads: int = 1, repeats: int = 30) -> tuple[float, dict[int, float]]:
    """Seconds of one one-token step, and each size's forward in units of it."""
    from kibidango.backends.llamacpp_backend import LlamaCppModel

    model = LlamaCppModel(gguf, threads=threads)
    session = model.new_session()
    prefix = 40
    tokens = [10 + i % 400 for i in range(prefix + max(sizes) + 8)]
    session.feed(tokens[:prefix])

    def step() -> float:
        session.crop(prefix)
        t = time.perf_counter()
        for i in range(8):
            session.feed([tokens[prefix + i]])
        return (time.perf_counter() - t) / 8

    def forward(n: int) -> float:
        session.crop(prefix)
        t = time.perf_counter()
        session.feed(tokens[prefix : prefix + n])
        return time.perf_counter() - t

    one = statistics.median(step() for _ in range(repeats))
    return one, {n: statistics.median(forward(n) for _ in range(repeats)) / one for n in sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.llamacpp_batch_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (steps and batches alike)")
    parser.add_argument("--sizes", default="1,2,3,5,8,16,32", help="tokens per forward, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if not args.gguf.is_file() or min(sizes) < 1:
        parser.error(f"--gguf {args.gguf}: no such file" if not args.gguf.is_file() else "--sizes: positive integers")
    one, costs = batch_costs(args.gguf, sizes, args.threads, args.repeats)
    print(f"{args.gguf.name}, {args.threads} thread(s): one-token step {one * 1e3:.2f} ms (median of {args.repeats})")
    print("| tokens per forward | cost in one-token steps | per token |")
    print("|---:|---:|---:|")
    for n, cost in costs.items():
        print(f"| {n} | {cost:.2f} | {cost / n:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
