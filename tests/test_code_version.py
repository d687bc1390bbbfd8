"""Cache keys that mean "behaviour changed": the code version of every stage is computed with an
edited copy of one module's source (nothing on disk changes), then compared."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from core.contract import code_version
from stages import STAGES, load_stage


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def _versions(sources: dict[str, str] | None = None) -> dict[str, str]:
    return {sid: code_version(load_stage(sid), sources=sources) for sid in STAGES}


@pytest.fixture(scope="module")
def baseline() -> dict[str, str]:
    return _versions()


def test_comments_docstrings_and_formatting_keep_every_key(baseline):
    src = _source("methods.curation.ingest")
    edited = src.replace('"""Every row of the source as an Example', '"""EVERY row, reworded docstring, as an Example')
    edited = edited.replace("\ndef records(", "\n# a new comment\n\n\ndef records(  # and another\n    ")
    edited = edited.replace("    n_valid = n_seen = 0\n", "    n_valid = n_seen = (\n        0\n    )  # reformatted\n")
    assert edited != src
    assert _versions({"methods.curation.ingest": edited}) == baseline
    # a module's own docstring too, where a stage reaches the whole module (the stage's own, here)
    src = _source("stages.zstd_pack")
    edited = src.replace('"""Stage 2E', '"""Stage 2E, its docstring reworded (a module path renamed, say):', 1)
    assert edited != src
    assert _versions({"stages.zstd_pack": edited}) == baseline


def test_a_one_character_change_to_a_function_changes_exactly_the_stages_that_use_it(baseline):
    src = _source("methods.measure.weights")
    edited = src.replace("if t.shape[-1] % 4 == 0:", "if t.shape[-1] % 8 == 0:")  # inside weight_sparsity
    assert edited != src
    changed = {sid for sid, v in _versions({"methods.measure.weights": edited}).items() if v != baseline[sid]}
    assert changed == {"2A"}  # the only stage that measures sparsity
    src = _source("methods.curation.dedup")
    edited = re.sub(r"num_perm: int = Field\(128", "num_perm: int = Field(129", src)
    assert edited != src
    changed = {sid for sid, v in _versions({"methods.curation.dedup": edited}).items() if v != baseline[sid]}
    assert changed == {"0", "1C"}  # stage 0 deduplicates rows, 1C failures


def test_a_plumbing_edit_keeps_every_key(baseline):
    for module in ("core.store", "core.contract", "core.progress", "core.hashing", "core.processes"):
        src = _source(module)
        edited = src + "\n\ndef _an_unused_helper():\n    return 42\n"
        assert _versions({module: edited}) == baseline, module
    src = _source("core.hashing")  # the file hashing that stage 0's source digests and 2A's recipe digest use
    edited = src.replace("h = hashlib.sha256()", "h = hashlib.sha256()  # noqa\n    h.update(b'')", 1)
    assert edited != src and _versions({"core.hashing": edited}) == baseline


def test_moving_a_definition_to_another_module_keeps_every_key(baseline):
    """normalize_text moves from records.py into a new module, and ingest.py imports it from there."""
    records = _source("methods.curation.example")
    start = records.index("def normalize_text(")
    moved = "import unicodedata\n\n\n" + records[start:]
    sources = {
        "methods.curation.example": records[:start],
        "methods.curation.text": moved,
        "methods.curation.ingest": _source("methods.curation.ingest").replace(
            "from methods.curation.example import Example, Reject, normalize_text",
            "from methods.curation.example import Example, Reject\nfrom methods.curation.text import normalize_text",
        ),
        "methods.benchmarks": _source("methods.benchmarks").replace(
            "from methods.curation.example import Reject, normalize_text",
            "from methods.curation.example import Reject\nfrom methods.curation.text import normalize_text",
        ),
    }
    assert sources["methods.curation.ingest"] != _source("methods.curation.ingest")
    assert sources["methods.benchmarks"] != _source("methods.benchmarks")
    assert _versions(sources) == baseline
    # the same move with a changed body is a change
    sources["methods.curation.text"] = moved.replace(".strip()", '.strip(" ")')
    changed = {sid for sid, v in _versions(sources).items() if v != baseline[sid]}
    # 1B, 1R and 1S (their evaluation), 2G, 9 and 3-5 (their check) read benchmark tasks with it
    assert changed == {"0", "1B", "1R", "1S", "2G", "3", "4", "5", "9"}


def test_moving_plumbing_keeps_every_key(baseline):
    """A stage that imports a helper from a plumbing module keeps its version when the helper's
    import moves to another plumbing module (the import lines themselves are not hashed)."""
    src = _source("stages.pretrain")
    moved = src.replace("from core.hashing import file_sha256", "from core.store import file_sha256")
    assert moved != src
    assert _versions({"stages.pretrain": moved}) == baseline


def _runtime_modules(package: str) -> list[str]:
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    return sorted(f"{package}.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__")


def test_an_edit_to_the_cascade_or_the_server_changes_no_stage(baseline):
    """The runtime's floors above the decoding core: the ledger's error message, the server's
    metrics, the cascade's routing... none is code a stage runs to make its artifact (the paid floor
    is transport: see core.contract.PLUMBING), so none retrains the chain."""
    modules = [*_runtime_modules("kibidango.cascade"), *_runtime_modules("kibidango.paid")]
    modules += _runtime_modules("kibidango.server")
    assert "kibidango.paid.ledger" in modules and "kibidango.server.app" in modules
    sources = {}
    for module in modules:  # all edited at once: one key that moved would show
        src = _source(module)
        tree_edit = src.replace('"""\n\nfrom __future__', '"""\n\nKB_EDITED = 1\n\nfrom __future__', 1)
        edited = re.sub(r"(\n    def [^\n]*:\n)", r"\1        KB_EDITED = 2\n", tree_edit)  # every method's body too
        sources[module] = re.sub(r'(raise \w+\(\s*f?")', r"\1edited: ", edited)  # every error message
        assert sources[module] != src, module
    assert _versions(sources) == baseline
    ledger = _source("kibidango.paid.ledger")
    edited = ledger.replace("} does not fit the ${left", "} DOES NOT FIT the ${left")
    assert edited != ledger and _versions({"kibidango.paid.ledger": edited}) == baseline


def test_an_edit_to_the_decoding_core_changes_exactly_the_stages_that_decode(baseline):
    """The speculative decoder runs in the stages that generate with the runtime (1B, 1C and 1R
    through failure mining's answerer, 1D's self tier sampling the student, 1E's draft agreement,
    1F's tuning, 2D's fidelity table answering the ladder, 2F's task check, 2G's answers, 3-5's check,
    9's evaluation); no other stage's key moves."""
    src = _source("kibidango.decode.speculative")
    edited = src.replace("class Decoder:\n", "class Decoder:\n    KB_EDITED = 1\n", 1)
    assert edited != src
    changed = {sid for sid, v in _versions({"kibidango.decode.speculative": edited}).items() if v != baseline[sid]}
    assert changed == {"1B", "1C", "1D", "1E", "1F", "1R", "1S", "2D", "2F", "2G", "3", "4", "5", "9"}
    src = _source("kibidango.bundle")
    edited = src.replace("def load_bundle(", "def load_bundle(  # edited\n    ", 1).replace(
        "    if is_packed(root):",
        "    KB_EDITED = 1\n    if is_packed(root):",
        1,
    )
    assert edited != src
    changed = {sid for sid, v in _versions({"kibidango.bundle": edited}).items() if v != baseline[sid]}
    decoding = {"1B", "1C", "1D", "1E", "1F", "1R", "1S", "2D", "2F", "2G", "3", "4", "5", "9"}
    assert changed and changed <= decoding | {"X", "9A"}, changed


def test_a_stages_report_functions_are_not_its_behaviour(baseline):
    """A stage's ``report_*`` functions (its rows of the report) only render its artifact: editing
    one keeps every key; a definition that would call one is refused, so a report function can never
    carry a change of what the stage writes past the cache."""
    from core.codehash import PresentationUsed

    src = _source("stages.gguf_export")
    assert "\ndef report_headline(" in src
    edited = src.replace("chosen by 2D's fidelity table", "chosen by the fidelity table (reworded)")
    edited += "\n\ndef report_extra(artifact):\n    return [('a figure', str(artifact))]\n"
    assert edited != src
    assert _versions({"stages.gguf_export": edited}) == baseline
    calls = edited.replace("    rows = load_split(", "    report_extra(out_dir)\n    rows = load_split(", 1)
    assert calls != edited
    with pytest.raises(PresentationUsed, match="calls report_extra, a report function"):
        _versions({"stages.gguf_export": calls})
