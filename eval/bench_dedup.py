"""Deduplication throughput on the full ../shared instruction data (every instruction file,
no limits), in rows per second, for each step of stage 0's deduplication: in this process, beside
a peer (rensa's Rust MinHash and LSH in the same loop), and on a local Dask cluster of 1 and 2
worker processes with the LSH index in a redis-server started on 127.0.0.1 (or
``KIBIDANGO_REDIS_URL``), checked identical to this process's result.

    python -m eval.bench_dedup        (make bench-dedup)

Figures are wall-clock on this machine, measured in one process; compare them side by side,
not across machines.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import time

from eval.dedup_quality import rensa_duplicates
from eval.shared_data import SHARED, instruction_examples, shared_available
from methods.curation.dedup import DedupConfig, find_duplicates
from methods.curation.distributed import Cluster
from methods.local_server import redis_server


def _timed(label: str, texts: list[str], cfg: DedupConfig, finder, repeat: int) -> list:
    times, found = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        found = finder(texts, cfg)
        times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]
    print(f"{label:<58} {len(texts) / median:>10,.0f} rows/s   ({len(found):,} duplicates, median of {repeat})")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; the median is reported")
    parser.add_argument("--workers", default="1,2", help="Dask worker processes to measure (empty: none)")
    args = parser.parse_args()
    if not shared_available():
        raise SystemExit(f"bench-dedup needs the shared data at {SHARED}/data (set KIBIDANGO_SHARED)")
    t0 = time.perf_counter()
    texts = [ex.text for ex in instruction_examples()]
    print(f"rows: {len(texts):,} from {SHARED / 'data'} (read in {time.perf_counter() - t0:.1f}s)")
    default = DedupConfig()
    near = f"exact + MinHash LSH ({default.shingle_size}-{default.shingle}, {default.num_perm} perm)"
    _timed("exact only", texts, default.model_copy(update={"near": False}), find_duplicates, args.repeat)
    local = _timed(f"{near}, this process", texts, default, find_duplicates, args.repeat)
    _timed(
        "exact + MinHash LSH (256 perm), this process",
        texts,
        default.model_copy(update={"num_perm": 256}),
        find_duplicates,
        args.repeat,
    )
    _timed("  peer: rensa (Rust MinHash + LSH) in the same loop", texts, default, rensa_duplicates, args.repeat)
    workers = [int(w) for w in args.workers.split(",") if w]
    if not workers:
        return
    if shutil.which("redis-server") is None and not os.environ.get("KIBIDANGO_REDIS_URL"):
        print("Dask + Redis: skipped (no redis-server on PATH and no KIBIDANGO_REDIS_URL)")
        return
    from dask.distributed import LocalCluster

    with contextlib.ExitStack() as stack:
        url = os.environ.get("KIBIDANGO_REDIS_URL") or stack.enter_context(redis_server())
        for n in workers:  # the cluster started outside the timing: rows/s of the work itself
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as lc:
                on = functools.partial(find_duplicates, cluster=Cluster(lc.scheduler_address, url))
                found = _timed(f"{near}, Dask {n} worker(s) + Redis", texts, default, on, args.repeat)
                same = "identical to this process's" if found == local else "DIFFERENT from this process's"
                print(f"{'':<58} {same} duplicates")


if __name__ == "__main__":
    main()
