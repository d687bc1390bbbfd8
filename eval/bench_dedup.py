"""Deduplication throughput on the full ../shared instruction data (every instruction file,
no limits), in rows per second, for each step of stage 0's deduplication.

    python -m eval.bench_dedup        (make bench-dedup)

Figures are wall-clock on this machine, measured in one process; compare them side by side,
not across machines.
"""

from __future__ import annotations

import argparse
import time

from eval.shared_data import SHARED, instruction_examples, shared_available
from methods.curation.dedup import DedupConfig, find_duplicates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; the median is reported")
    args = parser.parse_args()
    if not shared_available():
        raise SystemExit(f"bench-dedup needs the shared data at {SHARED}/data (set KIBIDANGO_SHARED)")
    t0 = time.perf_counter()
    texts = [ex.text for ex in instruction_examples()]
    print(f"rows: {len(texts):,} from {SHARED / 'data'} (read in {time.perf_counter() - t0:.1f}s)")
    default = DedupConfig()
    for label, cfg in [
        ("exact only", default.model_copy(update={"near": False})),
        (f"exact + MinHash LSH ({default.shingle_size}-{default.shingle}, {default.num_perm} perm)", default),
        ("exact + MinHash LSH (256 perm)", default.model_copy(update={"num_perm": 256})),
    ]:
        times, found = [], 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            found = len(find_duplicates(texts, cfg))
            times.append(time.perf_counter() - t)
        median = sorted(times)[len(times) // 2]
        print(f"{label:<45} {len(texts) / median:>10,.0f} rows/s   ({found:,} duplicates, median of {args.repeat})")


if __name__ == "__main__":
    main()
