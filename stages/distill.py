"""Stage 1E — distil the draft and the qualifier from the target (offline top-k KD).

1. The teacher (the ``teacher`` input's tier, stage 1A's target) scores the distillation set (stage
   0's train split in the model's chat format; with ``own_outputs``, also the teacher's own answers
   to stage 0's instructions: sequence-level KD): its top-k log-probabilities at every position
   are written to ``teacher/logprobs.jsonl`` — the format of axolotl's KD plugin
   (``axolotl.integrations.kd.chat_template``: ``messages``, ``target_token_ids``, ``logprobs``).
2. Each student (initial weights: the ``family`` input's tier of the same name, ``init``, or the
   teacher's own embeddings, chosen decoder layers, norm and head: ``keep_layers``) is trained by
   axolotl with the KD plugin (``kd_trainer``, ``kd_alpha``, ``kd_ce_alpha``, ``kd_temperature``).
   Before the first student trains, ``axolotl preprocess`` runs and the token ids it produced are
   checked against the ids the teacher scored: misaligned log-probabilities would train silently on
   garbage. The other students share its data, chat template and tokenizer files; their own runs'
   prepared ids are checked the same way after training, before their weights are kept (a
   preprocessing launch each would cost as much as the check saves).
3. Before and after KD, on held-out prompts (validation split): greedy agreement with the target
   and expected acceptance sum_x min(p_T, p_D) per position on the target's greedy path, the
   runtime's real ``sd`` and ``pyramid`` acceptance rates, and validation perplexity.

Outputs: ``<student>/`` (transformers checkpoints + tokenizer), ``teacher/logprobs.jsonl`` (and
``teacher/own_outputs.jsonl``), ``axolotl/<student>.yaml``, ``logs/``, ``family.json`` and
``family.md`` (the tier table).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import yaml
from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.measure import lm
from methods.training import axolotl
from methods.training.chat import axolotl_template, load_split, messages, prompt_ids
from methods.training.kd import KDLoss, check_alignment, fitting_examples, kd_dataset, teacher_logprobs
from methods.training.models import (
    copy_tokenizer,
    resolve_base,
    right_padded_tokenizer,
    tokenizer_type,
    truncate_llama,
)
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch")

log = logging.getLogger("kibidango.stage.1E")


class Student(StageConfig):
    init: str | None = Field(
        None,
        description="Hub id or directory of the student's initial weights; None: the `family` input's tier of this "
        "name.",
    )
    keep_layers: list[int] | None = Field(
        None,
        description="Initialise from the teacher instead: its embeddings, these decoder layers in this order, its "
        "final norm and head (layer dropping: a student of a pretrained model without a smaller sibling).",
    )
    train: TrainRecipe = Field(description="The fine-tune (axolotl): steps, learning rate, warm-up, batch.")

    @model_validator(mode="after")
    def _one_init(self) -> Student:
        if self.init is not None and self.keep_layers is not None:
            raise ValueError("set `init` or `keep_layers`, not both")
        return self


class OwnOutputs(StageConfig):
    """Sequence-level KD (Kim & Rush 2016): the teacher's own answers as distillation rows."""

    rows: int = Field(gt=0, description="Instructions of stage 0's train split (from its end) the teacher answers.")
    max_new_tokens: int = Field(96, gt=0, description="Tokens per answer (it ends earlier at end of sequence).")
    temperature: float = Field(0.0, ge=0, description="0: greedy answers; above: sampled, seeded per batch.")
    seed: int = Field(0, description="Seed of the sampling of the target's own answers.")
    batch: int = Field(
        1, ge=1, le=64, description="Answers generated together (left-padded; greedy may differ at near-ties)."
    )


class Config(StageConfig):
    teacher_tier: str = Field("target", description="Tier of the `teacher` input that teaches.")
    students: dict[str, Student] = Field(description="Tiers distilled from the teacher: draft, qualifier.")
    kd: KDLoss = Field(description="The distillation loss: top-k kept, KD and cross-entropy weights, temperature.")
    distill_rows: int = Field(
        1000,
        gt=0,
        description="Rows of stage 0's train split in the distillation set (those that fit in sequence_len).",
    )
    sequence_len: int = Field(256, gt=8, description="Tokens per distillation sequence (truncated).")
    own_outputs: OwnOutputs | None = Field(
        None,
        description="Also distil on the teacher's own answers to stage 0's instructions (sequence-level KD, beside "
        "the token-level KD on the data's answers): generated once per run, kept in the work directory while an "
        "interrupted run resumes, shipped as teacher/own_outputs.jsonl.",
    )
    eval_prompts: int = Field(48, gt=0, description="Held-out prompts (validation split) for agreement and acceptance.")
    eval_new_tokens: int = Field(32, gt=0, description="Tokens of the target's greedy path scored per prompt.")
    eval_rows: int = Field(300, gt=0, description="Validation rows for perplexity.")
    runtime_eval: bool = Field(
        True, description="Also measure the runtime's sd / pyramid acceptance (needs draft, qualifier and the target)."
    )


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    return {
        name: axolotl.render(
            s.train,
            s.init or (f"<teacher's layers {s.keep_layers}>" if s.keep_layers else f"<stage P artifact>/{name}"),
            [kd_dataset("<artifact>/teacher/logprobs.jsonl")],
            f"<work>/{name}",
            extra={**cfg.kd.axolotl_keys(), "tokenizer_config": f"<work>/{name}/tokenizer"},
            cuda=cuda,
        )
        for name, s in cfg.students.items()
    }


def own_outputs(teacher, tokenizer, rows: list[dict], spec: OwnOutputs, path: Path) -> list[dict]:
    """The teacher's answers to the instructions of ``rows`` (taken from the end; plain texts
    skipped), as stage-0 rows with the teacher's text as ``output``; read back from ``path`` when an
    interrupted run wrote them already, else generated and written there."""
    if path.is_file():
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = [r for r in reversed(rows) if r["instruction"]][: spec.rows]
    progress = Progress("1E the teacher's own answers", len(chosen), log)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sample = spec.temperature > 0
    out = []
    with torch.inference_mode():
        for start in range(0, len(chosen), spec.batch):
            group = chosen[start : start + spec.batch]
            prompts = [prompt_ids(tokenizer, messages(row)[:-1]) for row in group]
            width = max(len(p) for p in prompts)
            x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=teacher.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=teacher.device)
            if sample:
                torch.manual_seed(spec.seed + start)
            new = teacher.generate(
                x,
                attention_mask=mask,
                max_new_tokens=spec.max_new_tokens,
                do_sample=sample,
                **({"temperature": spec.temperature, "top_k": 0} if sample else {}),
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )[:, width:].tolist()
            for row, tokens in zip(group, new):
                if tokenizer.eos_token_id in tokens:  # what follows is the batch's padding
                    tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
                text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                if text:
                    out.append({**{k: row[k] for k in ("id", "instruction", "input", "domain")}, "output": text})
            progress.update(start + len(group))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    tmp.replace(path)
    return out


def _measure(tiers: dict, tokenizer, val: list[dict], paths, prompts, cfg: Config, tag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    teacher = tiers[cfg.teacher_tier]
    for name, model in tiers.items():
        out[f"{name}_val_perplexity_{tag}"] = lm.response_loss(model, tokenizer, val, cfg.sequence_len)["perplexity"]
        if name != cfg.teacher_tier:
            for k, v in lm.agreement(teacher, model, paths).items():
                if k != "positions":
                    out[f"{name}_{k}_{tag}"] = v
    if cfg.runtime_eval and {"draft", "qualifier"} <= tiers.keys():
        runtime = lm.runtime_acceptance(
            {"draft": tiers["draft"], "qualifier": tiers["qualifier"], "target": teacher}, prompts, cfg.eval_new_tokens
        )
        out |= {f"{k}_{tag}": v for k, v in runtime.items()}
    return out


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from transformers import AutoTokenizer

    teacher_dir = resolve_base(None, inputs["teacher"], cfg.teacher_tier, "teacher")
    inits = {
        name: truncate_llama(Path(teacher_dir), s.keep_layers, Path(teacher_dir), work_dir / "init" / name)
        if s.keep_layers is not None
        else resolve_base(s.init, inputs.get("family"), name, f"student {name}")
        for name, s in cfg.students.items()
    }
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    for name, path in inits.items():
        if len(AutoTokenizer.from_pretrained(path)) != len(tokenizer):
            raise KibidangoError(f"student {name!r} ({path}) does not share the teacher's tokenizer ({teacher_dir})")
    data = inputs["data"] / "dataset"
    teacher = lm.load_causal_lm(teacher_dir)

    train = load_split(data, "train")
    examples = fitting_examples(tokenizer, train, cfg.sequence_len, cfg.distill_rows)
    if not examples:
        raise KibidangoError(f"no train row of {data} fits in sequence_len {cfg.sequence_len}")
    log.info(f"distillation set: {len(examples):,} rows that fit in {cfg.sequence_len} tokens")
    data_rows = len(examples)
    if cfg.own_outputs is not None:
        answers = own_outputs(teacher, tokenizer, train, cfg.own_outputs, work_dir / "own_outputs.jsonl")
        (out_dir / "teacher").mkdir(parents=True, exist_ok=True)
        shutil.copy2(work_dir / "own_outputs.jsonl", out_dir / "teacher" / "own_outputs.jsonl")
        own = fitting_examples(tokenizer, answers, cfg.sequence_len)
        examples += own
        log.info(f"distillation set: + {len(own):,} of the teacher's own answers (sequence-level KD)")
    logprobs_file = out_dir / "teacher" / "logprobs.jsonl"
    teacher_logprobs(teacher, examples, cfg.kd.top_k, logprobs_file, "1E")
    scored = [ids for _, ids in examples]

    val = load_split(data, "validation", limit=cfg.eval_rows)
    prompts = lm.held_out_prompts(tokenizer, val[: cfg.eval_prompts])
    paths = lm.target_paths(teacher, prompts, cfg.eval_new_tokens)
    before_tiers = {cfg.teacher_tier: teacher} | {n: lm.load_causal_lm(p) for n, p in inits.items()}
    metrics = _measure(before_tiers, tokenizer, val, paths, prompts, cfg, "before")
    params = {n: lm.parameters(m) for n, m in before_tiers.items()}

    (out_dir / "axolotl").mkdir()
    (out_dir / "logs").mkdir()
    after_tiers = {cfg.teacher_tier: teacher}
    for i, (name, student) in enumerate(cfg.students.items()):
        run_dir = work_dir / name
        tok_dir = right_padded_tokenizer(inits[name], run_dir / "tokenizer")
        if AutoTokenizer.from_pretrained(str(tok_dir)).padding_side != "right":
            raise KibidangoError(f"could not make {tok_dir} pad on the right (axolotl's KD collator needs it)")
        spec = axolotl.render(
            student.train,
            str(inits[name]),  # a Path (a student cut from the teacher's layers) would not survive yaml.safe_dump
            [kd_dataset(str(logprobs_file))],
            str(run_dir),
            extra={**cfg.kd.axolotl_keys(), "tokenizer_config": str(tok_dir)},
            tokenizer_type=tokenizer_type(tok_dir),
            chat_template=axolotl_template(tok_dir),
        )
        (out_dir / "axolotl" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        if i == 0:  # fail before any training: a launch of its own (~45 s on a CPU) that only tokenizes
            axolotl.train(spec, run_dir, f"1E/{name}", preprocess_only=True)
            check_alignment(run_dir / "prepared", scored, f"1E/{name}")
        last = axolotl.train(spec, run_dir, f"1E/{name}", gpus=student.train.gpus)
        if i > 0:  # the first student's data, template and tokenizer files: checked on what its run prepared
            check_alignment(run_dir / "prepared", scored, f"1E/{name}")
        shutil.copy2(run_dir / "axolotl.log", out_dir / "logs" / f"{name}.log")
        model_dir = axolotl.trained_files(run_dir, out_dir / name)
        copy_tokenizer(Path(teacher_dir), model_dir)
        metrics[f"{name}_train_loss_final"] = last.get("loss", float("nan"))
        after_tiers[name] = lm.load_causal_lm(model_dir)
    metrics |= _measure(after_tiers, tokenizer, val, paths, prompts, cfg, "after")
    metrics["eval_prompts"] = float(len(prompts))
    metrics["distill_rows"] = float(len(examples))
    metrics["own_output_rows"] = float(len(examples) - data_rows)

    table = family_table(params, metrics, cfg)
    (out_dir / "family.json").write_text(json.dumps({"parameters": params, "metrics": metrics}, indent=2))
    (out_dir / "family.md").write_text(
        f"# Stage 1E — the family before and after distillation\n\n{len(prompts)} held-out prompts (stage 0 validation "
        f"split), {cfg.eval_new_tokens} tokens of the target's greedy path each; perplexity on {len(val)} validation "
        "rows.\n\n"
        f"{table}\n"
    )
    return StageResult(
        metrics,
        ["family.md", "family.json", *[f"axolotl/{n}.yaml" for n in cfg.students]],
        summary="family (before KD -> after KD):\n" + table,
    )


def family_table(params: dict[str, int], m: dict[str, float], cfg: Config) -> str:
    def pair(key: str) -> str:
        b, a = m.get(f"{key}_before"), m.get(f"{key}_after")
        return "-" if b is None else (f"{b:.3f} -> {a:.3f}" if a is not None and a != b else f"{b:.3f}")

    lines = [
        "| tier | parameters | validation perplexity | greedy agreement vs target | expected acceptance vs target |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in [*cfg.students, cfg.teacher_tier]:
        ppl_b, ppl_a = m[f"{name}_val_perplexity_before"], m.get(f"{name}_val_perplexity_after")
        ppl = f"{ppl_b:.2f} -> {ppl_a:.2f}" if name in cfg.students else f"{ppl_b:.2f}"
        lines.append(
            f"| {name} | {params[name]:,} | {ppl} | {pair(f'{name}_agreement')} | "
            f"{pair(f'{name}_expected_acceptance')} |"
        )
    if "sd_acceptance_rate_before" in m:
        lines += ["", "| runtime (greedy) | before KD | after KD |", "|---|---:|---:|"]
        for key in (
            "sd_acceptance_rate",
            "sd_mean_acceptance_length",
            "pyramid_draft_acceptance_rate",
            "pyramid_qualifier_acceptance_rate",
            "pyramid_target_forwards_per_token",
        ):
            lines.append(f"| {key} | {m[f'{key}_before']:.3f} | {m[f'{key}_after']:.3f} |")
    return "\n".join(lines)
