"""Reading sources: every format, and every kind of bad input named in the issue."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from methods.curation.example import Example, Reject
from methods.curation.ingest import SourceError, SourceSpec, read_source, source_digest
from tests.conftest import write_jsonl


def _read(path, fmt="alpaca", **kw):
    items = list(read_source(SourceSpec(name="src", path=str(path), format=fmt, license="MIT", **kw)))
    return [i for i in items if isinstance(i, Example)], [i for i in items if isinstance(i, Reject)]


def test_alpaca_json_array_and_jsonl(tmp_path):
    rows = [
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        {"instruction": "Add", "input": "1 2", "output": "3"},
    ]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    examples, rejects = _read(tmp_path / "a.json")
    assert [(e.instruction, e.input, e.output) for e in examples] == [("Say hi.", "", "Hi!"), ("Add", "1 2", "3")]
    assert examples[0].id == "src-000002" and examples[1].id == "src-000007"  # ids carry the line
    jsonl_examples, _ = _read(write_jsonl(tmp_path / "a.jsonl", rows))
    assert [e.output for e in jsonl_examples] == ["Hi!", "3"]


def test_sharegpt_gsm8k_mbpp_humaneval_and_renamed_fields(tmp_path):
    chat = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    }
    (ex,), _ = _read(write_jsonl(tmp_path / "c.jsonl", [chat]), "sharegpt")
    assert (ex.instruction, ex.output) == ("2+2?", "4") and "human: Hi" in ex.input
    messages = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    (ex,), _ = _read(write_jsonl(tmp_path / "m.jsonl", [messages]), "sharegpt")
    assert (ex.instruction, ex.output) == ("Q", "A")
    (ex,), _ = _read(write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "#### 2"}]), "gsm8k")
    assert (ex.instruction, ex.output) == ("1+1?", "#### 2")
    mbpp = {"text": "Write f.", "code": "def f(): pass", "test_list": ["assert f() is None"]}
    (ex,), _ = _read(write_jsonl(tmp_path / "p.jsonl", [mbpp]), "mbpp")
    assert ex.instruction == "Write f." and "assert f() is None" in ex.input and ex.output == "def f(): pass"
    he = tmp_path / "h.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"prompt": "def g():\n", "canonical_solution": "    return 1\n"}) + "\n")
    (ex,), _ = _read(he, "humaneval")
    assert ex.input == "def g():" and ex.output == "return 1"
    renamed = {"instruction": "I", "response": "R"}
    (ex,), _ = _read(write_jsonl(tmp_path / "r.jsonl", [renamed]), fields={"output": "response"})
    assert ex.output == "R"


@pytest.mark.parametrize(
    "split, expected",
    [
        ("line", ["A1", "A2", "B1", "C1"]),
        ("blank_line", ["A1\nA2", "B1\nC1"]),
        ("single_newline", ["A1\nA2", "B1", "C1"]),
    ],
)
def test_plain_text_splits(tmp_path, split, expected):
    (tmp_path / "t.txt").write_text("A1\nA2\n\nB1\nC1\n")
    if split == "single_newline":  # TinyStories: a story's paragraphs are separated by blank lines
        (tmp_path / "t.txt").write_text("A1\n\nA2\nB1\nC1\n")
        expected = ["A1\n\nA2", "B1", "C1"]
    examples, _ = _read(tmp_path / "t.txt", "text", text_split=split)
    assert [e.output for e in examples] == expected


def test_limit_counts_valid_rows(tmp_path):
    rows = ["{bad", *[{"instruction": f"i{n}", "output": "o"} for n in range(5)]]
    examples, rejects = _read(write_jsonl(tmp_path / "a.jsonl", rows), limit=3)
    assert len(examples) == 3 and len(rejects) == 1


def test_bad_rows_are_quarantined_with_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"instruction": "ok", "output": "fine"}).encode(),
        b'{"instruction": "broken", "output": ',  # malformed JSON
        json.dumps({"instruction": "no output"}).encode(),  # missing field
        json.dumps({"instruction": "typed", "output": 42}).encode(),  # wrong type
        b'{"instruction": "caf\xe9", "output": "latin-1 byte"}',  # not UTF-8
        b"[1, 2]",  # not an object
        json.dumps({"instruction": "also ok", "output": "good"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    examples, rejects = _read(path)
    assert [e.instruction for e in examples] == ["ok", "also ok"]  # one bad row never stops the source
    by_line = {r.line: r for r in rejects}
    assert sorted(by_line) == [2, 3, 4, 5, 6]
    assert by_line[2].reason.startswith("malformed JSON") and by_line[2].file == str(path)
    assert (by_line[3].field, by_line[3].reason) == ("output", "missing")
    assert (by_line[4].field, by_line[4].reason) == ("output", "expected a string, got int")
    assert by_line[5].reason == "invalid UTF-8: byte 0xe9 at column 21"
    assert by_line[6].reason == "expected a JSON object, got list"
    assert by_line[4].message() == f"{path}:4: field 'output' expected a string, got int"


def test_bad_row_in_a_json_array_names_its_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a", "output": null}\n]\n')
    _, (reject,) = _read(path)
    assert (reject.line, reject.field, reject.reason) == (3, "output", "missing")


def test_malformed_json_array_stops_with_its_position(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a" "output": "c"}\n]\n')
    with pytest.raises(SourceError, match=rf"{path}:3: malformed JSON: Expecting ',' delimiter"):
        _read(path)


def test_non_utf8_json_array_names_the_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b'[\n{"instruction": "x", "output": "y"},\n{"instruction": "\xff", "output": "y"}]')
    with pytest.raises(SourceError, match=rf"{path}:3: invalid UTF-8: byte 0xff"):
        _read(path)


def test_empty_and_missing_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    spec = SourceSpec(name="e", path=str(empty), format="alpaca", license="MIT")
    with pytest.raises(SourceError, match=rf"source 'e': {empty} is empty \(0 bytes\)"):
        source_digest(spec)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(SourceError, match=rf"source 'src': {blank} holds no rows"):
        _read(blank)
    missing = SourceSpec(name="m", path=str(tmp_path / "nope.jsonl"), format="alpaca", license="MIT")
    with pytest.raises(SourceError, match=rf"source 'm': file not found: {tmp_path}/nope.jsonl"):
        source_digest(missing)
    optional = missing.model_copy(update={"optional": True})
    assert source_digest(optional) == "absent"


def test_hf_dataset_path_reads_a_local_dataset_dir(tmp_path):
    """The hub path (datasets.load_dataset) exercised on a local dataset directory."""
    d = tmp_path / "my_dataset"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"question": "2*3?", "answer": "#### 6"}, {"question": "1-1?", "answer": 0}])
    spec = SourceSpec(name="hfsrc", hf=str(d), hf_split="train", format="gsm8k", license="MIT")
    items = list(read_source(spec))
    assert isinstance(items[0], Example) and items[0].output == "#### 6" and items[0].id == "hfsrc-000001"
    assert isinstance(items[1], Reject) and (items[1].line, items[1].field) == (2, "answer")
    assert items[1].file == f"hf:{d}[train]"
    digest = source_digest(spec)
    write_jsonl(d / "train.jsonl", [{"question": "2*3?", "answer": "#### 7"}])
    assert source_digest(spec) != digest  # a changed local dataset changes the cache key
    hub = SourceSpec(name="h", hf="org/some-dataset", hf_revision="abc123", format="alpaca", license="MIT")
    assert source_digest(hub) == "hf:org/some-dataset@abc123:None:train"  # no network needed for the key


def test_a_source_needs_exactly_one_location():
    with pytest.raises(ValueError, match="give exactly one of `path`, `hf` or `ladder`"):
        SourceSpec(name="x", format="alpaca", license="MIT")


def test_the_probes_hostile_rows_are_quarantined_with_their_line(tmp_path):
    """A 100k-deep nested line, a 5,000-digit integer, a lone surrogate escape and a NUL each
    stopped stage 0; now each is a reject naming its line (and field), in JSONL and in arrays."""
    good = {"instruction": "Say hi.", "output": "Hi!"}
    hostile = [
        "[" * 100_000 + "]" * 100_000,
        '{"instruction": "Count.", "output": "many", "n": ' + "9" * 5_000 + "}",
        '{"instruction": "Hi \\ud800 there", "output": "x"}',
        '{"instruction": "Nul", "output": "a\\u0000b"}',
    ]
    path = write_jsonl(tmp_path / "h.jsonl", [good, *hostile, good])
    examples, rejects = _read(path)
    assert len(examples) == 2
    assert [(r.line, r.field) for r in rejects] == [(2, ""), (3, ""), (4, "instruction"), (5, "output")]
    assert "nested too deeply" in rejects[0].reason and "unreadable JSON value" in rejects[1].reason
    assert "lone surrogate" in rejects[2].reason and "NUL" in rejects[3].reason
    (tmp_path / "h.json").write_text("[\n" + ",\n".join([json.dumps(good), *hostile, json.dumps(good)]) + "\n]")
    examples, rejects = _read(tmp_path / "h.json")
    assert len(examples) == 2 and [r.line for r in rejects] == [3, 4, 5, 6]


def test_byte_order_marks_are_read(tmp_path):
    rows = [{"instruction": f"Row {i} here.", "output": "Fine."} for i in range(27)]
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())  # the probe's file
    examples, rejects = _read(tmp_path / "bom.json")
    assert len(examples) == 27 and not rejects
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    assert len(_read(tmp_path / "bom.jsonl")[0]) == 27
    (tmp_path / "utf16.json").write_bytes(json.dumps(rows, ensure_ascii=False).encode("utf-16"))
    assert len(_read(tmp_path / "utf16.json")[0]) == 27


def test_a_truncated_gzip_is_a_source_error(tmp_path):
    body = gzip.compress(("\n".join(json.dumps({"instruction": "a", "output": "b"}) for _ in range(500))).encode())
    (tmp_path / "t.jsonl.gz").write_bytes(body[: len(body) // 2])
    with pytest.raises(SourceError, match="t.jsonl.gz: cannot read"):
        _read(tmp_path / "t.jsonl.gz")


def test_fuzzing_the_reader_with_hostile_rows_crashes_nothing():
    from eval.fuzz_ingest import fuzz

    result = fuzz(seconds=20, rounds=400, seed=1)
    assert result["counts"]["rows_tried"] >= 1_000 and result["counts"]["quarantined"] > 0
    assert result["crashes"] == [], result["crashes"][0]


def test_a_small_gzip_of_newlines_is_read_a_chunk_at_a_time(tmp_path):
    """41 KB of gzip holding 41 MB of newlines cost ~400 MB of memory when the file was split whole;
    it is read a MiB at a time (and holds no rows)."""
    import subprocess
    import sys

    path = tmp_path / "newlines.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(40):
            f.write(b"\n" * (1 << 20))
        f.write(json.dumps({"instruction": "last", "output": "row"}).encode() + b"\n")
    assert path.stat().st_size < 64_000
    probe = (
        "import resource, sys\n"
        "from methods.curation.ingest import SourceSpec, records\n"
        "spec = SourceSpec(name='n', path=sys.argv[1], format='alpaca', license='-')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rows = [r for _, r in records(spec)]\n"
        "print(len(rows), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, cwd=repo)
    rows, grown_mb = map(int, done.stdout.split())
    assert rows == 1 and grown_mb < 64, (done.stdout, done.stderr[-500:])
