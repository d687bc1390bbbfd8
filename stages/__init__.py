"""Pipeline stages. Each module follows the contract in :mod:`stages.contract`; this registry maps
the plan's stage ids (PLAN.md) to modules, imported only when a flow needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["STAGES", "load_stage"]

STAGES: dict[str, str] = {
    "0": "stages.s0_curate",
    "P": "stages.sP_pretrain",
    "1A": "stages.s1a_sft",
    "1E": "stages.s1e_distill",
    "3": "stages.s3_domain_lora",
    "4": "stages.s3_domain_lora",
    "5": "stages.s3_domain_lora",
    "2A": "stages.s2a_prune",
    "2B": "stages.s2b_awq",
    "2C": "stages.s2b_awq",
    "2D": "stages.s2d_gguf",
    "2F": "stages.s2f_recovery",
    "X": "stages.sX_bundle",
    "2E": "stages.s2e_pack",
}


def load_stage(stage_id: str) -> ModuleType:
    from stages.contract import KibidangoError

    if stage_id not in STAGES:
        raise KibidangoError(f"unknown stage id {stage_id!r}; known: {', '.join(STAGES)}")
    return importlib.import_module(STAGES[stage_id])
