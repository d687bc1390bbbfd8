"""Stages 3-5 — domain modifiers: one LoRA adapter per domain, trained by axolotl on that domain's
slice of stage 0 and, where a ``pairs`` input is wired, the domain's corrected pairs from the
cascaded teachers (1D), on top of the student (the retrained 1R target, or 1A's). Stage ids 3, 4 and 5 run this module
with different ``domain`` configs, so each adapter is its own cached, forceable stage.

Measured: the domain's validation loss with and without the adapter, and the general (all
domains) validation loss with it, so a modifier that hurts everything else shows. With a ``check``
(held-out tasks of the domain: the ladder's mining part or benchmark mining halves, less every
task 1B mined — the ``mined`` input — so none the pairs came from), the target answers each task
with and without the adapter; the adapter **ships** only when it passes more of them than the
weights it modifies by an exact McNemar test (p < ``ship_p``): ``adapter.json`` says so, and
stages 6A (routing), 2G (calibration) and X (the bundle) leave out an adapter that does not ship.

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
from methods.evaluation import mcnemar
from methods.failures import answered_tasks, read_jsonl, task_record, training_texts, verdict_record
from methods.heldout import HeldOutTasks, answer_and_judge, select_tasks
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
    train: TrainRecipe = Field(description="The LoRA fine-tune (axolotl): steps, learning rate, warm-up, batch.")
    max_train_rows: int | None = Field(None, gt=0, description="Most training rows of the domain (None: all).")
    pair_repeats: int = Field(
        2, ge=1, description="With a `pairs` input (stage 1D): each corrected pair of the domain appears this often."
    )
    eval_rows: int = Field(200, gt=0, description="Validation rows of the domain (and of all domains) for the loss.")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )
    gguf: bool = Field(True, description="Also write the adapter as a llama.cpp GGUF LoRA.")
    check: HeldOutTasks | None = Field(
        None,
        description="Held-out tasks of the domain (mining part; 1B's mined tasks excluded) the target answers with "
        "and without the adapter: it ships only when it passes more (exact McNemar, p < ship_p). None: unchecked.",
    )
    ship_p: float = Field(0.05, gt=0, le=1, description="The McNemar p below which a better adapter ships.")

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
    fields = {"domain": cfg.domain, "base_tier": cfg.tier, "base_model": base, "lora": cfg.train.lora.model_dump()}
    write_adapter_manifest(out_dir, files, **fields, metrics=metrics)
    check = None
    if cfg.check is not None:
        check = _check(cfg, base, out_dir, data, inputs.get("mined"), work_dir)
        metrics.update({f"check/{k}": float(v) for k, v in check.items() if isinstance(v, int | float)})
        write_adapter_manifest(out_dir, files, **fields, metrics=metrics, ships=check["ships"], check=check)
    summary = (
        f"domain {cfg.domain}: validation loss {metrics['domain_val_loss_base']:.3f} -> "
        f"{metrics['domain_val_loss_adapter']:.3f} with the adapter ({len(own)} rows); all domains "
        f"{metrics['all_val_loss_base']:.3f} -> {metrics['all_val_loss_adapter']:.3f}"
        + (
            f"; held-out tasks {check['base_passes']}/{check['tasks']} -> {check['adapter_passes']}/{check['tasks']} "
            f"(p={check['p']:.3f}): {'ships' if check['ships'] else 'NOT shipped'}"
            if check
            else ""
        )
    )
    return StageResult(metrics, ["adapter.json", "axolotl.yaml"], summary)


def _check(cfg: Config, base: str, out_dir: Path, data: Path, mined: Path | None, work_dir: Path) -> dict:
    """The domain's held-out tasks answered with and without the adapter: passes, the exact McNemar
    test, and whether it ships."""
    from methods.measure.generate import ScoredAnswerer, once

    seen = training_texts(load_split(data, "train"))
    exclude = answered_tasks(mined, "the mined input (stage 1B)")[1] if mined is not None else frozenset()
    rows, _ = select_tasks(cfg.check, data, seen, exclude)
    rows = [r for r in rows if r["domain"] == cfg.domain]
    if not rows:
        raise KibidangoError(f"domain {cfg.domain}: the check has no held-out task of this domain")
    answerer = once(lambda: ScoredAnswerer(base, cfg.check.max_new_tokens, [out_dir], parallel=cfg.check.parallel))
    verdicts = {}
    try:
        for arm, adapter in (("base", None), ("adapter", cfg.domain)):

            def answer(row: dict, prior: dict | None, judge, adapter=adapter) -> dict:
                text = (
                    prior["answer"] if prior else answerer().answer(row["instruction"], row["input"], adapter)[0].text
                )
                v = verdict_record(judge(row["task"], text), judge.kind)
                return {**task_record(row), "answer": text, **v}

            table, _ = answer_and_judge(
                cfg.check, rows, work_dir / "check" / arm, f"{cfg.domain} check ({arm})", answer
            )
            verdicts[arm] = {r["id"]: r["passed"] for r in table if r["outcome"] != "judge_error"}
    finally:
        answerer.close()
    test = mcnemar(verdicts["adapter"], verdicts["base"])
    better = test["a_only"] > test["b_only"] and test["p"] < cfg.ship_p
    return {
        "tasks": test["n"],
        "base_passes": sum(verdicts["base"].values()),
        "adapter_passes": sum(verdicts["adapter"].values()),
        "adapter_only": test["a_only"],
        "base_only": test["b_only"],
        "p": test["p"],
        "ships": bool(better),
    }
