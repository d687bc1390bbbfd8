"""Stage 0's dedup on a Dask cluster of 2 worker processes with the MinHash LSH index in a real
``redis-server`` on 127.0.0.1: the same duplicates, row for row, as the single-process run (on
generated rows with planted copies, on ../shared's instruction data, and through stage 0 itself),
and the index is removed from Redis afterwards."""

from __future__ import annotations

import functools
import random
import shutil

import pytest

from core.contract import KibidangoError
from eval.dedup_quality import evaluate_planted, plant
from methods.curation import distributed
from methods.curation.dedup import DedupConfig, find_duplicates
from methods.curation.distributed import Cluster
from tests.conftest import needs_shared


@pytest.fixture(scope="module")
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (make setup installs it with apt-get; CI runs make setup)")
    from methods.local_server import redis_server

    with redis_server() as url:
        yield url


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(distributed, "SHARD_ROWS", 300)  # several shards per worker, and across them


WORDS = "the a cat dog sun tree ran jumped happy little big red blue girl boy park ball played saw went".split()


def _generated(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))) + "." for _ in range(n)]


def _keys(url: str) -> int:
    import redis

    return redis.Redis.from_url(url).dbsize()


def test_distributed_dedup_equals_the_local_run(redis_url, small_shards):
    texts, _, _ = plant(_generated(900, 0), 400, seed=1)
    texts += texts[:50]  # exact duplicates too
    cfg = DedupConfig()
    local = find_duplicates(texts, cfg)
    assert {d.reason for d in local} == {"exact_duplicate", "near_duplicate"}
    seen = []
    remote = find_duplicates(texts, cfg, seen.append, Cluster("local:2", redis_url))
    assert remote == local  # same rows dropped, same kept representatives, same similarities
    assert seen and seen[-1] == len(texts)
    assert _keys(redis_url) == 0  # the run's index is gone
    for variant in (cfg.model_copy(update={"exact": False}), cfg.model_copy(update={"near": False})):
        assert find_duplicates(texts, variant, cluster=Cluster("local:2", redis_url)) == find_duplicates(texts, variant)


def test_distributed_dedup_quality_on_shared_data_equals_local(redis_url, small_shards):
    needs_shared()
    from eval.shared_data import instruction_texts

    texts = random.Random(0).sample(instruction_texts(), 1500)
    local = evaluate_planted(texts, DedupConfig(), n_copies=600, seed=0)
    on_cluster = functools.partial(find_duplicates, cluster=Cluster("local:2", redis_url))
    remote = evaluate_planted(texts, DedupConfig(), n_copies=600, seed=0, finder=on_cluster)
    assert remote == local and local.recall >= 0.95 and local.precision >= 0.99


def test_stage_0_dedups_on_the_cluster_named_by_the_environment(redis_url, tmp_path, monkeypatch):
    from stages import load_stage

    module = load_stage("0")
    rows = tmp_path / "rows.txt"
    texts, _, _ = plant(_generated(300, 2), 120, seed=3)
    rows.write_text("\n".join(texts) + "\n")
    cfg = module.Config.model_validate(
        {
            "title": "t",
            "sources": [
                {
                    "name": "g",
                    "path": str(rows),
                    "format": "text",
                    "text_split": "single_newline",
                    "domain": "general",
                    "license": "test",
                }
            ],
            "synthetic_rows": 0,
            "language": {"enabled": False},
        }
    )
    outputs = {}
    for mode in ("local", "cluster"):
        if mode == "cluster":
            monkeypatch.setenv("KIBIDANGO_DASK_SCHEDULER", "local:2")
            monkeypatch.setenv("KIBIDANGO_REDIS_URL", redis_url)
        out = tmp_path / mode
        out.mkdir()
        result = module.run(cfg, {}, out)
        outputs[mode] = ((out / "dropped.jsonl").read_text(), result.metrics)
    assert outputs["cluster"] == outputs["local"] and outputs["local"][1]["near_duplicates"] > 0


def test_the_cluster_settings_are_both_or_neither(monkeypatch):
    monkeypatch.delenv("KIBIDANGO_DASK_SCHEDULER", raising=False)
    monkeypatch.delenv("KIBIDANGO_REDIS_URL", raising=False)
    assert Cluster.from_env() is None
    monkeypatch.setenv("KIBIDANGO_REDIS_URL", "redis://:s3cret@127.0.0.1:1/0")
    with pytest.raises(KibidangoError, match="set both or neither"):
        Cluster.from_env()
    monkeypatch.setenv("KIBIDANGO_DASK_SCHEDULER", "local:1")
    cluster = Cluster.from_env()
    assert "s3cret" not in cluster.shown
    with pytest.raises(KibidangoError, match="cannot reach Redis") as err:  # nothing listens on port 1
        find_duplicates(["a b c"], DedupConfig(), cluster=cluster)
    assert "s3cret" not in str(err.value)


def test_the_index_is_datasketchs_own_redis_layout(redis_url):
    """Rows written by the workers' one-round-trip insert are found by datasketch's own
    ``MinHashLSH`` opened on the same Redis basename: the index is datasketch's, readable by any
    datasketch client."""
    from datasketch import MinHash

    from methods.curation.dedup import _shingles, normalize_for_dedup

    texts, _, _ = plant(_generated(200, 4), 80, seed=5)
    cfg = DedupConfig().model_dump()
    distributed._sign(0, texts, cfg, redis_url, b"layout-test")
    try:
        lsh = distributed._lsh(cfg, redis_url, b"layout-test")
        sigs = MinHash.bulk([_shingles(normalize_for_dedup(t), "word", 2) for t in texts], num_perm=128, seed=1)
        assert all(i in lsh for i in range(len(texts))) and lsh.keys.size() == len(texts)
        edges = {(i, j) for i, j, _ in distributed._query(list(range(len(texts))), cfg, redis_url, b"layout-test")}
        for i, sig in enumerate(sigs):
            found = {j for j in lsh.query(sig) if j < i and sig.jaccard(sigs[j]) >= cfg["threshold"]}
            assert found == {j for k, j in edges if k == i}, i
        assert edges  # the planted copies are found
    finally:
        distributed._drop_index(redis_url, b"layout-test")
    assert _keys(redis_url) == 0
