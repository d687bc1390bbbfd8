"""Fuzz stage 0's reader with hostile rows: ``python -m eval.fuzz_ingest --seconds 60``.

Each round writes one source file of generated rows (deep nesting, integers past Python's digit
limit, lone surrogate escapes, NULs, invalid UTF-8 and Latin-1 lines, BOMs, truncated gzip,
non-object rows, wrong types, huge strings, mixed with valid rows) in a random container (JSONL,
JSON array, plain text, gzipped or not) and runs it through the reader and stage 0's filters, as
the stage does. A row either becomes an example, a quarantined reject naming its line, or the
whole source is refused with a :class:`SourceError`; anything else is a crash, printed with the
file that caused it (kept under ``--keep``). Bounded by ``--seconds`` and ``--rounds``. The last
round runs the whole stage on every surviving file together."""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from core.contract import KibidangoError

_FORMATS = ("alpaca", "sharegpt", "gsm8k", "text")


def _valid(rng: random.Random, fmt: str, i: int) -> dict:
    words = " ".join(
        rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "sang", "softly", "today"]) for _ in range(12)
    )
    if fmt == "sharegpt":
        return {"conversations": [{"from": "human", "value": f"Row {i}: {words}?"}, {"from": "gpt", "value": words}]}
    if fmt == "gsm8k":
        return {"question": f"What is {i} plus {i}? {words}", "answer": f"#### {2 * i}"}
    if fmt == "text":
        return {"text": f"Story {i}. {words}."}
    return {"instruction": f"Row {i}: {words}", "input": "", "output": words}


def _hostile_line(rng: random.Random, fmt: str, i: int) -> bytes:
    """One line of bytes that a careless reader would crash on."""
    key = {"alpaca": "output", "gsm8k": "answer", "text": "text", "sharegpt": "conversations"}[fmt]
    base = _valid(rng, fmt, i)
    kind = rng.randrange(14)
    if kind == 0:
        depth = rng.choice([1_000, 20_000, 100_000])
        return b"[" * depth + b"]" * depth
    if kind == 1:
        depth = rng.choice([5_000, 100_000])
        return b'{"' + key.encode() + b'": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if kind == 2:
        return (
            json.dumps({**base, "extra": 0})
            .replace('"extra": 0', '"extra": ' + "9" * rng.choice([4_301, 5_000, 50_000]))
            .encode()
        )
    if kind == 3:
        return (
            json.dumps(base)
            .replace(json.dumps(base[key])[1:4] if isinstance(base[key], str) else "human", "\\ud800", 1)
            .encode()
        )
    if kind == 4:
        return json.dumps(
            {**base, key: "a\u0000b" if fmt != "sharegpt" else [{"from": "human", "value": "\u0000"}]}
        ).encode()
    if kind == 5:
        return json.dumps(base).encode()[: rng.randrange(1, 40)]  # truncated row
    if kind == 6:
        return json.dumps(base, ensure_ascii=False).encode("latin-1", "replace") + b"\xe9\xff"  # not UTF-8
    if kind == 7:
        return json.dumps(rng.choice([[1, 2], "str", 3.5, None, True]), ensure_ascii=False).encode()
    if kind == 8:
        return json.dumps({**base, key: rng.choice([123, 1.5, ["x"], {"a": 1}, True])}).encode()
    if kind == 9:
        return json.dumps({**base, key: "x" * rng.choice([100_000, 1_000_000])}).encode()
    if kind == 10:
        return b"\xef\xbb\xbf" + json.dumps(base).encode()  # a BOM in the middle of a file
    if kind == 11:
        return json.dumps({**base, key: "\\udfff\\ud800 lone pair"}).replace("\\\\u", "\\u").encode()
    if kind == 12:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    return json.dumps({**base, key: 1e308 * 10 if rng.random() < 0.5 else float("nan")}).encode()  # Infinity / NaN


def _source_file(rng: random.Random, folder: Path, n: int, fmt: str) -> tuple[Path, int]:
    lines = [
        _hostile_line(rng, fmt, i) if rng.random() < 0.4 else json.dumps(_valid(rng, fmt, i)).encode() for i in range(n)
    ]
    container = rng.choice(["jsonl", "json", "text"] if fmt == "text" else ["jsonl", "json"])
    if container == "json":
        body = b"[\n" + b",\n".join(lines) + b"\n]"
        name = "rows.json"
    elif container == "text":
        body = b"\n\n".join(lines)
        name = "rows.txt"
    else:
        body = b"\n".join(lines)
        name = "rows.jsonl"
    bom = rng.random()
    if bom < 0.15:
        body = b"\xef\xbb\xbf" + body
    elif bom < 0.2:
        body = body.decode("utf-8", "replace").encode("utf-16")  # with its BOM
    elif bom < 0.25:
        body = b"\xff\xfe" + body[:101]  # claims UTF-16, is not
    if rng.random() < 0.3:
        name += ".gz"
        body = gzip.compress(body)
        if rng.random() < 0.3:
            body = body[: max(1, len(body) * 2 // 3)]  # truncated gzip stream
    path = folder / name
    path.write_bytes(body)
    return path, n


def fuzz(seconds: float, rounds: int, seed: int, keep: Path | None = None, rows_per_file: int = 30) -> dict:
    from methods.curation.ingest import SourceError, SourceSpec, read_source
    from stages import curate as s0

    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    crashes: list[str] = []
    started = time.monotonic()
    cfg = s0.Config(sources=[{"name": "fuzz", "path": "unused", "format": "alpaca", "license": "test"}])
    with tempfile.TemporaryDirectory() as tmp:
        survivors: list[dict] = []
        for r in range(rounds):
            if time.monotonic() - started > seconds:
                break
            folder = Path(tmp) / f"round{r:05d}"
            folder.mkdir()
            fmt = rng.choice(_FORMATS)
            path, n = _source_file(rng, folder, rows_per_file, fmt)
            counts["files"] += 1
            counts["rows_tried"] += n
            spec = SourceSpec(name=f"f{r}", path=str(path), format=fmt, license="test", text_split="blank_line")
            try:
                items = list(read_source(spec))
                examples = [i for i in items if not hasattr(i, "reason")]
                counts["examples"] += len(examples)
                counts["quarantined"] += len(items) - len(examples)
                list(
                    s0._filter(
                        cfg, examples, Counter(), Counter(), open(folder / "dropped.jsonl", "w", encoding="utf-8")
                    )
                )
                if examples:
                    survivors.append(spec.model_dump())
            except SourceError:
                counts["sources_refused"] += 1
            except Exception:  # a crash: what the fuzz is for
                crashes.append(f"{path} ({fmt}):\n{traceback.format_exc()}")
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, keep / f"crash-{r:05d}-{path.name}")
        if survivors:  # the whole stage once, on every file that yielded rows
            out = Path(tmp) / "stage0"
            out.mkdir()
            try:
                s0.run(s0.Config(sources=survivors[:50]), {}, out)
                counts["whole_stage_runs"] += 1
            except KibidangoError:
                counts["whole_stage_refused"] += 1
            except Exception:
                crashes.append(f"stage 0 on {len(survivors[:50])} files:\n{traceback.format_exc()}")
    counts["crashes"] = len(crashes)
    return {"counts": dict(counts), "crashes": crashes, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="copy files that crashed the reader here")
    args = parser.parse_args()
    import logging

    import datasets

    logging.basicConfig(level=logging.ERROR)
    datasets.disable_progress_bars()
    result = fuzz(args.seconds, args.rounds, args.seed, args.keep)
    for crash in result["crashes"][:5]:
        print(crash)
    c = result["counts"]
    print(
        f"fuzz_ingest: {c.get('rows_tried', 0):,} rows tried in {c.get('files', 0):,} files ({result['seconds']} s, "
        f"seed {args.seed}): "
        f"{c.get('examples', 0):,} examples, {c.get('quarantined', 0):,} quarantined, {c.get('sources_refused', 0):,} "
        "sources refused "
        f"whole, whole-stage runs {c.get('whole_stage_runs', 0)}; {c['crashes']} crashes"
    )
    if result["crashes"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
