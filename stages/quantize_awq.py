"""Stages 2B and 2C — AWQ with llm-compressor: 2B quantizes the target (after pruning),
2C the small tiers (draft and qualifier, after distillation). One module, two stage ids, so
each is its own cached, forceable stage (``make stage-2b``).

The recipe is an llm-compressor recipe file (``AWQModifier`` + ``QuantizationModifier``:
W4A16 for tiny, W8A16 for the small preset's target), passed to ``oneshot`` unchanged with
calibration rows from stage 0. The output is a compressed-tensors checkpoint (int4 or int8
weights packed, scales beside them) that transformers loads (``compressed-tensors`` installed)
and vLLM serves. Measured per tier: bytes of the weights
before and after, and validation perplexity before and after on the same rows.

Why llm-compressor and not AutoAWQ: docs/stages.md, "Compression and export".

Outputs: ``<tier>/`` per tier (compressed-tensors checkpoint + tokenizer),
``llmcompressor_recipe.yaml``, ``awq.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.compression import llmc
from methods.compression.card import scheme_label, weight_bits
from methods.measure.lm import validation_loss
from methods.measure.weights import weight_bytes
from methods.training.models import resolve_base

LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch")


class Config(StageConfig):
    recipe: str = Field(
        description="llm-compressor recipe file (AWQModifier + a weight scheme), relative to the repository root."
    )
    tiers: list[str] = Field(
        min_length=1, description="Tiers of the `model` input to quantize (2B: target; 2C: draft, qualifier)."
    )
    calibration_samples: int = Field(
        128, gt=0, description="Stage-0 train rows AWQ calibrates on (the plan: 2K on GPUs)."
    )
    calibration_max_len: int = Field(256, gt=8, description="Tokens per calibration row.")
    eval_rows: int = Field(200, gt=0, description="Stage-0 validation rows for perplexity before/after.")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )
    max_perplexity_ratio: float | None = Field(
        None, gt=1, description="Fail if a tier's perplexity after / before exceeds this (None: report only)."
    )
    seed: int = Field(0, description="Seed of the calibration rows' draw.")


def external_inputs(cfg: Config) -> dict[str, str]:
    return llmc.recipe_digest(cfg.recipe)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    recipe = llmc.recipe_file(cfg.recipe)
    (out_dir / "llmcompressor_recipe.yaml").write_text(llmc.read_recipe(recipe, "AWQ"))
    data = inputs["data"] / "dataset"
    metrics: dict[str, float] = {}
    lines = []
    for tier in cfg.tiers:
        source = resolve_base(None, inputs.get("model"), tier, f"AWQ ({tier})")
        quantized = out_dir / tier
        llmc.compress(
            source,
            recipe,
            data,
            quantized,
            stage=f"AWQ ({tier})",
            samples=cfg.calibration_samples,
            max_len=cfg.calibration_max_len,
            seed=cfg.seed,
            save_compressed=True,
            log_file=out_dir / "logs" / f"llmcompressor-{tier}.log",
        )
        config = json.loads((quantized / "config.json").read_text())
        qconfig = config.get("quantization_config", {})
        if qconfig.get("quant_method") != "compressed-tensors":
            raise KibidangoError(
                f"AWQ ({tier}): {quantized}/config.json has no compressed-tensors quantization_config; is {recipe} a "
                "quantization recipe?"
            )
        before = validation_loss(source, data, cfg.eval_rows, cfg.eval_max_len)
        after = validation_loss(quantized, data, cfg.eval_rows, cfg.eval_max_len)
        tier_metrics = {
            "bytes_before": float(weight_bytes(Path(source))),
            "bytes_after": float(weight_bytes(quantized)),
            "val_perplexity_before": before["perplexity"],
            "val_perplexity_after": after["perplexity"],
        }
        bits = weight_bits(config)
        if bits:
            tier_metrics["weight_bits"] = float(bits)
        tier_metrics["size_ratio"] = tier_metrics["bytes_after"] / tier_metrics["bytes_before"]
        metrics.update({f"{tier}_{k}": v for k, v in tier_metrics.items()})
        ratio = after["perplexity"] / before["perplexity"]
        mb = f"{tier_metrics['bytes_before'] / 1e6:.2f} MB -> {tier_metrics['bytes_after'] / 1e6:.2f} MB"
        lines.append(
            f"{tier} ({scheme_label(config)}): {mb}, "
            f"validation perplexity {before['perplexity']:.2f} -> {after['perplexity']:.2f}"
        )
        if cfg.max_perplexity_ratio is not None and ratio > cfg.max_perplexity_ratio:
            raise KibidangoError(
                f"AWQ ({tier}): perplexity rose {ratio:.2f}x ({before['perplexity']:.2f} -> "
                f"{after['perplexity']:.2f}), over max_perplexity_ratio {cfg.max_perplexity_ratio}"
            )
    (out_dir / "awq.json").write_text(
        json.dumps({"scheme": qconfig.get("config_groups"), "metrics": metrics}, indent=2)
    )
    return StageResult(metrics, ["awq.json", "llmcompressor_recipe.yaml"], "AWQ:\n  " + "\n  ".join(lines))
