"""Export the bundle the runtime loads (stage X in the presets).

Assembled with the runtime's own :func:`kibidango.write_bundle`, so the pipeline writes exactly
what ``kibidango`` reads:

- ``tiers/<tier>/hf/``: the AWQ checkpoints (2B target, 2C draft and qualifier;
  compressed-tensors, transformers-loadable), each with the chat format the tiers were trained in
  as its tokenizer's: the model's own template (SmolLM2's ChatML), else the family's
  (:data:`methods.training.chat.TEMPLATE`, written as ``chat_template.jinja``), so that the
  runtime's chat (the server's ``/v1/chat/completions``) prompts as in training;
  ``tiers/<tier>/gguf/``: the 2D GGUF files;
- ``adapters/<domain>/``: the domain LoRAs (3-5) and the recovery LoRA (2F), each with its
  ``adapter.json``; bundle.json's ``default_adapter`` is the adapter 2G calibrated the target
  with (its ``calibration_eval.json``: the recovery LoRA), so the runtime's default weights are
  the ones the confidence and the cascade's thresholds were measured on; ``router/router.json``:
  the domain router (6A), ``calibration/calibration.json``
  (2G), ``escalation/escalation.json`` (6B) and ``cascade/cascade.json`` (6C), when wired;
- ``bundle.json`` (:class:`kibidango.bundle.schema.BundleManifest`): schema, preset, every file with
  size + sha256, every stage's cache key (the lineage of the inputs, read from their manifests),
  the tier table with each tier's measured figures, runtime defaults. Nothing in the bundle
  depends on when or where it was built: no build time, MLflow run id or git sha (those are in the
  stage's manifest and its MLflow run), so stage X recomputed from unchanged inputs publishes the
  same bytes, and the stages after it stay cache hits;
- ``BUNDLE_CARD.md``: every figure taken from the stages' metrics (:mod:`methods.compression.card`).

Outputs: ``bundle/`` and a copy of the card beside it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from core.contract import KibidangoError, StageConfig, StageResult
from kibidango.bundle import TIER_ORDER
from methods.compression.card import bundle_card, lineage, scheme_label
from methods.compression.gguf import gguf_type, tier_gguf
from methods.training.adapter_manifest import ships
from methods.training.chat import TEMPLATE, own_template

log = logging.getLogger("kibidango.stage.X")


class Config(StageConfig):
    preset: str = Field(description="Preset name recorded in bundle.json.")
    hf_tiers: dict[str, str] = Field(
        description="Tier -> input holding its transformers checkpoint (`<input>/<tier>/`)."
    )
    gguf_input: str = Field("gguf", description="Input holding the 2D GGUF files (`<input>/<tier>/*.gguf`).")
    adapters: list[str] = Field(
        default_factory=list,
        description="Inputs that may hold an adapter (adapter.json), shipped under adapters/<domain>/ when wired and "
        "its stage's check let it ship (an input the preset does not wire: its stage did not run).",
    )
    router: str | None = Field(
        None, description="Input holding the domain router (stage 6A's router.json), shipped as router/router.json."
    )
    calibration: str | None = Field(
        None, description="Input holding stage 2G's calibration.json, shipped as calibration/calibration.json."
    )
    escalation: str | None = Field(
        None, description="Input holding stage 6B's escalation.json, shipped as escalation/escalation.json."
    )
    cascade: str | None = Field(
        None, description="Input holding stage 6C's cascade.json (chosen thresholds), shipped as cascade/cascade.json."
    )
    runtime_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Decoding defaults (kibidango.DecodeConfig's fields: mode, k, l_D, l_Q, tau_Q, tau_T, ...; "
        "and kv_cache); a key that is none of them is refused at make dry-run.",
    )

    @field_validator("runtime_defaults")
    @classmethod
    def _decoding_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        from kibidango.decode.speculative import DecodeConfig

        DecodeConfig.from_mapping(value, "runtime_defaults")  # what the runtime will read, read now
        return value


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from kibidango.bundle import load_bundle, write_bundle

    parts = [p for p in (cfg.router, cfg.calibration, cfg.escalation, cfg.cascade) if p]
    for name in [*cfg.hf_tiers.values(), cfg.gguf_input, *parts]:
        if name not in inputs:
            raise KibidangoError(f"input {name!r} is not wired (add it to the preset's needs of stage X)")
    tiers: dict[str, dict[str, Any]] = {}
    for tier in TIER_ORDER:
        if tier not in cfg.hf_tiers:
            continue
        hf = inputs[cfg.hf_tiers[tier]] / tier
        if not (hf / "config.json").is_file():
            raise KibidangoError(f"{hf} is not a transformers checkpoint (no config.json)")
        gguf = tier_gguf(inputs[cfg.gguf_input], tier, f"the {cfg.gguf_input} input")
        config = json.loads((hf / "config.json").read_text())
        tiers[tier] = {
            "hf": hf,
            "gguf": gguf,
            "vocab_size": config["vocab_size"],
            "hidden_size": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "quantization": {
                "hf": f"AWQ {scheme_label(config)} (compressed-tensors)",
                "gguf": gguf_type(gguf),
            },
        }

    stages = lineage(inputs)
    metrics = {name: stages[path.parent.name]["metrics"] for name, path in inputs.items()}
    root = out_dir / "bundle"
    write_bundle(
        root,
        tiers,
        cfg.runtime_defaults,
        preset=cfg.preset,
        stage_cache_keys={s: v["key"] for s, v in stages.items()},
        card="BUNDLE_CARD.md",
        finalize=lambda tmp: _add_extras(tmp, cfg, inputs, metrics, stages),
    )
    bundle = load_bundle(root)  # the runtime's own check: every hash, one tokenizer across tiers
    shutil.copy2(root / "BUNDLE_CARD.md", out_dir / "BUNDLE_CARD.md")
    files = bundle.manifest.files
    result = {"files": float(len(files)), "bundle_bytes": float(sum(f.size for f in files))}
    summary = (
        f"bundle/ with {len(files)} files, {result['bundle_bytes'] / 1e6:.2f} MB, and BUNDLE_CARD.md; "
        f"bundle.json sha256 {bundle.digest} (pin it: kibidango generate --expect-sha256 {bundle.digest})"
    )
    return StageResult(result, ["BUNDLE_CARD.md"], summary)


def _add_extras(
    tmp: Path, cfg: Config, inputs: dict[str, Path], metrics: dict[str, dict], stages: dict
) -> dict[str, Any]:
    """The chat template, adapters and the card, written into the bundle before it is hashed;
    returns the extra bundle.json fields."""
    for hf in sorted((tmp / "tiers").glob("*/hf")):
        if not own_template(hf):
            (hf / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    shipped = []
    for name in cfg.adapters:
        if name not in inputs:  # the preset does not run its stage (recipes/graph.yaml: an optional input)
            log.info(f"adapter input {name!r} is not wired: the preset does not run its stage")
            continue
        if not ships(inputs[name]):  # its stage's check: no better than the weights it modifies
            log.info(f"adapter input {name!r} does not ship (its stage's check found it no better)")
            continue
        spec = json.loads((inputs[name] / "adapter.json").read_text())
        dest = tmp / "adapters" / spec["domain"]
        dest.mkdir(parents=True)
        shutil.copy2(inputs[name] / "adapter.json", dest / "adapter.json")
        for entries in spec["formats"].values():
            for e in entries:
                (dest / e["path"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(inputs[name] / e["path"], dest / e["path"])
        shipped.append(
            {
                "domain": spec["domain"],
                "path": f"adapters/{spec['domain']}",
                "base_tier": spec.get("base_tier", "target"),
                "formats": sorted(spec["formats"]),
                "stage_input": name,
            }
        )
    default = _default_adapter(cfg, inputs, shipped)
    (tmp / "BUNDLE_CARD.md").write_text(
        bundle_card(cfg.preset, metrics, shipped, stages, cfg.runtime_defaults, default)
    )
    extra: dict[str, Any] = {"adapters": shipped}
    if default is not None:
        extra["default_adapter"] = default
    for key, name in (
        ("router", cfg.router),
        ("calibration", cfg.calibration),
        ("escalation", cfg.escalation),
        ("cascade", cfg.cascade),
    ):
        if name and key == "escalation" and not _earns_its_place(inputs[name] / "escalation.json"):
            continue  # 6B's detector does not beat confidence alone: the bundle ships none
        if name:  # one small JSON each: <key>/<key>.json, read by Bundle.<key>()
            (tmp / key).mkdir()
            shutil.copy2(inputs[name] / f"{key}.json", tmp / key / f"{key}.json")
            extra[key] = f"{key}/{key}.json"
    return extra


def _earns_its_place(path: Path) -> bool:
    """Stage 6B's verdict on its detector: it beat confidence alone (a paired bootstrap)."""
    return bool(json.loads(path.read_text()).get("metrics", {}).get("earns_its_place", False))


def _default_adapter(cfg: Config, inputs: dict[str, Path], shipped: list[dict]) -> str | None:
    """The adapter stage 2G answered and calibrated with where no domain adapter was routed
    (``default_adapter`` in its calibration_eval.json), which must ship; None without a calibration
    input or when 2G calibrated the bare weights."""
    if not cfg.calibration:
        return None
    report = inputs[cfg.calibration] / "calibration_eval.json"
    name = json.loads(report.read_text()).get("default_adapter") if report.is_file() else None
    if name is not None and name not in {a["domain"] for a in shipped}:
        raise KibidangoError(
            f"{report}: the target was calibrated with adapter {name!r}, which this bundle does not ship "
            "(add the input holding it to stage X's `adapters`)"
        )
    return name
