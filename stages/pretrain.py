"""Stage P — pretrain the tiers a preset has no checkpoint for (the CPU ``tiny`` preset).

Each trained tier starts either from a fresh ``LlamaConfig`` (``arch``: random weights, the
family's tokenizer) or from a pretrained model's embeddings, some of its decoder layers, norm and
head (``init_from`` + ``keep_layers``: layer dropping), and is trained by axolotl on stage 0's
train split in the family's chat format (every token trained). A pretrained model can join the
family as-is (``pretrained``: e.g. ../shared's bench family, whose tokenizer is stories260K's),
saved again in float32; one tokenizer serves every tier — speculative decoding needs it.

Outputs: ``<tier>/`` (transformers checkpoints with the tokenizer), ``axolotl/<tier>.yaml`` (the
configs that ran), ``logs/<tier>.log``, ``family.json`` (parameters and validation perplexity of
every tier) and ``family.md``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from core.hashing import file_sha256
from methods.measure import lm
from methods.training import axolotl
from methods.training.chat import axolotl_dataset, load_split, messages, write_jsonl
from methods.training.models import (
    TOKENIZER_FILES,
    copy_tokenizer,
    init_llama,
    resave_float32,
    tokenizer_files,
    tokenizer_type,
    truncate_llama,
)
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch")

log = logging.getLogger("kibidango.stage.P")


class Architecture(StageConfig):
    hidden_size: int = Field(gt=0, description="Width of the residual stream (embedding size).")
    num_hidden_layers: int = Field(gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads per layer (hidden_size must divide by it).")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads per layer (grouped-query attention).")
    intermediate_size: int = Field(gt=0, description="Width of each layer's gated MLP.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest context the tier is built for (RoPE).")
    init_seed: int = Field(0, description="Seed of the random initial weights.")


class TierPlan(StageConfig):
    arch: Architecture | None = Field(None, description="Random initial weights of this shape.")
    init_from: str | None = Field(
        None, description="A pretrained model directory whose embeddings, `keep_layers`, norm and head start the tier."
    )
    keep_layers: list[int] | None = Field(None, description="init_from: its decoder layers to keep, in order.")
    train: TrainRecipe = Field(description="The tier's pre-training run (axolotl): steps, learning rate, batch.")

    @model_validator(mode="after")
    def _one_start(self) -> TierPlan:
        if (self.arch is None) == (self.init_from is None) or (self.init_from is None) != (self.keep_layers is None):
            raise ValueError("a trained tier starts from `arch` (random) or from `init_from` with `keep_layers`")
        return self


class Config(StageConfig):
    tokenizer: str = Field(description="Directory of the family's tokenizer (HF files).")
    pretrained: dict[str, str] = Field(
        default_factory=dict, description="Tier name -> a pretrained HF model directory that joins the family as-is."
    )
    tiers: dict[str, TierPlan] = Field(default_factory=dict, description="Tiers trained here, e.g. the qualifier.")

    @model_validator(mode="after")
    def _tiers(self) -> Config:
        both = set(self.pretrained) & set(self.tiers)
        if both:
            raise ValueError(f"tier {sorted(both)[0]!r} is both `pretrained` and trained in `tiers`")
        if not self.pretrained and not self.tiers:
            raise ValueError("the family needs at least one tier (`pretrained` or `tiers`)")
        return self

    eval_rows: int = Field(300, gt=0, description="Validation rows the perplexity is measured on.")
    eval_max_len: int = Field(256, gt=8, description="Tokens per validation row (truncated).")


def external_inputs(cfg: Config) -> dict[str, str]:
    digests = {}
    tok = Path(cfg.tokenizer)
    if not tokenizer_files(tok):
        raise KibidangoError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tok} (config key 'tokenizer')")
    for f in tokenizer_files(tok):
        digests[f"tokenizer/{f.name}"] = file_sha256(f)
    models = {f"pretrained.{n}": p for n, p in cfg.pretrained.items()}
    models |= {f"tiers.{n}.init_from": t.init_from for n, t in cfg.tiers.items() if t.init_from}
    for key, where in models.items():
        model = Path(where)
        if not (model / "config.json").is_file():
            raise KibidangoError(f"{key}: {model} is not a transformers model directory (no config.json)")
        for f in sorted(model.iterdir()):
            if f.is_file():
                digests[f"{key}/{f.name}"] = file_sha256(f)
    return digests


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    return {
        name: axolotl.render(
            plan.train,
            f"<work>/{name}/init",
            [_dataset("<work>/data/train.jsonl")],
            f"<work>/{name}",
            tokenizer_type=tokenizer_type(cfg.tokenizer),
            cuda=cuda,
        )
        for name, plan in cfg.tiers.items()
    }


def _dataset(path: str) -> dict:
    return axolotl_dataset(path, roles=("user", "assistant"), train_on_eos="all")  # pretraining: every token


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    tok_dir = Path(cfg.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    data = inputs["data"] / "dataset"
    train_rows = load_split(data, "train")
    data_file = work_dir / "data" / "train.jsonl"
    n = write_jsonl(data_file, ({"messages": messages(r)} for r in train_rows))
    log.info(f"pretraining data: {n:,} rows of stage 0's train split ({data_file})")
    dataset = _dataset(str(data_file))

    family: dict[str, Path] = {}
    for name, where in cfg.pretrained.items():
        family[name] = resave_float32(Path(where), tok_dir, out_dir / name)
        log.info(f"tier {name}: {where} joins the family as-is (float32)")
    metrics: dict[str, float] = {}
    (out_dir / "axolotl").mkdir(parents=True)
    (out_dir / "logs").mkdir()
    for name, plan in cfg.tiers.items():
        run_dir = work_dir / name
        init = run_dir / "init"
        if not (init / "config.json").is_file():
            if plan.arch is not None:
                arch = plan.arch.model_dump(exclude={"init_seed"})
                init_llama(arch, tokenizer, tok_dir, init, plan.arch.init_seed)
            else:
                truncate_llama(Path(plan.init_from), plan.keep_layers, tok_dir, init)
                log.info(f"tier {name}: starts from layers {plan.keep_layers} of {plan.init_from}")
        spec = axolotl.render(plan.train, str(init), [dataset], str(run_dir), tokenizer_type=tokenizer_type(init))
        (out_dir / "axolotl" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        last = axolotl.train(spec, run_dir, f"P/{name}", gpus=plan.train.gpus)
        shutil.copy2(run_dir / "axolotl.log", out_dir / "logs" / f"{name}.log")
        family[name] = axolotl.trained_files(run_dir, out_dir / name)
        copy_tokenizer(tok_dir, family[name])
        metrics[f"{name}_train_loss"] = last.get("loss", float("nan"))

    val = load_split(data, "validation", limit=cfg.eval_rows)
    table = {}
    for name, path in family.items():
        model = lm.load_causal_lm(path)
        res = lm.response_loss(model, tokenizer, val, cfg.eval_max_len)
        table[name] = {
            "parameters": lm.parameters(model),
            "val_loss": res["loss"],
            "val_perplexity": res["perplexity"],
            "source": _source(cfg, name),
        }
        metrics[f"{name}_parameters"] = float(table[name]["parameters"])
        metrics[f"{name}_val_perplexity"] = res["perplexity"]
    (out_dir / "family.json").write_text(json.dumps(table, indent=2))
    lines = ["| tier | parameters | validation perplexity | source |", "|---|---:|---:|---|"]
    lines += [
        f"| {name} | {t['parameters']:,} | {t['val_perplexity']:.2f} | {t['source']} |" for name, t in table.items()
    ]
    report = "\n".join(lines)
    (out_dir / "family.md").write_text(
        f"# Stage P — the family\n\nValidation: {len(val)} rows of stage 0's validation split.\n\n{report}\n"
    )
    return StageResult(
        metrics,
        ["family.md", "family.json", *[f"axolotl/{n}.yaml" for n in cfg.tiers]],
        summary="family:\n" + report,
    )


def _source(cfg: Config, tier: str) -> str:
    """Where a tier's weights came from, for the family table."""
    if tier in cfg.pretrained:
        return f"`{cfg.pretrained[tier]}` as-is"
    plan = cfg.tiers[tier]
    start = "random weights" if plan.arch is not None else f"layers {plan.keep_layers} of `{plan.init_from}`"
    return f"{start}, then {plan.train.max_steps} steps here"
