"""Stages 3-5 — domain modifiers: one LoRA adapter per domain, trained by axolotl on that domain's
slice of stage 0 and, where a ``pairs`` input is wired, the domain's corrected pairs from the
cascaded teachers (1D), on top of the student (the retrained 1R target, or 1A's). Stage ids 3, 4 and 5 run this module
with different ``domain`` configs, so each adapter is its own cached, forceable stage.

Measured: the domain's validation loss with and without the adapter, and the general (all
domains) validation loss with it, so a modifier that hurts everything else shows.

Outputs: ``adapter/`` (peft format: adapter_config.json + adapter_model.safetensors),
``adapter.gguf`` (llama.cpp LoRA, converted with llama.cpp's own converter), ``adapter.json`` (the
manifest the runtime reads to lazy-load the adapter: domain, base, formats, files, figures),
``axolotl.yaml``, ``logs/train.log``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from methods.failures import read_jsonl
from methods.llama_cpp_tools import convert_lora_to_gguf
from methods.measure import lm
from methods.training import axolotl
from methods.training.adapter_manifest import write_adapter_manifest
from methods.training.chat import axolotl_dataset, axolotl_template, load_split, messages, write_jsonl
from methods.training.models import resolve_base, tokenizer_type
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft")

log = logging.getLogger("kibidango.stage.domain")


class Config(StageConfig):
    domain: str = Field(description="Stage-0 domain this adapter specialises in (general, code, math).")
    base_model: str | None = Field(
        None, description="Hub id or directory of the base; None: the `base` input's `tier`."
    )
    tier: str = Field("target", description="Tier of the `base` input the adapter modifies.")
    train: TrainRecipe
    max_train_rows: int | None = Field(None, gt=0)
    pair_repeats: int = Field(
        2, ge=1, description="With a `pairs` input (stage 1D): each corrected pair of the domain appears this often."
    )
    eval_rows: int = Field(200, gt=0, description="Validation rows of the domain (and of all domains) for the loss.")
    eval_max_len: int = Field(256, gt=8)
    gguf: bool = Field(True, description="Also write the adapter as a llama.cpp GGUF LoRA.")

    @model_validator(mode="after")
    def _lora(self) -> Config:
        if self.train.adapter != "lora" or self.train.merge_lora:
            raise ValueError(
                "a domain modifier is an unmerged LoRA: set train.adapter: lora and train.merge_lora: false"
            )
        return self


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    base = cfg.base_model or f"<stage 1A artifact>/{cfg.tier}"
    return {
        f"lora-{cfg.domain}": axolotl.render(
            cfg.train, base, [axolotl_dataset(f"<work>/data/{cfg.domain}.jsonl")], "<work>/lora", cuda=cuda
        )
    }


def _pairs(pairs_dir: Path | None, domain: str) -> list[dict]:
    """The domain's corrected pairs of stage 1D (instruction, input, output), if wired."""
    if pairs_dir is None:
        return []
    return [p for p in read_jsonl(pairs_dir / "pairs.jsonl", "the pairs input (stage 1D)") if p["domain"] == domain]


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    base = resolve_base(cfg.base_model, inputs.get("base"), cfg.tier, f"domain {cfg.domain}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = inputs["data"] / "dataset"
    train_rows = load_split(data, "train", domain=cfg.domain, limit=cfg.max_train_rows)
    if not train_rows:
        raise KibidangoError(f"domain {cfg.domain!r}: stage 0's train split ({data}) has no rows of this domain")
    pairs = _pairs(inputs.get("pairs"), cfg.domain)
    data_file = work_dir / "data" / f"{cfg.domain}.jsonl"
    mix = [*train_rows, *(p for p in pairs for _ in range(cfg.pair_repeats))]
    write_jsonl(data_file, ({"messages": messages(r)} for r in mix))
    log.info(f"domain {cfg.domain}: {len(train_rows):,} training rows + {len(pairs):,} corrected pairs from 1D")

    spec = axolotl.render(
        cfg.train,
        base,
        [axolotl_dataset(str(data_file))],
        str(work_dir / "lora"),
        tokenizer_type=tokenizer_type(base),
        chat_template=axolotl_template(base),
    )
    (out_dir / "axolotl.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    last = axolotl.train(spec, work_dir / "lora", f"lora-{cfg.domain}", gpus=cfg.train.gpus)
    (out_dir / "logs").mkdir()
    shutil.copy2(work_dir / "lora" / "axolotl.log", out_dir / "logs" / "train.log")
    adapter = axolotl.trained_files(work_dir / "lora", out_dir / "adapter")
    if not (adapter / "adapter_config.json").is_file():
        raise KibidangoError(
            f"domain {cfg.domain}: axolotl wrote no adapter_config.json; see {out_dir / 'logs' / 'train.log'}"
        )

    own = load_split(data, "validation", domain=cfg.domain, limit=cfg.eval_rows)
    every = load_split(data, "validation", limit=cfg.eval_rows)
    plain, tuned = lm.load_causal_lm(base), lm.load_causal_lm(base, adapter=adapter)
    metrics = {
        "domain_val_loss_base": lm.response_loss(plain, tokenizer, own, cfg.eval_max_len)["loss"],
        "domain_val_loss_adapter": lm.response_loss(tuned, tokenizer, own, cfg.eval_max_len)["loss"],
        "all_val_loss_base": lm.response_loss(plain, tokenizer, every, cfg.eval_max_len)["loss"],
        "all_val_loss_adapter": lm.response_loss(tuned, tokenizer, every, cfg.eval_max_len)["loss"],
        "train_rows": float(len(train_rows)),
        "corrected_pairs": float(len(pairs)),
        "domain_val_rows": float(len(own)),
        "train_loss_final": last.get("loss", float("nan")),
    }
    metrics["domain_val_loss_delta"] = metrics["domain_val_loss_adapter"] - metrics["domain_val_loss_base"]

    files = {"peft": ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]}
    if cfg.gguf and Path(base).is_dir():
        convert_lora_to_gguf(adapter, base, out_dir / "adapter.gguf", "f32")
        files["gguf"] = ["adapter.gguf"]
    write_adapter_manifest(
        out_dir,
        files,
        domain=cfg.domain,
        base_tier=cfg.tier,
        base_model=base,
        lora=cfg.train.lora.model_dump(),
        metrics=metrics,
    )
    summary = (
        f"domain {cfg.domain}: validation loss {metrics['domain_val_loss_base']:.3f} -> "
        f"{metrics['domain_val_loss_adapter']:.3f} with the adapter ({len(own)} rows); all domains "
        f"{metrics['all_val_loss_base']:.3f} -> {metrics['all_val_loss_adapter']:.3f}"
    )
    return StageResult(metrics, ["adapter.json", "axolotl.yaml"], summary)
