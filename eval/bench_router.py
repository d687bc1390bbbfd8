"""``make bench-router``: the domain router's latency per query on this machine — features and the
MLP forward, as the runtime runs them (numpy), one query at a time — over the test split of the
stage-0 artifact the newest 6A router was trained from. Prints p50 / p99 / max in milliseconds."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from core.paths import home
from core.store import ArtifactStore


def main() -> int:
    from kibidango.addons.router import Router
    from methods.training.chat import load_split
    from stages.train_router import query_text

    store = ArtifactStore(home() / "store")
    routers = sorted(store.artifacts("6A"), key=lambda p: (p / "manifest.json").stat().st_mtime)
    if not routers:
        print("no stage 6A artifact in the store: run `make stage-6a` first", file=sys.stderr)
        return 1
    artifact = routers[-1]
    data_key = json.loads((artifact / "manifest.json").read_text())["inputs"]["data"]["key"]
    queries = [query_text(r) for r in load_split(store.path("0", data_key) / "dataset", "test")]
    router = Router.load(artifact / "router.json")
    for q in queries[:20]:  # warm-up
        router.route(q)
    times = []
    for q in queries:
        start = time.perf_counter()
        router.route(q)
        times.append((time.perf_counter() - start) * 1000)
    p50, p99 = np.percentile(times, [50, 99])
    print(
        f"router {artifact.name}: {len(queries)} queries, one at a time: p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
        f"max {max(times):.3f} ms (the plan's claim: < 5 ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
