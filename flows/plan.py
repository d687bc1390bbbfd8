"""``--dry-run``: resolve a preset's stage plan and print it without running anything."""

from __future__ import annotations

import functools

import yaml
from pydantic import BaseModel

from core.store import Artifact
from flows.preset import Preset
from flows.runner import stage_key
from flows.workspace import store
from methods.training.axolotl import launch_command
from methods.training.recipe import TrainRecipe
from stages import load_stage, stage_name

__all__ = ["describe_plan"]


@functools.cache
def _cuda(accelerator: str) -> bool:
    """Whether training runs on GPUs: asked only for a plan that trains (importing torch takes
    seconds, and every `flows run` describes its plan first)."""
    if accelerator != "auto":
        return accelerator == "cuda"
    import torch

    return torch.cuda.is_available()


def _recipes(value) -> list[TrainRecipe]:
    """Every training recipe in a stage config (``train``, ``students.*.train``, ``tiers.*.train``)."""
    if isinstance(value, TrainRecipe):
        return [value]
    if isinstance(value, BaseModel):
        return [r for name in type(value).model_fields for r in _recipes(getattr(value, name))]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _recipes(v)]
    return []


def describe_plan(plan: Preset, force: list[str] | None = None) -> str:
    """The stages in run order with their inputs, cache keys (where every input is known without
    running anything) and whether each would be a cache hit, each validated config, and the
    axolotl YAML of every training run (for the preset's accelerator; paths known only at run
    time appear as <placeholders>)."""
    lines = [f"preset {plan.name} ({plan.path})  experiment '{plan.experiment}'", ""]
    known: dict[str, Artifact | None] = {}
    for sid in plan.order():
        module = load_stage(sid)
        cfg = plan.configs[sid]
        needs = plan.needs(sid)
        ups = {name: known.get(up) for name, up in needs.items()}
        if all(a is not None for a in ups.values()):
            sk = stage_key(sid, cfg, ups)  # type: ignore[arg-type]
            key, digests = sk.key, sk.digests
            hit = store().get(sid, key)
            known[sid] = hit
            status = "forced" if sid in (force or []) else ("cache hit" if hit else "would run")
            lines.append(f"stage {sid} ({stage_name(sid)}): key {key}  [{status}]")
            for name, digest in digests.items():
                lines.append(f"  input {name}: {digest}")
        else:
            known[sid] = None
            lines.append(
                f"stage {sid} ({stage_name(sid)}): key known once {', '.join(needs.values())} ran  [would run]"
            )
        for name, up in needs.items():
            lines.append(f"  needs {name} <- stage {up}")
        pool = plan.pool(sid)
        if pool:
            lines.append(f"  runs on a worker of Prefect work pool {pool!r}")
        body = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip()
        lines += ["  config:", *("    " + line for line in body.splitlines())]
        if hasattr(module, "axolotl_configs"):
            gpus = max((r.gpus for r in _recipes(cfg)), default=1)
            launch = " ".join(launch_command("<axolotl python>", "train", "<work>/axolotl.yaml", gpus))
            cuda = _cuda(plan.spec.accelerator)
            for run, spec in module.axolotl_configs(cfg, cuda).items():
                text = yaml.safe_dump(spec, sort_keys=False).rstrip()
                lines += [
                    f"  axolotl run '{run}' ({'GPU' if cuda else 'CPU'}; {gpus} process(es): {launch}):",
                    *("    " + line for line in text.splitlines()),
                ]
        lines.append("")
    return "\n".join(lines)
