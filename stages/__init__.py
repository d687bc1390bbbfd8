"""Pipeline stages. Each module follows the contract in :mod:`core.contract`; this registry maps
the stage ids the presets use (0, P, 1A, ..., X) to modules, imported only when a flow needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["LOOP", "STAGES", "TAGS", "base_id", "load_stage", "stage_ids", "stage_name"]

STAGES: dict[str, str] = {
    "0": "stages.curate",
    "P": "stages.pretrain",
    "1A": "stages.sft",
    "1B": "stages.mine_failures",
    "1C": "stages.critique_filter",
    "1T": "stages.stand_in_teachers",
    "1D": "stages.teach_cascade",
    "1R": "stages.retrain",
    "1S": "stages.retrain",  # the study of the loop (`make study-loop`): 1R's arms beside 1R's own model
    "1E": "stages.distill",
    "3": "stages.domain_lora",
    "4": "stages.domain_lora",
    "5": "stages.domain_lora",
    "2A": "stages.prune",
    "2B": "stages.quantize_awq",
    "2C": "stages.quantize_awq",
    "2D": "stages.gguf_export",
    "2F": "stages.recovery_lora",
    "X": "stages.export_bundle",
    "1F": "stages.tune_decoding",
    "2E": "stages.zstd_pack",
    "6A": "stages.train_router",
    "2G": "stages.calibrate",
    "6B": "stages.escalation",
    "6C": "stages.thresholds",
    "9": "stages.evaluate",
    "9A": "stages.gates",
}


LOOP = ("1B", "1C", "1D", "1R")
"""The quality loop's stages: a preset with ``rounds: N`` runs them again as ``1B.2`` ... ``1R.N``,
each round mining the last round's retrained student (flows/preset.py)."""


def base_id(stage_id: str) -> str:
    """The stage a round's copy runs (``1B.2`` -> ``1B``); any other id is its own."""
    base, dot, n = stage_id.partition(".")
    return base if dot and n.isdigit() and int(n) >= 2 and base in LOOP else stage_id


TAGS: dict[str, tuple[str, ...]] = {
    sid: ("gpu",) for sid in ("P", "1A", "1T", "1R", "1S", "1E", "3", "4", "5", "2A", "2B", "2C", "2F")
}
"""Placement tags of the stages (training and compression want a GPU); a preset's ``pools`` route a
tag, or a stage id, to a Prefect work pool (:mod:`flows.pools`). Where a stage runs never changes
what it computes, so tags are not part of any cache key."""


def stage_name(stage_id: str) -> str:
    """A stage's one name: its module's (``2G`` -> ``calibrate``), in logs, plans, the report and
    MLflow run names (``2G-calibrate``); ``make stage-2g`` and ``make stage-calibrate`` both rerun it.
    Stages 3, 4 and 5 are one module run on three domains: ``domain_lora``."""
    return STAGES[base_id(stage_id)].rsplit(".", 1)[1]


def stage_ids(given: str, known: list[str]) -> list[str]:
    """The ids of ``known`` that ``given`` names: an id (case-insensitive, as ``make stage-2b``
    passes it) or a stage's name (every id of ``domain_lora``)."""
    from core.contract import KibidangoError

    by_id = [sid for sid in known if sid.lower() == given.lower()]
    by_name = [sid for sid in known if stage_name(sid) == given.lower().replace("-", "_")]
    if not (by_id or by_name):
        names = ", ".join(f"{sid} ({stage_name(sid)})" for sid in known)
        raise KibidangoError(f"stage {given!r} is not in this preset; its stages: {names}")
    return by_id or by_name


def load_stage(stage_id: str) -> ModuleType:
    from core.contract import KibidangoError

    if base_id(stage_id) not in STAGES:
        raise KibidangoError(f"unknown stage id {stage_id!r}; known: {', '.join(STAGES)}")
    return importlib.import_module(STAGES[base_id(stage_id)])
