"""``bundle.json``, field by field: what the pipeline writes (:func:`kibidango.write_bundle`, stage
X; 1F's tuned defaults; 9A's release verdict) and what the runtime, the CLI and the report read,
all through :class:`BundleManifest`. Every field has a description (``kibidango schema`` prints
them). Parsing is strict: a key this runtime does not know, or a value of the wrong type, is
refused naming the file and the field.

Nothing in a bundle depends on when, where or by which run it was built (no build time, MLflow run
id or git sha: those live in the stage's manifest in the artifact store and in its MLflow run), so
a bundle rebuilt from the same inputs is byte-identical and its digest does not move.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from kibidango.integrity import BundleError

__all__ = [
    "SCHEMA_VERSION",
    "AdapterEntry",
    "BundleManifest",
    "FileEntry",
    "Profile",
    "Release",
    "TierEntry",
    "describe",
]

SCHEMA_VERSION = 2
"""2: no ``created``, ``pipeline_git_sha``, ``stage_git_shas`` or ``mlflow_run_ids`` (version 1 had
them; rebuild such a bundle with stage X)."""


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class FileEntry:
    path: str = _doc("Path inside the bundle (POSIX, never leaving it).")
    size: int = _doc("Bytes.")
    sha256: str = _doc("Hex sha256 of the file; checked before anything is loaded.")


@dataclass(frozen=True)
class TierEntry:
    hf: str | None = _doc("Transformers checkpoint directory of the tier, or absent.", default=None)
    gguf: str | None = _doc("GGUF file of the tier (llama.cpp backend), or absent.", default=None)
    vocab_size: int | None = _doc("Vocabulary size (every tier shares one tokenizer).", default=None)
    hidden_size: int | None = _doc("Hidden size of the model.", default=None)
    layers: int | None = _doc("Decoder layers.", default=None)
    quantization: dict[str, str] = _doc("Per weight form (hf, gguf), its quantization.", default_factory=dict)


@dataclass(frozen=True)
class Release:
    releasable: bool = _doc("True when every quality gate passed or was waived.")
    gates: list[dict[str, Any]] = _doc(
        "Each gate: name, metric, threshold, value, passed, waived.", default_factory=list
    )
    failed: list[str] = _doc("The gates that failed (not waived).", default_factory=list)
    waived: list[str] = _doc("The gates waived on purpose (``waive:`` in the recipe).", default_factory=list)


@dataclass(frozen=True)
class Profile:
    name: str = _doc(
        "``default``: only what the decoding defaults, routing, calibration and cascade use on ``backends``; "
        "``full``: every part the pipeline built (a bundle without this field is full)."
    )
    backends: list[str] = _doc(
        "The backends whose weight forms it ships (``torch``: the transformers weights, ``llamacpp``: GGUF); the "
        "runtime's ``--backend auto`` takes the first.",
        default_factory=list,
    )
    left_out: list[str] = _doc(
        "What the pipeline built that this profile leaves out, each with why (the full bundle, stage 1F's output "
        "in the artifact store, has them).",
        default_factory=list,
    )


@dataclass(frozen=True)
class AdapterEntry:
    domain: str = _doc("The domain the router names (``math``, ``code``, ...) or ``recovery``.")
    path: str = _doc("Directory of the adapter inside the bundle (holds ``adapter.json``).")
    formats: list[str] = _doc("Weight forms shipped: ``peft`` (torch) and/or ``gguf`` (llama.cpp).")
    base_tier: str = _doc("The tier the adapter applies to.", default="target")
    stage_input: str | None = _doc("The stage input it was exported from (lineage).", default=None)


@dataclass(frozen=True)
class BundleManifest:
    schema_version: int = _doc(f"Format of this file; this runtime reads {SCHEMA_VERSION}.")
    tiers: dict[str, TierEntry] = _doc("Tier name (draft, qualifier, target) -> its weights and shape.")
    files: list[FileEntry] = _doc("Every file of the bundle with its size and sha256 (bundle.json aside).")
    runtime_defaults: dict[str, Any] = _doc(
        "Decoding defaults (mode, k, l_D, l_Q, tau_Q, tau_T, divergence, stop_ids, ...).", default_factory=dict
    )
    preset: str | None = _doc("The preset that built it; the server's model is ``kibidango-<preset>``.", default=None)
    card: str | None = _doc("The bundle card (Markdown, every figure from a stage's metrics).", default=None)
    stage_cache_keys: dict[str, str] = _doc(
        "Lineage: stage id -> cache key of every artifact the bundle was built from (each key's manifest in "
        "the artifact store has its MLflow run, git sha and build time).",
        default_factory=dict,
    )
    adapters: list[AdapterEntry] = _doc("Domain adapters (3-5) and the recovery adapter (2F).", default_factory=list)
    default_adapter: str | None = _doc(
        "The adapter the target runs with where no domain adapter is routed (``adapter='auto'``): stage 2F's "
        "recovery LoRA, the weights the answer calibration (2G) and the cascade's thresholds (6C) were measured "
        "with; applied on the backends it has a form for. ``adapter='none'`` runs the bare weights.",
        default=None,
    )
    router: str | None = _doc("The domain router of stage 6A (``router/router.json``).", default=None)
    calibration: str | None = _doc("The confidence calibrator of stage 2G.", default=None)
    escalation: str | None = _doc("The escalation detector of stage 6B.", default=None)
    cascade: str | None = _doc("The cascade thresholds and cloud prices chosen by stage 6C.", default=None)
    ngrams: str | None = _doc(
        "A static n-gram table (``ngrams/ngrams.npz``): the target's own continuations of prompts it is not "
        "judged on, counted; proposes tokens where decoding sets ``ngram_table`` (``kibidango.decode.ngrams``).",
        default=None,
    )
    tuned_defaults: dict[str, dict[str, Any]] = _doc(
        "Per backend (torch, llamacpp), decoding settings measured fastest (``kibidango tune`` / stage 1F); "
        "read over ``runtime_defaults``.",
        default_factory=dict,
    )
    tuning: dict[str, dict[str, Any]] = _doc(
        "Per backend, the tuner's measurements behind ``tuned_defaults`` (speeds, acceptance).", default_factory=dict
    )
    release: Release | None = _doc("The quality gates' verdict (stage 9A).", default=None)
    profile: Profile | None = _doc("Which parts it ships (stage 9A's ``profile``); absent: all of them.", default=None)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> BundleManifest:
        """The manifest in ``doc`` (parsed JSON); BundleError naming ``where`` and the field."""
        if not isinstance(doc, dict):
            raise BundleError(f"{where}: not a JSON object")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise BundleError(
                f"{where}: schema_version {doc.get('schema_version')!r}, this runtime reads {SCHEMA_VERSION}"
                + (
                    " (a bundle of an older pipeline: rebuild it with stage X)"
                    if doc.get("schema_version") == 1
                    else ""
                )
            )
        return _value(cls, doc, where, "")

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as bundle.json: fields left at None are omitted."""
        return _json(self)

    def replace(self, **changes: Any) -> BundleManifest:
        return dataclasses.replace(self, **changes)

    def part(self, name: str) -> str | None:
        """The path of one of the bundle's parts (router, calibration, escalation, cascade, ngrams)."""
        if name not in _PARTS:
            raise KeyError(name)
        return getattr(self, name)


_PARTS = ("router", "calibration", "escalation", "cascade", "ngrams")


def _value(kind: Any, value: Any, where: str, path: str) -> Any:
    """``value`` checked against the annotation ``kind``; dataclasses built field by field."""
    at = path or "(top level)"
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where, path)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise BundleError(f"{where}: {at} is not an object")
        hints = typing.get_type_hints(kind)
        fields = {f.name: f for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise BundleError(
                f"{where}: {path + '.' if path else ''}{unknown[0]}: not a field of this runtime's schema"
            )
        args = {}
        for name, f in fields.items():
            sub = f"{path}.{name}" if path else name
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BundleError(f"{where}: {sub} is missing")
                continue
            args[name] = _value(hints[name], value[name], where, sub)
        return kind(**args)
    if origin is dict:
        key_t, val_t = typing.get_args(kind)
        if not isinstance(value, dict):
            raise BundleError(f"{where}: {at} is not an object")
        return {k: _value(val_t, v, where, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        (item_t,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise BundleError(f"{where}: {at} is not a list")
        return [_value(item_t, v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise BundleError(f"{where}: {at} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _json(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            f.name: _json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


def describe() -> str:
    """Every field of bundle.json with its type and description (Markdown)."""
    lines = []
    for cls in (BundleManifest, TierEntry, FileEntry, AdapterEntry, Release):
        lines += [f"### {cls.__name__}", "", "| field | type | description |", "|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            shown = re.sub(r"<class '(\w+)'>", r"\1", str(hints[f.name]))
            shown = re.sub(r"\b[\w.]+\.(\w+)", r"\1", shown)  # typing.Any, kibidango.bundle.schema.TierEntry
            lines.append(f"| `{f.name}` | `{shown}` | {f.metadata['doc']} |")
        lines.append("")
    return "\n".join(lines)
