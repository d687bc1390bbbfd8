"""Read instruction data from local files and Hugging Face datasets into :class:`Example` rows.

Containers: JSON arrays, JSONL (a ``.json`` file whose first character is not ``[`` is read as
JSONL), plain text, each optionally gzipped; or ``datasets.load_dataset(hf, ...)``, which takes a
hub id or a local dataset directory through the same code path.

Formats (the fields each reads; ``fields`` in the source spec renames them):
``alpaca`` instruction/input/output, ``sharegpt`` conversations[{from,value}] or
messages[{role,content}], ``gsm8k`` question/answer, ``mbpp`` text or prompt/code/test_list,
``humaneval`` prompt/canonical_solution, ``text`` text.

A row that cannot be read (malformed JSON, JSON nested too deep for the parser, an integer too
long to convert, a missing field, a wrong type, bytes that are not UTF-8, a lone surrogate escape
such as ``\\ud800``, a NUL character) becomes a :class:`Reject` naming file, line and field; the rest
of the file is still read. A byte-order mark (UTF-8, UTF-16) is honoured. A source that cannot be
read at all (missing, empty, not JSON, a truncated gzip stream) raises :class:`SourceError`.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.contract import KibidangoError
from core.hashing import file_sha256, tree_sha256
from methods.curation.example import Example, Reject, normalize_text
from methods.curation.split import part, task_id
from methods.ladder import LadderSource

__all__ = ["FieldError", "SourceError", "SourceSpec", "parse_record", "read_source", "records", "source_digest"]

Format = Literal["alpaca", "sharegpt", "gsm8k", "mbpp", "humaneval", "text", "ladder"]
_RAW_CHARS = 300  # how much of a rejected row the rejects file keeps


class SourceError(KibidangoError):
    """A whole source cannot be read."""


class FieldError(Exception):
    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


class SourceSpec(BaseModel):
    """One data source of stage 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        description="Short name; prefixes row ids and labels the data card.", pattern=r"^[A-Za-z0-9_.-]+$"
    )
    path: str | None = Field(
        None, description="Local file (.json, .jsonl, .txt, optionally .gz). Relative to the working directory."
    )
    hf: str | None = Field(
        None, description="Hugging Face dataset id, or a local dataset directory, for datasets.load_dataset."
    )
    hf_config: str | None = Field(None, description="Dataset configuration name (load_dataset's `name`).")
    hf_split: str = Field("train", description="Split to read from the HF dataset.")
    hf_revision: str | None = Field(None, description="Hub revision; pin it, or the cache cannot see upstream changes.")
    ladder: LadderSource | None = Field(
        None,
        description="Generated rows of the task ladder (format `ladder`): the train part of one domain's levels up "
        "to a cut-off (methods/ladder).",
    )
    format: Format = Field(description="Record layout; see the module docstring for the fields each reads.")
    fields: dict[str, str] = Field(
        default_factory=dict, description="Renames: our field name -> the source's field name."
    )
    domain: Literal["auto", "general", "code", "math"] = Field(
        "auto", description="Domain of every row, or `auto` to infer it per row."
    )
    license: str = Field(description="Licence of the source, copied into the data card.")
    limit: int | None = Field(None, ge=1, description="Read at most this many valid rows (in file order).")
    text_split: Literal["line", "blank_line", "single_newline"] = Field(
        "blank_line",
        description="Plain-text files: one document per non-empty line, per blank-line-separated block, or "
        "`single_newline` (documents end at a single newline; a blank line is a paragraph break inside one).",
    )
    optional: bool = Field(False, description="Skip the source with a warning when its file is absent.")
    benchmark: Literal["gsm8k", "mbpp", "humaneval"] | None = Field(
        None,
        description="This file is that benchmark's task file: rows of its evaluation part (methods/benchmarks.py) "
        "are held out, never read into the dataset; only its mining part is curated.",
    )

    @model_validator(mode="after")
    def _one_location(self) -> SourceSpec:
        if sum(x is not None for x in (self.path, self.hf, self.ladder)) != 1:
            raise ValueError(f"source '{self.name}': give exactly one of `path`, `hf` or `ladder`")
        if (self.ladder is not None) != (self.format == "ladder"):
            raise ValueError(f"source '{self.name}': format `ladder` and a `ladder` section go together")
        if self.ladder is not None and self.domain != self.ladder.domain:
            raise ValueError(f"source '{self.name}': `domain` must be the ladder's, {self.ladder.domain}")
        return self

    @property
    def location(self) -> str:
        if self.ladder is not None:
            return f"ladder:{self.ladder.domain}"
        return self.path if self.path is not None else f"hf:{self.hf}[{self.hf_split}]"

    def is_present(self) -> bool:
        if self.ladder is not None:
            return True
        if self.path is not None:
            return Path(self.path).is_file()
        return not _looks_local(self.hf) or Path(self.hf).is_dir()


def _looks_local(hf: str) -> bool:
    return hf.startswith((".", "/", "~")) or Path(hf).exists()


def source_digest(spec: SourceSpec) -> str:
    """What the cache key sees of a source: its bytes (local files and directories), its hub
    id and revision, or a ladder's settings (the generator is code: the stage's code version sees
    it). Raises SourceError for a required source that is missing or empty."""
    if spec.ladder is not None:
        return "ladder:" + spec.ladder.model_dump_json()
    if not spec.is_present():
        if spec.optional:
            return "absent"
        raise SourceError(f"source '{spec.name}': file not found: {spec.path or spec.hf}")
    if spec.path is not None:
        path = Path(spec.path)
        if path.stat().st_size == 0:
            raise SourceError(f"source '{spec.name}': {path} is empty (0 bytes)")
        return file_sha256(path)
    if _looks_local(spec.hf):
        return tree_sha256(Path(spec.hf))
    return f"hf:{spec.hf}@{spec.hf_revision or 'main'}:{spec.hf_config}:{spec.hf_split}"


def read_source(spec: SourceSpec, held_out: list[str] | None = None) -> Iterator[Example | Reject]:
    """Every row of the source as an Example (domain may still be `auto`) or a Reject. A benchmark
    source's evaluation rows are skipped; their task ids are appended to ``held_out``. A ladder
    source yields its train part only (its mining and evaluation parts are never generated here)."""
    if spec.ladder is not None:
        for n, t in enumerate(spec.ladder.rows(), start=1):
            yield Example(t.id, spec.name, spec.domain, *map(normalize_text, (t.instruction, t.input, t.output)))
            if spec.limit is not None and n >= spec.limit:
                return
        return
    n_valid = n_seen = 0
    for line, record in records(spec):
        n_seen += 1
        if isinstance(record, Reject):
            yield record
            continue
        if spec.benchmark is not None:
            tid = task_id(spec.benchmark, record, line, spec.location)
            if part(spec.benchmark, tid) == "evaluation":
                if held_out is not None:
                    held_out.append(tid)
                continue
        try:
            instruction, input_, output = parse_record(spec.format, record, spec.fields)
        except FieldError as e:
            yield Reject(spec.name, spec.location, line, e.field, e.reason, _raw(record))
            continue
        yield Example(
            id=f"{spec.name}-{line:06d}",
            source=spec.name,
            domain=spec.domain,
            instruction=normalize_text(instruction),
            input=normalize_text(input_),
            output=normalize_text(output),
        )
        n_valid += 1
        if spec.limit is not None and n_valid >= spec.limit:
            return
    if n_seen == 0:
        raise SourceError(f"source '{spec.name}': {spec.location} holds no rows")


# ---- containers: yield (line or row number, record dict | Reject) ---------------------------


def records(spec: SourceSpec) -> Iterator[tuple[int, dict | Reject]]:
    """Every record of the source's container (JSON array, JSONL, text, HF dataset) with its line
    or row number, or a Reject for one that cannot be read (before any format's fields are read)."""
    if spec.hf is not None:
        yield from _hf_records(spec)
        return
    path = Path(spec.path)
    head = _head(path)
    stem = path.name[:-3] if path.name.endswith(".gz") else path.name
    if spec.format == "text" and not stem.endswith((".json", ".jsonl")):
        yield from _text_records(spec, _lines(path, head))
    elif stem.endswith(".json") and _first_char(head) == "[":
        yield from _json_array_records(spec, _read_bytes(path))
    else:
        yield from _jsonl_records(spec, _lines(path, head))


_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_CHUNK = 1 << 20
_MAX_LINE = 64 << 20  # a JSONL row or text line longer than this is refused, not held
_MAX_WHOLE = 1 << 30  # a file read whole (a JSON array, UTF-16) may be at most this, decompressed


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _head(path: Path) -> bytes:
    """The first bytes of the file, decompressed (its byte-order mark, its first character)."""
    try:
        with _open(path) as f:
            return f.read(4096)
    except (OSError, EOFError, zlib.error) as e:
        raise SourceError(f"{path}: cannot read: {e}") from e


def _first_char(head: bytes) -> str:
    """The first character that is not white space, whatever the byte-order mark says."""
    bare = {codecs.BOM_UTF8: "utf-8", codecs.BOM_UTF16_LE: "utf-16-le", codecs.BOM_UTF16_BE: "utf-16-be"}
    for bom, encoding in bare.items():
        if head.startswith(bom):
            return head[len(bom) :].decode(encoding, "ignore").lstrip()[:1]
    return head.decode("utf-8", "ignore").lstrip()[:1]


def _strip_bom(data: bytes) -> bytes:
    return data[len(codecs.BOM_UTF8) :] if data.startswith(codecs.BOM_UTF8) else data


def _lines(path: Path, head: bytes) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every line, read a MiB at a time: a 41 KB gzip of newlines (41 MB
    of empty lines) costs a MiB, not the 400 MB of splitting it whole. A UTF-16 file (its BOM) is
    re-encoded whole, within :data:`_MAX_WHOLE`; a line past :data:`_MAX_LINE` is refused."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        yield from enumerate(_read_bytes(path).split(b"\n"), start=1)
        return
    line_no, rest, first = 0, b"", True
    try:
        with _open(path) as f:
            while chunk := f.read(_CHUNK):
                if first:
                    chunk, first = _strip_bom(chunk), False
                *whole, rest = (rest + chunk).split(b"\n")
                for raw in whole:
                    line_no += 1
                    yield line_no, raw
                if len(rest) > _MAX_LINE:
                    raise SourceError(f"{path}:{line_no + 1}: a line of more than {_MAX_LINE:,} bytes")
    except (OSError, EOFError, zlib.error) as e:
        raise SourceError(f"{path}: cannot read: {e}") from e
    yield line_no + 1, rest


def _read_bytes(path: Path) -> bytes:
    """The file's bytes as UTF-8: gunzipped (at most :data:`_MAX_WHOLE`), a UTF-8 byte-order mark
    dropped, UTF-16 (with its BOM) re-encoded."""
    try:
        with _open(path) as f:
            data = f.read(_MAX_WHOLE + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise SourceError(f"{path}: cannot read: {e}") from e
    if len(data) > _MAX_WHOLE:
        raise SourceError(
            f"{path}: more than {_MAX_WHOLE:,} bytes to read whole (write it as JSONL: read a line at a time)"
        )
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            if encoding == "utf-8":
                return data[len(bom) :]
            try:
                return data.decode(encoding).encode("utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise SourceError(
                    f"{path}: starts with a UTF-16 byte-order mark but is not UTF-16 (byte {e.start})"
                ) from e
    return data


_UNREADABLE = (json.JSONDecodeError, ValueError, RecursionError)
"""What ``json.loads`` raises on hostile input: malformed JSON, integers past Python's digit limit
(ValueError), nesting past the recursion limit (RecursionError)."""


def _why(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"malformed JSON: {e.msg} at column {e.colno}"
    if isinstance(e, RecursionError):
        return "JSON nested too deeply to read"
    return f"unreadable JSON value: {str(e)[:120]}"


def _jsonl_records(spec: SourceSpec, lines: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, dict | Reject]]:
    for line_no, raw in lines:
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield line_no, _not_utf8(spec, line_no, "", raw, e)
            continue
        try:
            record = json.loads(text)
        except _UNREADABLE as e:
            yield line_no, Reject(spec.name, spec.path, line_no, "", _why(e), text[:_RAW_CHARS])
            continue
        if not isinstance(record, dict):
            reason = f"expected a JSON object, got {type(record).__name__}"
            yield line_no, Reject(spec.name, spec.path, line_no, "", reason, text[:_RAW_CHARS])
            continue
        yield line_no, record


def _not_utf8(spec: SourceSpec, line_no: int, field: str, raw: bytes, e: UnicodeDecodeError) -> Reject:
    reason = f"invalid UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
    return Reject(spec.name, spec.path, line_no, field, reason, raw[:_RAW_CHARS].decode("utf-8", "replace"))


def _decode_whole(spec: SourceSpec, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SourceError(f"{spec.path}:{line}: invalid UTF-8: byte 0x{data[e.start]:02x}") from e


def _json_array_records(spec: SourceSpec, data: bytes) -> Iterator[tuple[int, dict | Reject]]:
    """Walk a JSON array element by element so each row knows the line it starts on. Malformed
    JSON cannot be resynchronised inside an array, so it stops the source with its position."""
    text = _decode_whole(spec, data)
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line, counted = 1, 0  # line number of `counted`, advanced incrementally (not O(n^2))
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == "]":
            return
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise SourceError(f"{spec.path}:{e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from e
        except (ValueError, RecursionError) as e:  # well-formed but unreadable: skip the element
            end = _element_end(text, pos)
            if end is None:
                raise SourceError(f"{spec.path}:{line}: {_why(e)}, and the array cannot be read past it") from e
            yield line, Reject(spec.name, spec.path, line, "", _why(e), text[pos : min(end, pos + _RAW_CHARS)])
            pos = end
            record = None
        if record is None:
            pass
        elif isinstance(record, dict):
            yield line, record
        else:
            yield (
                line,
                Reject(
                    spec.name, spec.path, line, "", f"expected a JSON object, got {type(record).__name__}", _raw(record)
                ),
            )
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            line += text.count("\n", counted, pos)
            raise SourceError(f"{spec.path}:{line}: malformed JSON: expected ',' or ']' after an array element")


def _element_end(text: str, pos: int) -> int | None:
    """The end of the JSON value starting at ``pos`` (bracket depth counted iteratively, strings
    skipped), or None if the text ends first."""
    depth, i, n = 0, pos, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else i
        elif depth == 0 and c in ",":
            return i
        i += 1
    return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _text_records(spec: SourceSpec, lines: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, dict | Reject]]:
    doc: list[str] = []
    start = 0
    previous_blank = True
    for line_no, raw in lines:
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            yield line_no, _not_utf8(spec, line_no, "text", raw, e)
            continue
        blank = not line.strip()
        ends_doc = {
            "line": True,
            "blank_line": blank,
            "single_newline": not blank and not previous_blank,
        }[spec.text_split]
        if ends_doc and doc:
            yield start, {"text": "\n".join(doc)}
            doc = []
        if not blank or (doc and spec.text_split == "single_newline"):
            if not doc:
                start = line_no
            doc.append(line)
        previous_blank = blank
    if doc:
        yield start, {"text": "\n".join(doc)}


def _hf_records(spec: SourceSpec) -> Iterator[tuple[int, dict | Reject]]:
    import datasets  # heavy import, only for HF sources

    try:
        ds = datasets.load_dataset(spec.hf, name=spec.hf_config, split=spec.hf_split, revision=spec.hf_revision)
    except Exception as e:  # the hub raises many types; the user needs the id and the cause
        raise SourceError(
            f"source '{spec.name}': cannot load HF dataset {spec.hf!r} split {spec.hf_split!r}: {e}"
        ) from e
    yield from enumerate(ds, start=1)


# ---- formats: record dict -> (instruction, input, output) ------------------------------------


def parse_record(fmt: str, rec: dict, fields: dict[str, str]) -> tuple[str, str, str]:
    """(instruction, input, output) of a record in layout ``fmt`` (before normalisation); a
    missing or mistyped field raises :class:`FieldError`."""

    def get(name: str, required: bool = True) -> str:
        key = fields.get(name, name)
        if key not in rec or rec[key] is None:
            if required:
                raise FieldError(key, "missing")
            return ""
        value = rec[key]
        if not isinstance(value, str):
            raise FieldError(key, f"expected a string, got {type(value).__name__}")
        return _clean(key, value)

    if fmt == "alpaca":
        return get("instruction"), get("input", required=False), get("output")
    if fmt == "gsm8k":
        return get("question"), "", get("answer")
    if fmt == "text":
        return "", "", get("text")
    if fmt == "humaneval":
        return "Complete the following Python function.", get("prompt"), get("canonical_solution")
    if fmt == "mbpp":
        key = "text" if fields.get("text", "text") in rec else "prompt"  # sanitized MBPP says prompt
        tests = rec.get(fields.get("test_list", "test_list")) or []
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise FieldError(fields.get("test_list", "test_list"), "expected a list of strings")
        hint = "Your code should pass these tests:\n" + "\n".join(tests) if tests else ""
        return get(key), hint, get("code")
    if fmt == "sharegpt":
        return _parse_chat(rec, fields)
    raise FieldError("format", f"unknown format {fmt!r}")


_USER, _ASSISTANT, _SYSTEM = {"human", "user"}, {"gpt", "assistant", "model"}, {"system"}


def _parse_chat(rec: dict, fields: dict[str, str]) -> tuple[str, str, str]:
    """The last user turn answered by the last assistant turn; earlier turns become context."""
    key = fields.get("conversations") or ("messages" if "messages" in rec else "conversations")
    turns = rec.get(key)
    if turns is None:
        raise FieldError(key, "missing")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise FieldError(key, "expected a list of turn objects")
    pairs = []
    for i, t in enumerate(turns):
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise FieldError(f"{key}[{i}]", "expected string 'from'/'role' and 'value'/'content'")
        pairs.append((role.lower(), _clean(f"{key}[{i}]", content)))
    last_answer = max((i for i, (r, _) in enumerate(pairs) if r in _ASSISTANT), default=None)
    if last_answer is None:
        raise FieldError(key, "no assistant turn")
    last_question = max((i for i, (r, _) in enumerate(pairs[:last_answer]) if r in _USER), default=None)
    if last_question is None:
        raise FieldError(key, "no user turn before the last assistant turn")
    context = "\n".join(f"{r}: {c}" for r, c in pairs[:last_question])
    return pairs[last_question][1], context, pairs[last_answer][1]


def _clean(field: str, value: str) -> str:
    """A field's text, refused if no tokenizer or filter could take it: a lone surrogate
    (``"\\ud800"`` decodes to one) or a NUL character."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(field, f"lone surrogate escape at character {e.start} (not valid Unicode)") from None
    if "\x00" in value:
        raise FieldError(field, f"NUL character at character {value.index(chr(0))}")
    return value


def _raw(record: Any) -> str:
    try:
        return json.dumps(record, ensure_ascii=True, default=str)[:_RAW_CHARS]
    except (ValueError, RecursionError):
        return repr(record)[:_RAW_CHARS]
