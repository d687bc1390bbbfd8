"""Stage 0's deduplication on a Dask cluster, with the MinHash LSH index in Redis.

Why Dask (not Ray): the work is a map over shards of rows plus one sequential pass, which
``dask.distributed`` does with a pip-installable scheduler and workers that also run in-process
(``LocalCluster``) for tests and laptops. Ray would bring its own object store and cluster
manager for no gain here.

The result is the single-process one, row for row (:func:`methods.curation.dedup.find_duplicates`
keeps a row unless it matches a row **kept** before it). Three steps:

1. **Sign** (workers, shard by shard): normalise, sha256, shingle and MinHash each row with the
   same parameters as the local run; insert every signature into one datasketch ``MinHashLSH``
   whose storage is Redis (datasketch's own Redis layout, written one row per round trip by a Lua
   script; any datasketch client opens the index by its basename) and store the signature itself
   under ``<basename>:sig:<row>``.
2. **Query** (workers, after every shard is signed): each row's LSH candidates from the complete
   index (one SUNION of its bands' buckets, pipelined per shard), kept when they come earlier in the input and
   their estimated Jaccard reaches the threshold. Band collisions are a property of a pair, not of
   what else is in the index, so these are exactly the candidates the local run sees, before it
   knows which earlier rows it kept.
3. **Resolve** (the driver, in input order): exact duplicates by first occurrence of the sha256;
   then a row is a near duplicate of its most similar earlier **kept** candidate (ties: the later
   row, as ``max`` over (similarity, row) in the local run), else kept.

Workers must import this package (``pip install -e .`` on every machine) and reach Redis. The
index lives under a fresh basename per run and is deleted afterwards.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.contract import KibidangoError

__all__ = ["Cluster", "distributed_duplicates"]

SHARD_ROWS = 4000
"""Rows per task: large enough that a task's Redis round trips and scheduling are a small share of
its MinHash work, small enough that 2 workers stay busy on a few thousand rows."""


@dataclass(frozen=True)
class Cluster:
    """Where to run: ``scheduler`` is a Dask scheduler address (``tcp://host:8786``) or
    ``local:N`` (a ``LocalCluster`` of N worker processes started here); ``redis_url`` the Redis
    that holds the shared index (``redis://host:6379/0``; a password in it is never printed)."""

    scheduler: str
    redis_url: str = field(repr=False)  # may hold a password

    @classmethod
    def from_env(cls) -> Cluster | None:
        """``KIBIDANGO_DASK_SCHEDULER`` and ``KIBIDANGO_REDIS_URL``; None (the local run) when
        neither is set."""
        scheduler, redis_url = os.environ.get("KIBIDANGO_DASK_SCHEDULER"), os.environ.get("KIBIDANGO_REDIS_URL")
        if not scheduler and not redis_url:
            return None
        if not (scheduler and redis_url):
            raise KibidangoError(
                "distributed dedup needs both KIBIDANGO_DASK_SCHEDULER (a Dask scheduler address, or local:N) "
                "and KIBIDANGO_REDIS_URL (the Redis that holds the LSH index); set both or neither"
            )
        return cls(scheduler, redis_url)

    def duplicates(self, texts: Sequence[str], cfg, progress: Callable[[int], None] | None = None) -> list:
        """:func:`distributed_duplicates` on this cluster (what ``find_duplicates(..., cluster=)`` calls)."""
        return distributed_duplicates(texts, cfg, self, progress)

    @property
    def shown(self) -> str:
        from redis.connection import parse_url

        p = parse_url(self.redis_url)
        return f"Dask {self.scheduler}, Redis {p.get('host', 'localhost')}:{p.get('port', 6379)}/{p.get('db', 0)}"

    @contextmanager
    def client(self) -> Iterator:
        """A Dask client; for ``local:N`` the local cluster lives as long as the context."""
        from dask.distributed import Client, LocalCluster

        if not self.scheduler.startswith("local:"):
            with Client(self.scheduler, timeout="60s") as client:
                yield client
            return
        try:
            workers = int(self.scheduler.split(":", 1)[1])
        except ValueError:
            raise KibidangoError(
                f"KIBIDANGO_DASK_SCHEDULER={self.scheduler!r}: local:N needs a number of workers"
            ) from None
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
            with Client(cluster) as client:
                yield client


def _redis_params(url: str) -> dict[str, Any]:
    from redis.connection import parse_url

    p = parse_url(url)
    return {k: v for k, v in p.items() if k in ("host", "port", "db", "username", "password", "path")}


def _lsh(cfg: dict, redis_url: str, basename: bytes):
    from methods.curation.dedup import DedupConfig, lsh_index

    storage = {"type": "redis", "basename": basename, "redis": _redis_params(redis_url)}
    return lsh_index(DedupConfig.model_validate(cfg), storage)  # the local run's banding


# One row into datasketch's Redis layout in one round trip. datasketch's own insertion session
# writes the same keys with 2 + 2 * bands commands per row (66 at 32 bands), and redis-py's
# per-command cost made that 8x slower than the whole local dedup: the same writes, server-side.
#   keys storage  <basename>_keys: HSET key -> <basename>_keys<key>; RPUSH that list with the bands' H
#   band table b  <table b>: HSET H -> <table b><H>; SADD <table b><H> key
_INSERT = """
local kname, key, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local hs = {}
for b = 0, n - 1 do
  local table, h = ARGV[4 + 2 * b], ARGV[5 + 2 * b]
  redis.call('HSET', table, h, table .. h)
  redis.call('SADD', table .. h, key)
  hs[#hs + 1] = h
end
redis.call('HSET', kname, key, kname .. key)
redis.call('RPUSH', kname .. key, unpack(hs))
return n
"""


def _bands(lsh, hashvalues) -> list[bytes]:
    return [lsh._H(hashvalues[lo:hi]) for lo, hi in lsh.hashranges]


def _sign(start: int, texts: list[str], cfg: dict, redis_url: str, basename: bytes) -> list[bytes]:
    """Step 1 on a worker: the rows' sha256 digests; their signatures into the shared index."""
    import redis
    from datasketch import MinHash

    from methods.curation.dedup import _shingles, digest, normalize_for_dedup

    normalized = [normalize_for_dedup(t) for t in texts]
    digests = [digest(t) for t in normalized]
    if not cfg["near"]:
        return digests
    sigs = MinHash.bulk(
        [_shingles(t, cfg["shingle"], cfg["shingle_size"]) for t in normalized],
        num_perm=cfg["num_perm"],
        seed=cfg["seed"],
    )
    lsh = _lsh(cfg, redis_url, basename)
    tables = [t._name for t in lsh.hashtables]
    r = redis.Redis(**_redis_params(redis_url))
    insert = r.register_script(_INSERT)
    pipe = r.pipeline(transaction=False)
    for k, sig in enumerate(sigs):
        args = [lsh.keys._name, pickle.dumps(start + k), len(tables)]
        for table, h in zip(tables, _bands(lsh, sig.hashvalues), strict=True):
            args += [table, h]
        insert(args=args, client=pipe)
    pipe.mset({basename + b":sig:%d" % (start + k): sig.hashvalues.tobytes() for k, sig in enumerate(sigs)})
    pipe.execute()
    return digests


def _query(rows: list[int], cfg: dict, redis_url: str, basename: bytes) -> list[tuple[int, int, float]]:
    """Step 2 on a worker: (row, earlier row, similarity) for every earlier LSH candidate at or
    above the threshold. A row's candidates are the union of its bands' buckets: one SUNION per row
    over datasketch's bucket keys (what ``MinHashLSH.query`` reads with one command per band)."""
    import redis
    from datasketch import MinHash

    r = redis.Redis(**_redis_params(redis_url))
    dtype = MinHash(num_perm=cfg["num_perm"], seed=cfg["seed"]).hashvalues.dtype  # what MinHash.bulk signed with

    def signatures(ids: Sequence[int]) -> dict[int, np.ndarray]:
        raw = r.mget([basename + b":sig:%d" % i for i in ids]) if ids else []
        return {i: np.frombuffer(b, dtype=dtype) for i, b in zip(ids, raw, strict=True)}

    mine = signatures(rows)
    lsh = _lsh(cfg, redis_url, basename)
    tables = [t._name for t in lsh.hashtables]
    pipe = r.pipeline(transaction=False)
    for i in rows:
        pipe.sunion([table + h for table, h in zip(tables, _bands(lsh, mine[i]), strict=True)])
    candidates = {
        i: {j for j in map(pickle.loads, keys) if j < i} for i, keys in zip(rows, pipe.execute(), strict=True)
    }
    sigs = {**signatures(sorted(set().union(*candidates.values()) - set(mine))), **mine}
    edges = []
    for i in rows:
        for j in candidates[i]:
            # MinHash.jaccard's estimate, computed the same way
            sim = float(np.count_nonzero(sigs[i] == sigs[j])) / float(len(sigs[i]))
            if sim >= cfg["threshold"]:
                edges.append((i, j, sim))
    return edges


def _drop_index(redis_url: str, basename: bytes) -> None:
    import redis

    r = redis.Redis(**_redis_params(redis_url))
    batch = []
    for key in r.scan_iter(match=basename + b"*", count=10_000):
        batch.append(key)
        if len(batch) >= 10_000:
            r.unlink(*batch)
            batch.clear()
    if batch:
        r.unlink(*batch)


def distributed_duplicates(
    texts: Sequence[str], cfg, cluster: Cluster, progress: Callable[[int], None] | None = None
) -> list:
    """:func:`methods.curation.dedup.find_duplicates` on ``cluster``: the same duplicates.
    ``progress`` gets a count of rows out of ``len(texts)`` (signing is the first half)."""
    import redis

    try:
        redis.Redis(**_redis_params(cluster.redis_url), socket_connect_timeout=10).ping()
    except redis.RedisError as e:
        raise KibidangoError(f"distributed dedup: cannot reach Redis ({cluster.shown}): {type(e).__name__}") from None
    basename = b"kibidango-dedup-" + uuid.uuid4().hex.encode()
    with cluster.client() as client:
        try:
            return _run(
                client, texts, cfg, (cfg.model_dump(), cluster.redis_url, basename), progress or (lambda n: None)
            )
        finally:
            _drop_index(cluster.redis_url, basename)


def _run(client, texts: Sequence[str], cfg, shared: tuple, progress: Callable[[int], None]) -> list:
    from dask.distributed import as_completed

    from methods.curation.dedup import Duplicate, exact_duplicates

    starts = list(range(0, len(texts), SHARD_ROWS))
    signing = {client.submit(_sign, s, list(texts[s : s + SHARD_ROWS]), *shared, pure=False): s for s in starts}
    digests: dict[int, list[bytes]] = {}
    for future in as_completed(signing):
        digests[signing[future]] = future.result()
        progress(sum(map(len, digests.values())) // 2)
    duplicates = exact_duplicates(h for s in starts for h in digests[s]) if cfg.exact else []
    if not cfg.near:
        return duplicates
    dropped = {d.index for d in duplicates}
    todo = [i for i in range(len(texts)) if i not in dropped]
    shards = [todo[s : s + SHARD_ROWS] for s in range(0, len(todo), SHARD_ROWS)]
    querying = [client.submit(_query, rows, *shared, pure=False) for rows in shards]
    edges: dict[int, list[tuple[float, int]]] = {}
    for n, future in enumerate(querying, 1):
        for i, j, sim in future.result():
            edges.setdefault(i, []).append((sim, j))
        progress(len(texts) // 2 + n * len(texts) // (2 * len(shards)))
    kept: set[int] = set()
    for i in todo:  # in input order, as the local run inserts and queries
        match = max(((sim, j) for sim, j in edges.get(i, ()) if j in kept), default=None)
        if match is not None:
            duplicates.append(Duplicate(i, match[1], "near_duplicate", match[0]))
        else:
            kept.add(i)
    return sorted(duplicates, key=lambda d: d.index)
