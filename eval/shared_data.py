"""The read-only data in ``../shared`` (override with ``KIBIDANGO_SHARED``), as stage-0 sources
for benchmarks and tests. Nothing is copied into the repository."""

from __future__ import annotations

import os
from pathlib import Path

from methods.curation.example import Example
from methods.curation.ingest import SourceSpec, read_source

__all__ = ["SHARED", "instruction_sources", "instruction_texts", "shared_available"]

SHARED = Path(os.environ.get("KIBIDANGO_SHARED", Path(__file__).resolve().parent.parent.parent / "shared"))


def shared_available() -> bool:
    return (SHARED / "data").is_dir()


def instruction_sources() -> list[SourceSpec]:
    """Every instruction-style file in ../shared/data (all rows, no limits)."""
    d = SHARED / "data"
    specs = [
        ("alpaca_gpt4", "llamafactory_demo/alpaca_en_demo.json", "alpaca", {}),
        ("identity", "llamafactory_demo/identity.json", "alpaca", {}),
        ("glaive", "llamafactory_demo/glaive_toolcall_en_demo.json", "sharegpt", {}),
        ("code_alpaca_2k", "codealpaca/code_alpaca_2k.json", "alpaca", {}),
        ("new_codealpaca", "codealpaca/new_codealpaca.json", "alpaca", {}),
        ("gsm8k_train", "gsm8k/train.jsonl", "gsm8k", {}),
        ("gsm8k_test", "gsm8k/test.jsonl", "gsm8k", {}),
        ("mbpp", "mbpp/mbpp.jsonl", "mbpp", {}),
        ("mbpp_sanitized", "mbpp/sanitized-mbpp.json", "mbpp", {}),
        ("humaneval", "humaneval/HumanEval.jsonl.gz", "humaneval", {}),
    ]
    return [
        SourceSpec(name=n, path=str(d / p), format=f, fields=fl, license="see shared/README.md")
        for n, p, f, fl in specs
    ]


def instruction_examples() -> list[Example]:
    return [ex for spec in instruction_sources() for ex in read_source(spec) if isinstance(ex, Example)]


def instruction_texts() -> list[str]:
    return [ex.text for ex in instruction_examples()]
