"""Near-duplicate detection quality on planted duplicates.

Take distinct base rows (deduplicated first with the same config, so that no natural duplicate
remains), plant edited copies of some of them, run the deduplicator on the mix and count:
recall = planted copies caught / planted copies; precision = removals whose kept match is of the
same family (the original and its copies) / all removals.

Edits, one kind per copy (each applied with a seeded RNG):
  ``case_space``  random case changes and doubled/stripped whitespace and line breaks;
  ``reorder``     the sentences of the text shuffled;
  ``paraphrase``  ~8% of words replaced by a synonym or a filler word inserted/dropped;
  ``mixed``       all three at once.

    python -m eval.dedup_quality            # on ../shared instruction data
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import re
import shutil
from collections import Counter
from dataclasses import dataclass

from methods.curation.dedup import (
    DedupConfig,
    Duplicate,
    _shingles,
    digest,
    exact_duplicates,
    find_duplicates,
    first_kept_wins,
    lsh_index,
    normalize_for_dedup,
)
from methods.curation.distributed import Cluster
from methods.local_server import redis_server

__all__ = ["EDITS", "PlantedResult", "evaluate_planted", "plant", "rensa_duplicates"]

_SYNONYMS = {
    "big": "large",
    "small": "little",
    "quick": "fast",
    "happy": "glad",
    "begin": "start",
    "use": "utilize",
    "make": "create",
    "show": "display",
    "help": "assist",
    "buy": "purchase",
    "answer": "reply",
    "find": "locate",
    "important": "crucial",
    "many": "numerous",
    "very": "really",
    "good": "great",
    "bad": "poor",
    "get": "obtain",
    "write": "compose",
    "list": "enumerate",
    "give": "provide",
    "need": "require",
    "easy": "simple",
    "idea": "notion",
}
_FILLERS = ["really", "also", "just", "actually", "basically", "simply"]


def _case_space(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    out = []
    for w in words:
        r = rng.random()
        out.append(w.upper() if r < 0.1 else w.lower() if r < 0.3 else w.capitalize() if r < 0.4 else w)
    sep = rng.choice(["  ", " ", " \n"])
    return sep.join(out).strip() + rng.choice(["", "\n", "  "])


def _reorder(rng: random.Random, text: str) -> str:
    sentences = re.split(r"(?<=[.!?])\s+", text)
    if len(sentences) < 2:
        return _paraphrase(rng, text)
    for _ in range(5):
        shuffled = sentences[:]
        rng.shuffle(shuffled)
        if shuffled != sentences:
            return " ".join(shuffled)
    return " ".join(reversed(sentences))


def _paraphrase(rng: random.Random, text: str, rate: float = 0.08) -> str:
    words = text.split(" ")
    n_edits = max(1, round(rate * len(words)))
    for _ in range(n_edits):
        i = rng.randrange(len(words))
        bare = words[i].lower().strip(".,;:!?")
        if bare in _SYNONYMS:
            words[i] = words[i].lower().replace(bare, _SYNONYMS[bare])
        elif rng.random() < 0.5 and len(words) > 3:
            del words[i]
        else:
            words.insert(i, rng.choice(_FILLERS))
    return " ".join(words)


def _mixed(rng: random.Random, text: str) -> str:
    return _case_space(rng, _paraphrase(rng, _reorder(rng, text)))


EDITS = {"case_space": _case_space, "reorder": _reorder, "paraphrase": _paraphrase, "mixed": _mixed}


def plant(base: list[str], n_copies: int, seed: int) -> tuple[list[str], list[int], dict[int, str]]:
    """``base`` plus ``n_copies`` edited copies, shuffled together. Returns the texts, the family
    of each text (the base index it derives from) and the edit kind of each planted copy."""
    rng = random.Random(seed)
    rows = [(t, i, "") for i, t in enumerate(base)]
    kinds = list(EDITS)
    for n in range(n_copies):
        src = rng.randrange(len(base))
        kind = kinds[n % len(kinds)]
        rows.append((EDITS[kind](rng, base[src]), src, kind))
    rng.shuffle(rows)  # a copy may come before its original: then the original is the one dropped
    texts = [t for t, _, _ in rows]
    families = [f for _, f, _ in rows]
    planted = {i: kind for i, (_, _, kind) in enumerate(rows) if kind}
    return texts, families, planted


@dataclass
class PlantedResult:
    base_rows: int
    planted: int
    removed: int
    correct: int
    recall: float
    precision: float
    recall_by_edit: dict[str, float]


def evaluate_planted(
    texts: list[str], cfg: DedupConfig, n_copies: int, seed: int = 0, clean_threshold: float = 0.3, finder=None
) -> PlantedResult:
    """Clean ``texts`` into a base (exact duplicates and near-duplicates at Jaccard >=
    ``clean_threshold`` removed), plant copies, deduplicate with ``cfg`` and score each removal:
    correct when the kept row it matched is of the same family. A match between two different
    base rows (similar at a Jaccard below ``clean_threshold`` but above ``cfg.threshold``) counts
    against precision, so a threshold that is too low shows up here. ``finder(texts, cfg)``: the
    deduplicator under test (default: stage 0's, in this process)."""
    finder = finder or find_duplicates
    clean_cfg = cfg.model_copy(update={"threshold": max(clean_threshold, cfg.threshold)})
    natural = {d.index for d in finder(texts, clean_cfg)}
    base = [t for i, t in enumerate(texts) if i not in natural]
    mixed, families, planted = plant(base, n_copies, seed)
    duplicates = finder(mixed, cfg)
    correct = [d for d in duplicates if families[d.index] == families[d.kept]]
    # Each correct removal takes one member out of a family with a planted copy: credit the
    # family's copies in turn, so recall by edit kind counts every copy at most once.
    credit: Counter[int] = Counter(families[d.index] for d in correct)
    found: Counter[str] = Counter()
    for i, kind in sorted(planted.items()):
        if credit[families[i]] > 0:
            credit[families[i]] -= 1
            found[kind] += 1
    total = Counter(planted.values())
    return PlantedResult(
        base_rows=len(base),
        planted=len(planted),
        removed=len(duplicates),
        correct=len(correct),
        recall=sum(found.values()) / len(planted) if planted else 1.0,
        precision=len(correct) / len(duplicates) if duplicates else 1.0,
        recall_by_edit={k: found[k] / total[k] for k in sorted(total)},
    )


def rensa_duplicates(texts: list[str], cfg: DedupConfig) -> list[Duplicate]:
    """The peer: rensa's Rust MinHash and LSH (``RMinHash``, ``RMinHashLSH``) in stage 0's loop
    (same normalisation, shingles, exact step, banding, threshold and first-kept-wins order), so
    that only the MinHash and index implementations differ."""
    from rensa import RMinHash, RMinHashLSH

    normalized = [normalize_for_dedup(t) for t in texts]
    duplicates = exact_duplicates(map(digest, normalized)) if cfg.exact else []
    dropped = {d.index for d in duplicates}
    if not cfg.near:
        return duplicates
    bands = lsh_index(cfg).b  # stage 0's banding

    def sign(text: str) -> RMinHash:
        sig = RMinHash(cfg.num_perm, cfg.seed)
        sig.update([s.decode() for s in _shingles(text, cfg.shingle, cfg.shingle_size)])
        return sig

    todo = [i for i in range(len(texts)) if i not in dropped]
    lsh = RMinHashLSH(cfg.threshold, cfg.num_perm, bands)
    duplicates += first_kept_wins(todo, (sign(normalized[i]) for i in todo), lsh, cfg.threshold)
    return sorted(duplicates, key=lambda d: d.index)


def main() -> None:
    from eval.shared_data import instruction_texts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4000, help="base rows drawn from ../shared instruction data")
    parser.add_argument("--copies", type=int, default=2000, help="planted near-duplicates")
    parser.add_argument("--threshold", type=float, default=DedupConfig().threshold)
    parser.add_argument("--shingle", choices=["word", "char"], default=DedupConfig().shingle)
    parser.add_argument("--shingle-size", type=int, default=DedupConfig().shingle_size)
    parser.add_argument("--num-perm", type=int, default=DedupConfig().num_perm)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="Dask workers for the cluster run (0: none)")
    args = parser.parse_args()
    cfg = DedupConfig(
        threshold=args.threshold, shingle=args.shingle, shingle_size=args.shingle_size, num_perm=args.num_perm
    )
    texts = instruction_texts()
    rng = random.Random(args.seed)
    texts = rng.sample(texts, min(args.rows, len(texts)))
    print(f"config: {cfg.shingle_size}-{cfg.shingle} shingles, num_perm {cfg.num_perm}, threshold {cfg.threshold}")
    finders = {"stage 0, this process": None, "peer: rensa (Rust MinHash + LSH), same loop": rensa_duplicates}
    with contextlib.ExitStack() as stack:
        if args.workers and shutil.which("redis-server"):  # the same rows on a local Dask cluster + Redis
            url = stack.enter_context(redis_server())
            cluster = Cluster(f"local:{args.workers}", url)
            finders[f"stage 0, Dask {args.workers} workers + Redis"] = functools.partial(
                find_duplicates, cluster=cluster
            )
        for label, finder in finders.items():
            r = evaluate_planted(texts, cfg, args.copies, args.seed, finder=finder)
            print(
                f"{label}: base rows {r.base_rows:,}, planted {r.planted:,}, removed {r.removed:,}, "
                f"correct removals {r.correct:,}"
            )
            print(f"  recall {r.recall:.4f}  precision {r.precision:.4f}")
            print("  recall by edit: " + ", ".join(f"{k} {v:.4f}" for k, v in r.recall_by_edit.items()))


if __name__ == "__main__":
    main()
