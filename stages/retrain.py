"""Stage 1R — the retraining round: the student is fine-tuned on 1D's corrected pairs mixed with a
replay share of stage 0's training rows (axolotl, 1A's engine and recipe format), and its failure
rate is measured with 1B's judges on the critical failures 1D held out (never sent to a teacher,
never trained on), before and after.

The output is a student of the same shape as 1A's (``<tier>/``), which the presets wire into
distillation (1E), the domain modifiers (3-5) and compression (2A, 2F).

Outputs: ``<tier>/``, ``axolotl.yaml``, ``logs/train.log``, ``retrain.json``, ``RETRAIN_CARD.md``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.failures import failure_rate, mined_judges, read_jsonl, sample, task_of
from methods.measure import lm
from methods.training import axolotl
from methods.training.chat import axolotl_dataset, load_split, messages, write_jsonl
from methods.training.finetune import fine_tune
from methods.training.recipe import TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft", "sacrebleu")

log = logging.getLogger("kibidango.stage.1R")


class Config(StageConfig):
    tier: str = Field("target", description="Tier directory of the `student` input (stage 1A's output).")
    tokenizer_type: str | None = Field(None, description="axolotl tokenizer_type (None: from the student's files).")
    replay_share: float = Field(
        0.5, ge=0, lt=1, description="Share of the training mix drawn from stage 0's train split (forgetting guard)."
    )
    pair_repeats: int = Field(1, ge=1, description="Each corrected pair appears this many times in the mix.")
    seed: int = Field(0, description="Which replay rows are drawn.")
    train: TrainRecipe
    max_new_tokens: int = Field(96, gt=0, description="Tokens the student may write per held-out answer.")
    eval_rows: int = Field(300, gt=0, description="Stage-0 validation rows the loss is measured on (forgetting).")
    eval_max_len: int = Field(256, gt=8)


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    """The axolotl YAML this stage runs, with placeholders for paths known only at run time."""
    return {
        "retrain": axolotl.render(
            cfg.train,
            f"<stage 1A artifact>/{cfg.tier}",
            [axolotl_dataset("<work>/data/train.jsonl")],
            "<work>/sft",
            tokenizer_type=cfg.tokenizer_type,
            cuda=cuda,
        )
    }


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    student = inputs["student"] / cfg.tier
    if not (student / "config.json").is_file():
        raise KibidangoError(f"the student input has no transformers checkpoint at {student}")
    pairs = read_jsonl(inputs["pairs"] / "pairs.jsonl", "the pairs input (stage 1D)")
    held = read_jsonl(inputs["pairs"] / "held_out.jsonl", "the pairs input (stage 1D)")
    if not pairs:
        raise KibidangoError(f"no corrected pairs in {inputs['pairs']} (stage 1D answered none): nothing to retrain on")
    leaked = {p["id"] for p in pairs} & {h["id"] for h in held}
    if leaked:
        raise KibidangoError(f"{len(leaked)} held-out failures have corrected pairs (e.g. {sorted(leaked)[0]})")
    judges = mined_judges(inputs["mined"])

    train_rows = [r for r in pairs for _ in range(cfg.pair_repeats)]
    n_replay = round(len(train_rows) * cfg.replay_share / (1 - cfg.replay_share))
    replay = sample(load_split(inputs["data"] / "dataset", "train"), n_replay, cfg.seed, key=lambda r: r["id"])
    data_file = work_dir / "data" / "train.jsonl"
    write_jsonl(data_file, ({"messages": messages(r)} for r in [*train_rows, *replay]))
    log.info(f"retraining on {len(pairs):,} corrected pairs (x{cfg.pair_repeats}) + {len(replay):,} replay rows")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(student))
    val = load_split(inputs["data"] / "dataset", "validation", limit=cfg.eval_rows)
    loss_before = lm.response_loss(lm.load_causal_lm(student), tokenizer, val, cfg.eval_max_len)
    before = _failure_rate(student, held, judges, cfg.max_new_tokens, "before")
    model_dir, last = fine_tune(
        cfg.train, student, data_file, work_dir, out_dir, cfg.tier, "1R/retrain", cfg.tokenizer_type
    )
    after = _failure_rate(model_dir, held, judges, cfg.max_new_tokens, "after")
    loss_after = lm.response_loss(lm.load_causal_lm(model_dir), tokenizer, val, cfg.eval_max_len)

    stats = {
        "command": "make stage-1r",
        "pairs": len(pairs),
        "pair_repeats": cfg.pair_repeats,
        "replay_rows": len(replay),
        "held_out": len(held),
        "before": before,
        "after": after,
        "pair_tiers": dict(Counter(p.get("tier", "?") for p in pairs)),
        "train_loss_final": last.get("loss", float("nan")),
        "val_rows": len(val),
        "val_perplexity_before": loss_before["perplexity"],
        "val_perplexity_after": loss_after["perplexity"],
    }
    (out_dir / "retrain.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    (out_dir / "RETRAIN_CARD.md").write_text(_card(stats))
    metrics = {
        "pairs": len(pairs),
        "replay_rows": len(replay),
        "held_out": len(held),
        "failure_rate_before": before["rate"],
        "failure_rate_after": after["rate"],
        **{f"failure_rate_before/{d}": v["rate"] for d, v in before["domains"].items()},
        **{f"failure_rate_after/{d}": v["rate"] for d, v in after["domains"].items()},
        "train_loss_final": stats["train_loss_final"],
        "val_loss_before": loss_before["loss"],
        "val_loss_after": loss_after["loss"],
        "val_perplexity_before": loss_before["perplexity"],
        "val_perplexity_after": loss_after["perplexity"],
    }
    summary = (
        f"failure rate on {len(held)} held-out critical failures: {before['rate']:.1%} -> {after['rate']:.1%} "
        f"({len(pairs):,} corrected pairs + {len(replay):,} replay rows); validation perplexity "
        f"{loss_before['perplexity']:.2f} -> {loss_after['perplexity']:.2f} ({len(val)} rows: what it forgot)"
    )
    return StageResult(metrics, ["RETRAIN_CARD.md", "retrain.json", "axolotl.yaml"], summary)


def _failure_rate(model_dir: Path, rows: list[dict], judges: dict, max_new_tokens: int, label: str) -> dict:
    """The model's answers to ``rows`` judged by the domain's judge: failures / verdicts."""
    from methods.measure.generate import Answerer

    outcomes: dict[str, Counter] = {}
    if rows:
        answerer = Answerer(model_dir, max_new_tokens)
        progress = Progress(f"1R held-out answers ({label})", len(rows), log)
        for i, r in enumerate(rows, 1):
            verdict = judges[r["domain"]](task_of(r), answerer(r["instruction"], r["input"]).text)
            outcomes.setdefault(r["domain"], Counter())[verdict.outcome] += 1
            progress.update(i)
        progress.finish(len(rows))

    def rate(c: Counter) -> dict:
        value, failed, judged = failure_rate(c.elements())
        return {"judged": judged, "failed": failed, "rate": value, "outcomes": dict(c)}

    total = sum(outcomes.values(), Counter())
    return {**rate(total), "domains": {d: rate(c) for d, c in sorted(outcomes.items())}}


def _card(s: dict) -> str:
    lines = [
        "# Retraining round (stage 1R)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{s['command']}`).",
        "",
        f"Trained on {s['pairs']:,} corrected pairs from stage 1D (x{s['pair_repeats']}; by tier: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["pair_tiers"].items()))
        + f") and {s['replay_rows']:,} replay rows of stage 0's train split.",
        "",
        f"Failure rate on the {s['held_out']:,} critical failures held out by 1D (never taught, never trained on), "
        "judged by 1B's judges:",
        "",
        "| domain | judged | failed before | failed after | rate before | rate after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in sorted(set(s["before"]["domains"]) | set(s["after"]["domains"])):
        b, a = s["before"]["domains"].get(d, {}), s["after"]["domains"].get(d, {})
        lines.append(
            f"| {d} | {b.get('judged', 0)} | {b.get('failed', 0)} | {a.get('failed', 0)} "
            f"| {b.get('rate', 0):.1%} | {a.get('rate', 0):.1%} |"
        )
    b, a = s["before"], s["after"]
    lines += [
        f"| **all** | {b['judged']} | {b['failed']} | {a['failed']} | **{b['rate']:.1%}** | **{a['rate']:.1%}** |",
        "",
        f"Forgetting guard: validation perplexity (response tokens, {s['val_rows']} stage-0 validation rows) "
        f"{s['val_perplexity_before']:.2f} before, {s['val_perplexity_after']:.2f} after.",
        "",
    ]
    return "\n".join(lines)
