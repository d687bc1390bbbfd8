"""Stage 2A — prune the target with llm-compressor's SparseGPT.

The recipe is an llm-compressor recipe file (``recipes/stage2A/*.yaml``: ``SparseGPTModifier``
with an unstructured ratio, or ``mask_structure: "2:4"``; several ``*_stage`` blocks of rising
sparsity make a gradual schedule), passed to ``oneshot`` unchanged with calibration rows from
stage 0. The pruned model is saved dense, so the zeros can be counted in the saved tensors: the
stage reports the sparsity it *measured* there, not the recipe's target, and fails if the saved
model is less sparse than ``min_sparsity``.

Outputs: ``<tier>/`` (transformers checkpoint + tokenizer), ``llmcompressor_recipe.yaml`` (the
recipe as run), ``prune.json`` (metrics).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.compression import llmc
from methods.measure.lm import validation_loss
from methods.measure.weights import weight_bytes, weight_sparsity
from methods.training.models import resolve_base

LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch")


class Config(StageConfig):
    recipe: str = Field(description="llm-compressor recipe file (SparseGPTModifier), relative to the repository root.")
    tier: str = Field("target", description="Tier of the `model` input to prune.")
    base_model: str | None = Field(
        None, description="Hub id or directory to prune instead of the `model` input's tier."
    )
    calibration_samples: int = Field(128, gt=0, description="Stage-0 train rows SparseGPT calibrates on.")
    calibration_max_len: int = Field(256, gt=8, description="Tokens per calibration row (longer rows are cut).")
    min_sparsity: float = Field(
        0.0, ge=0, lt=1, description="Fail if the saved decoder weights are less sparse than this."
    )
    eval_rows: int = Field(200, gt=0, description="Stage-0 validation rows for perplexity before/after.")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )
    seed: int = Field(0, description="Seed of the calibration rows' draw.")


def external_inputs(cfg: Config) -> dict[str, str]:
    return llmc.recipe_digest(cfg.recipe)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    source = resolve_base(cfg.base_model, inputs.get("model"), cfg.tier, "pruning")
    recipe = llmc.recipe_file(cfg.recipe)
    (out_dir / "llmcompressor_recipe.yaml").write_text(llmc.read_recipe(recipe, "SparseGPT"))
    data = inputs["data"] / "dataset"
    pruned = out_dir / cfg.tier
    llmc.compress(
        source,
        recipe,
        data,
        pruned,
        stage="SparseGPT",
        samples=cfg.calibration_samples,
        max_len=cfg.calibration_max_len,
        seed=cfg.seed,
        save_compressed=False,
        log_file=out_dir / "logs" / "llmcompressor.log",
    )

    sparsity = weight_sparsity(pruned)
    if sparsity["sparsity"] < cfg.min_sparsity:
        raise KibidangoError(
            f"the saved model {pruned} is {sparsity['sparsity']:.1%} sparse, below min_sparsity "
            f"{cfg.min_sparsity:.1%}; check the recipe's targets/ignore ({recipe})"
        )
    before = validation_loss(source, data, cfg.eval_rows, cfg.eval_max_len)
    after = validation_loss(pruned, data, cfg.eval_rows, cfg.eval_max_len)
    metrics = {
        **sparsity,
        "val_perplexity_before": before["perplexity"],
        "val_perplexity_after": after["perplexity"],
        "val_loss_before": before["loss"],
        "val_loss_after": after["loss"],
        "weight_bytes": float(weight_bytes(pruned)),
    }
    (out_dir / "prune.json").write_text(json.dumps({"source": source, "metrics": metrics}, indent=2))
    summary = (
        f"{cfg.tier} pruned to {sparsity['sparsity']:.1%} zeros in the saved decoder weights "
        f"(2:4 groups {sparsity['share_2of4_groups']:.1%}); validation perplexity "
        f"{before['perplexity']:.2f} -> {after['perplexity']:.2f}"
    )
    return StageResult(metrics, ["prune.json", "llmcompressor_recipe.yaml"], summary)
