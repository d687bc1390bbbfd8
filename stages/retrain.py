"""Stage 1R — the retraining round: the student is fine-tuned on 1D's corrected pairs mixed with a
replay share of stage 0's training rows (axolotl, 1A's engine and recipe format), and its failure
rate is measured with 1B's judges on the critical failures 1D held out (never sent to a teacher,
never trained on), before and after.

Does targeting failures help? The same fine-tune (recipe, steps, replay rows) runs again for each
**control** (``controls``): ``random`` trains on gold answers to as many tasks, per domain, drawn
at random from everything 1B answered (failed or not; the gold tier's answer, judged like a
teacher's) — the plan's claim is that mining failures beats picking tasks blindly; ``replay``
trains on replay rows alone, as many as the whole mix. 1A, every control and 1R then answer the
same held-out **evaluation** tasks (``evaluation``: e.g. the ladder's evaluation part, which no
stage trains or mines on), and 1R is compared with each by an exact McNemar test. The controls'
models stay in the work directory; only their figures are published.

The objective is SFT on the mix, or (``preference``) DPO with the chosen answer's NLL beside it
(RPO, Pang et al. 2024): each corrected pair's rejected answer is the student's own failed answer
from 1B, so the fine-tune both raises the correction and lowers the mistake it replaces; a replay
row (and a control's task the student passed) is its own rejected answer, which leaves it an SFT
row. The controls train with the same objective.

The output is a student of the same shape as 1A's (``<tier>/``), which the presets wire into
distillation (1E), the domain modifiers (3-5) and compression (2A, 2F).

Outputs: ``<tier>/``, ``axolotl.yaml``, ``logs/train.log`` (and ``logs/<control>.log``),
``retrain.json``, ``evaluation.jsonl`` (every model's verdict per task), ``RETRAIN_CARD.md``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.evaluation import EvalSample, evaluation_tasks, mcnemar, mcnemar_power, mined_bands, wilson
from methods.failures import (
    failure_rate,
    loop_mix,
    mined_judges,
    own_passes,
    read_jsonl,
    sample,
    task_of,
    training_texts,
    verdict_record,
)
from methods.heldout import answer_and_judge, parallel_field
from methods.measure import lm
from methods.training import axolotl
from methods.training.chat import axolotl_dataset, load_split, messages, preference_record, write_jsonl
from methods.training.finetune import fine_tune, preference_recipe
from methods.training.recipe import PreferenceSpec, TrainRecipe

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft", "sacrebleu")

log = logging.getLogger("kibidango.stage.1R")


class Config(StageConfig):
    tier: str = Field("target", description="Tier directory of the `student` input (stage 1A's output).")
    tokenizer_type: str | None = Field(None, description="axolotl tokenizer_type (None: from the student's files).")
    replay_share: float = Field(
        0.5, ge=0, lt=1, description="Share of the training mix drawn from stage 0's train split (forgetting guard)."
    )
    replay_own: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the replay rows that are the student's own answers 1B's judges passed (per domain in the "
        "pairs' proportions, as many as 1B has; the rest from stage 0): rehearsal of what it already solves, as "
        "rejection-sampling fine-tuning keeps it, against the corrections unlearning the band's passes (2F's "
        "recovery mix keeps stage 0's rows).",
    )
    pair_repeats: int = Field(1, ge=1, description="Each corrected pair appears this many times in the mix.")
    seed: int = Field(0, description="Which replay rows are drawn.")
    train: TrainRecipe = Field(description="The fine-tune (axolotl): steps, learning rate, warm-up, batch.")
    preference: PreferenceSpec | None = Field(
        None,
        description="None: SFT on the mix. Set: DPO + NLL (axolotl's `rl: dpo`), each taught row's rejected answer "
        "the student's failed answer from 1B; replay rows are drawn from stage 0's prompted rows only (a lone story "
        "has no prompt to prefer a reply to).",
    )
    max_new_tokens: int = Field(96, gt=0, description="Tokens the student may write per held-out answer.")
    parallel: int = parallel_field()
    eval_rows: int = Field(300, gt=0, description="Stage-0 validation rows the loss is measured on (forgetting).")
    eval_max_len: int = Field(
        256, gt=8, description="Tokens per validation row in the perplexity passes (longer rows cut)."
    )
    controls: list[Literal["random", "replay", "gold", "pairs25", "pairs50"]] = Field(
        ["random", "replay"],
        description="Control retrains with the same budget: `random` (gold answers to randomly drawn mined tasks, "
        "per domain as many as the pairs), `replay` (replay rows only), `gold` (the same failures as the pairs, "
        "each with its gold answer: the top tier alone), `pairs25` / `pairs50` (a quarter / half of the pairs, "
        "the same replay rows: the sample-efficiency curve).",
    )
    evaluation: list[EvalSample] = Field(
        default_factory=list,
        description="Held-out evaluation tasks 1A, the controls and 1R all answer (none: no comparison).",
    )


def axolotl_configs(cfg: Config, cuda: bool) -> dict[str, dict]:
    """The axolotl YAML this stage runs, with placeholders for paths known only at run time: the
    preference run when ``preference`` is set, though a mix in which no pair comes from
    ``preference.tiers`` trains by ``train``'s SFT (:func:`_training_file`; the artifact's
    axolotl.yaml is the one that ran)."""
    data = "<work>/data/train.jsonl"
    return {
        "retrain": axolotl.render(
            _recipe(cfg, data),
            f"<stage 1A artifact>/{cfg.tier}",
            [axolotl_dataset(data)],
            "<work>/sft",
            tokenizer_type=cfg.tokenizer_type,
            cuda=cuda,
        )
    }


def _recipe(cfg: Config, data_file: Path | str) -> TrainRecipe:
    """The fine-tune's recipe: 1R's own, or its preference run on ``data_file``."""
    return cfg.train if cfg.preference is None else preference_recipe(cfg.train, cfg.preference, str(data_file))


def _training_file(cfg: Config, tokenizer, path: Path, rows: list[dict]) -> TrainRecipe:
    """Write the fine-tune's rows to ``path`` and return its recipe: SFT on chat rows, or the
    preference run on prompt / chosen / rejected strings (a row without ``rejected`` is its own
    rejected answer) when ``preference`` is set and some row has a rejected answer. A mix with none
    (a control's gold answers under ``preference.tiers``) trains by SFT: its DPO term is zero with no
    gradient, and TRL's ``sft`` loss is the token-mean NLL that SFT minimises, at a quarter of the time
    (no reference model, no rejected replies)."""
    if cfg.preference is None or not any(r.get("rejected") for r in rows):
        write_jsonl(path, ({"messages": messages(r)} for r in rows))
        return cfg.train
    write_jsonl(path, (preference_record(tokenizer, r, r.get("rejected")) for r in rows))
    return _recipe(cfg, path)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    student = inputs["student"] / cfg.tier
    if not (student / "config.json").is_file():
        raise KibidangoError(f"the student input has no transformers checkpoint at {student}")
    pairs, held = _pairs_and_held_out(inputs["pairs"])
    judges = mined_judges(inputs["mined"])

    stage0_train = load_split(inputs["data"] / "dataset", "train")
    if cfg.preference is not None:  # a preference row needs a prompt: lone stories stay out of the replay
        stage0_train = [r for r in stage0_train if r["instruction"] or r["input"]]
    answered = read_jsonl(inputs["mined"] / "answers.jsonl", "the mined input (stage 1B)")
    failed = _failed_answers(answered)
    pairs = _with_rejected(cfg, pairs, failed)
    own = own_passes(answered, {h["id"] for h in held}) if cfg.replay_own > 0 else []
    train_rows, replay = loop_mix(
        pairs, stage0_train, cfg.replay_share, cfg.pair_repeats, cfg.seed, own=own, own_share=cfg.replay_own
    )
    own_ids = {o["id"] for o in own}
    n_own = sum(r["id"] in own_ids for r in replay)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(student))
    data_file = work_dir / "data" / "train.jsonl"
    recipe = _training_file(cfg, tokenizer, data_file, [*train_rows, *replay])
    log.info(
        f"retraining ({_objective(cfg)}) on {len(pairs):,} corrected pairs (x{cfg.pair_repeats}) + "
        f"{len(replay):,} replay rows" + _own(n_own)
    )
    mixes = _control_mixes(cfg, answered, failed, pairs, held, judges, stage0_train, replay)

    val = load_split(inputs["data"] / "dataset", "validation", limit=cfg.eval_rows)
    loss_before = lm.response_loss(lm.load_causal_lm(student), tokenizer, val, cfg.eval_max_len)
    before = _failure_rate(student, held, judges, cfg, "before")
    if "retrained" in inputs:  # the study (`make study-loop`): 1R's own model, not trained again
        model_dir, last = inputs["retrained"] / cfg.tier, {}
        (out_dir / "logs").mkdir(exist_ok=True)
        shutil.copy2(inputs["retrained"] / "axolotl.yaml", out_dir / "axolotl.yaml")
    else:
        model_dir, last = fine_tune(
            recipe, student, data_file, work_dir, out_dir, cfg.tier, "1R/retrain", cfg.tokenizer_type
        )
    after = _failure_rate(model_dir, held, judges, cfg, "after")
    loss_after = lm.response_loss(lm.load_causal_lm(model_dir), tokenizer, val, cfg.eval_max_len)

    models = {"1A": student}  # in the order the card reads: before, the controls, the retrained student
    for name, rows in mixes.items():
        models[name] = _control(cfg, tokenizer, student, name, rows, work_dir, out_dir)
    models["1R"] = model_dir
    comparison = _evaluation(cfg, inputs, models, judges, out_dir, work_dir) if cfg.evaluation else {}

    mining = inputs["mined"] / "mining.json"
    stats = {
        "command": "make stage-1r",
        "round": json.loads(mining.read_text()).get("round", 1) if mining.is_file() else 1,
        "pairs": len(pairs),
        "pair_repeats": cfg.pair_repeats,
        "objective": _objective(cfg),
        "pairs_rejected": sum(p.get("rejected") is not None for p in pairs),
        "replay_rows": len(replay),
        "replay_own_rows": n_own,
        "held_out": len(held),
        "before": before,
        "after": after,
        "pair_tiers": dict(Counter(p.get("tier", "?") for p in pairs)),
        "train_loss_final": last.get("loss", float("nan")),
        "val_rows": len(val),
        "val_perplexity_before": loss_before["perplexity"],
        "val_perplexity_after": loss_after["perplexity"],
        "controls": {name: len(rows) for name, rows in mixes.items()},
        "comparison": comparison,
    }
    (out_dir / "retrain.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    (out_dir / "RETRAIN_CARD.md").write_text(_card(stats))
    return StageResult(
        _metrics(stats, loss_before, loss_after),
        ["RETRAIN_CARD.md", "retrain.json", "axolotl.yaml"],
        _summary(stats),
        tables={"evaluation.json": "evaluation.jsonl"} if comparison else {},
    )


def _pairs_and_held_out(pairs_dir: Path) -> tuple[list[dict], list[dict]]:
    """1D's corrected pairs and the critical failures it held out; a held-out failure with a pair is refused."""
    pairs = read_jsonl(pairs_dir / "pairs.jsonl", "the pairs input (stage 1D)")
    held = read_jsonl(pairs_dir / "held_out.jsonl", "the pairs input (stage 1D)")
    if not pairs:
        raise KibidangoError(f"no corrected pairs in {pairs_dir} (stage 1D answered none): nothing to retrain on")
    leaked = {p["id"] for p in pairs} & {h["id"] for h in held}
    if leaked:
        raise KibidangoError(f"{len(leaked)} held-out failures have corrected pairs (e.g. {sorted(leaked)[0]})")
    return pairs, held


def _failed_answers(answered: list[dict]) -> dict[str, str]:
    """1B's task id -> the student's answer its judges failed."""
    return {a["id"]: a["answer"] for a in answered if a.get("passed") is False and a.get("answer")}


def _with_rejected(cfg: Config, rows: list[dict], failed: dict[str, str]) -> list[dict]:
    """``rows`` (taught tasks, by 1B's task id) with ``rejected``: the student's answer 1B's judges failed
    for that task, or None where it passed, has none, or (``preference.tiers``) the row's tier is not
    one that rejects (the row then trains as an SFT row)."""
    tiers = cfg.preference.tiers if cfg.preference is not None else None

    def rejected(row: dict) -> str | None:
        return failed.get(row.get("id", "")) if tiers is None or row.get("tier") in tiers else None

    return [{**r, "rejected": rejected(r)} for r in rows]


def _objective(cfg: Config) -> str:
    p = cfg.preference
    if p is None:
        return "SFT"
    on = f" (rejected on {', '.join(p.tiers)} pairs)" if p.tiers else ""
    return f"DPO beta {p.beta:g} + NLL x{p.nll_weight:g}{on}"


def _control_mixes(
    cfg: Config,
    answered: list[dict],
    failed: dict[str, str],
    pairs: list[dict],
    held: list[dict],
    judges: dict,
    stage0_train: list[dict],
    replay: list[dict],
) -> dict[str, list[dict]]:
    """Control -> its training rows (``answered``: 1B's answers): the same count and the same replay
    rows as 1R's mix."""
    mixes = {}
    n_pair_rows = len(pairs) * cfg.pair_repeats
    if "random" in cfg.controls:
        drawn = _with_rejected(cfg, _random_tasks(answered, pairs, held, judges, cfg.seed), failed)
        mixes["random"] = [r for r in drawn for _ in range(cfg.pair_repeats)] + replay
    if "replay" in cfg.controls:  # 1R's replay rows and, in place of the pairs, as many other stage-0 rows
        in_replay = {r["id"] for r in replay}
        more = [r for r in sample(stage0_train, None, cfg.seed, key=lambda r: r["id"]) if r["id"] not in in_replay]
        mixes["replay"] = replay + more[:n_pair_rows]
    if "gold" in cfg.controls:
        gold = _with_rejected(cfg, _gold_pairs(answered, pairs), failed)
        mixes["gold"] = [r for r in gold for _ in range(cfg.pair_repeats)] + replay
    for name, share in (("pairs25", 0.25), ("pairs50", 0.5)):
        if name in cfg.controls:
            some = sample(pairs, max(1, round(share * len(pairs))), cfg.seed, key=lambda r: r["id"])
            mixes[name] = [r for r in some for _ in range(cfg.pair_repeats)] + replay
    return mixes


def _evaluation(
    cfg: Config, inputs: dict[str, Path], models: dict[str, Path], judges: dict, out_dir: Path, work_dir: Path
) -> dict:
    """Every model on the same held-out evaluation tasks (none any stage trained on): the comparison
    (:func:`_compare`), and every model's verdict per task in ``evaluation.jsonl``."""
    from datasets import load_from_disk

    data = inputs["data"] / "dataset"
    splits = list(load_from_disk(str(data)).keys())
    seen = set().union(*(training_texts(load_split(data, split)) for split in splits))
    tasks = evaluation_tasks(cfg.evaluation, cfg.seed, seen, mined_bands(inputs.get("mined")))
    verdicts = {name: _evaluate(path, name, tasks, judges, cfg, work_dir) for name, path in models.items()}
    with open(out_dir / "evaluation.jsonl", "w", encoding="utf-8") as f:
        for t in tasks:
            verdict = {
                name: v[t["id"]]["passed"] if v[t["id"]]["outcome"] != "judge_error" else None
                for name, v in verdicts.items()
            }
            record = {"id": t["id"], "sample": t["sample"], "level": t.get("level", 0), "passed": verdict}
            f.write(json.dumps(record) + "\n")
    return _compare(tasks, verdicts)


def _metrics(stats: dict, loss_before: dict, loss_after: dict) -> dict[str, float]:
    before, after, comparison = stats["before"], stats["after"], stats["comparison"]
    metrics = {
        "pairs": stats["pairs"],
        "replay_rows": stats["replay_rows"],
        "replay_own_rows": stats["replay_own_rows"],
        "held_out": stats["held_out"],
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
    for name, c in comparison.get("models", {}).items():
        metrics[f"eval/{name}/pass_rate"] = c["rate"]
        for group, g in c["groups"].items():
            metrics[f"eval/{name}/{group}"] = g["rate"]
    for name, test in comparison.get("mcnemar", {}).items():
        metrics[f"mcnemar/1R_vs_{name}/p"] = test["p"]
    return metrics


def _own(n: int) -> str:
    return f", {n:,} of them its own passing answers" if n else ""


def _summary(stats: dict) -> str:
    before, after, comparison = stats["before"], stats["after"], stats["comparison"]
    summary = (
        f"failure rate on {stats['held_out']} held-out critical failures: {before['rate']:.1%} -> {after['rate']:.1%} "
        f"({stats['pairs']:,} corrected pairs + {stats['replay_rows']:,} replay rows{_own(stats['replay_own_rows'])}); "
        "validation perplexity "
        f"{stats['val_perplexity_before']:.2f} -> {stats['val_perplexity_after']:.2f} "
        f"({stats['val_rows']} rows: what it forgot)"
    )
    if comparison:
        summary += (
            "; held-out evaluation pass rate "
            + ", ".join(f"{name} {c['rate']:.1%}" for name, c in comparison["models"].items())
            + " ("
            + ", ".join(f"1R vs {n} p={t['p']:.3f}" for n, t in comparison["mcnemar"].items())
            + ")"
        )
    return summary


def _random_tasks(answered: list[dict], pairs: list[dict], held: list[dict], judges: dict, seed: int) -> list[dict]:
    """The ``random`` control's rows: per domain, as many tasks as the pairs have, drawn in a seeded
    order from every task 1B answered (failed or not; 1D's held-out failures excepted), each with its
    gold answer, kept when the domain's judge passes it (as the gold tier's answers are)."""
    held_ids = {h["id"] for h in held}
    want = Counter(p["domain"] for p in pairs)
    rows = []
    for domain, n in sorted(want.items()):
        pool = [r for r in answered if r["domain"] == domain and r["id"] not in held_ids and r["reference"]]
        kept = 0
        for r in sample(pool, None, seed, key=lambda r: r["id"]):
            if kept == n:
                break
            if judges[domain](task_of(r), r["reference"]).passed:
                rows.append(
                    {"id": r["id"], "instruction": r["instruction"], "input": r["input"], "output": r["reference"]}
                )
                kept += 1
        if kept < n:
            log.warning(
                f"control random: {kept} of {n} {domain} tasks (1B answered no more with a passing gold answer)"
            )
    return rows


def _gold_pairs(answered: list[dict], pairs: list[dict]) -> list[dict]:
    """The ``gold`` control's rows: the same failures as the pairs, each with the dataset's gold
    answer (what the top tier alone would have taught)."""
    by_id = {r["id"]: r for r in answered}
    rows = []
    for p in pairs:
        reference = by_id.get(p["id"], {}).get("reference")
        if reference:
            rows.append({"id": p["id"], "instruction": p["instruction"], "input": p["input"], "output": reference})
    if len(rows) < len(pairs):
        log.warning(f"control gold: {len(rows)} of {len(pairs)} pairs have a gold answer in 1B's table")
    return rows


def _control(cfg: Config, tokenizer, student: Path, name: str, rows: list[dict], work_dir: Path, out_dir: Path) -> Path:
    """The student fine-tuned on a control's rows with 1R's recipe, in the work directory (a
    finished control is not trained again on resume); its log goes to ``logs/<name>.log``."""
    where = work_dir / "controls" / name
    model_dir = where / "out" / cfg.tier
    if not (model_dir / "config.json").is_file():
        data_file = where / "train.jsonl"
        recipe = _training_file(cfg, tokenizer, data_file, rows)
        log.info(f"control {name}: the same fine-tune on {len(rows):,} rows")
        shutil.rmtree(where / "out", ignore_errors=True)
        (where / "out").mkdir(parents=True)
        model_dir, _ = fine_tune(
            recipe, student, data_file, where / "work", where / "out", cfg.tier, f"1R/{name}", cfg.tokenizer_type
        )
    shutil.copy2(where / "out" / "logs" / "train.log", out_dir / "logs" / f"{name}.log")
    return model_dir


def _evaluate(model_dir: Path, name: str, tasks: list[dict], judges: dict, cfg: Config, work_dir: Path) -> dict:
    """One model's verdict records on the evaluation tasks, by task id (resumable per model)."""
    from methods.measure.generate import Answerer, once

    answerer = once(lambda: Answerer(model_dir, cfg.max_new_tokens, parallel=cfg.parallel))

    def answer(row: dict, prior: dict | None, judge) -> dict:
        text = prior["answer"] if prior is not None else answerer()(row["instruction"], row["input"]).text
        return {"id": row["id"], "answer": text, **verdict_record(judge(row["task"], text), judge.kind)}

    where = work_dir / "evaluation" / name
    try:
        table, _ = answer_and_judge(judges, tasks, where, f"1R evaluation ({name})", answer, cfg.parallel)
    finally:
        answerer.close()
    return {r["id"]: r for r in table}


def _compare(tasks: list[dict], verdicts: dict[str, dict]) -> dict:
    """Pass rate (Wilson interval) per model, overall and per sample and ladder level; the exact
    McNemar test of 1R against 1A and each control on the tasks judged for both."""

    def passed(name: str) -> dict[str, bool]:
        return {t: r["passed"] for t, r in verdicts[name].items() if r["outcome"] != "judge_error"}

    groups: dict[str, list[str]] = {}
    for t in tasks:
        groups.setdefault(t["sample"], []).append(t["id"])
        if t.get("level"):
            groups.setdefault(f"{t['sample']}/L{t['level']}", []).append(t["id"])
    models = {}
    for name in verdicts:
        p = passed(name)

        def rate(ids: list[str], p: dict = p) -> dict:
            judged = [i for i in ids if i in p]
            k = sum(p[i] for i in judged)
            return {
                "n": len(judged),
                "passes": k,
                "rate": k / len(judged) if judged else 0.0,
                "ci": wilson(k, len(judged)),
            }

        models[name] = {**rate([t["id"] for t in tasks]), "groups": {g: rate(ids) for g, ids in groups.items()}}
    tests = {name: mcnemar(passed("1R"), passed(name)) for name in verdicts if name != "1R"}
    for t in tests.values():  # what this evaluation could show: a 10-point gain at the discordance it saw
        d = (t["a_only"] + t["b_only"]) / t["n"] if t["n"] else 0.0
        t["power_10pt"] = mcnemar_power(t["n"], 0.10, max(d, 0.10)) if t["n"] else 0.0
    return {"models": models, "mcnemar": tests}


def _failure_rate(model_dir: Path, rows: list[dict], judges: dict, cfg: Config, label: str) -> dict:
    """The model's answers to ``rows`` judged by the domain's judge: failures / verdicts."""
    from concurrent.futures import ThreadPoolExecutor

    from methods.measure.generate import Answerer

    outcomes: dict[str, Counter] = {}
    if rows:
        answerer = Answerer(model_dir, cfg.max_new_tokens, parallel=cfg.parallel)
        progress = Progress(f"1R held-out answers ({label})", len(rows), log)

        def verdict(r: dict):
            return judges[r["domain"]](task_of(r), answerer(r["instruction"], r["input"]).text)

        with ThreadPoolExecutor(cfg.parallel) as pool:
            for i, (r, v) in enumerate(zip(rows, pool.map(verdict, rows)), 1):
                outcomes.setdefault(r["domain"], Counter())[v.outcome] += 1
                progress.update(i)
        answerer.close()
        progress.finish(len(rows))

    def rate(c: Counter) -> dict:
        value, failed, judged = failure_rate(c.elements())
        return {"judged": judged, "failed": failed, "rate": value, "outcomes": dict(c)}

    total = sum(outcomes.values(), Counter())
    return {**rate(total), "domains": {d: rate(c) for d, c in sorted(outcomes.items())}}


def _card(s: dict) -> str:
    round_no = s.get("round", 1)
    lines = [
        "# Retraining round (stage 1R)" + (f", round {round_no}" if round_no > 1 else ""),
        "",
        f"Every figure below was computed by the stage that wrote this card (`{s['command']}`).",
        "",
        *(
            [
                f"Round {round_no} of the loop: the student it starts from is round {round_no - 1}'s retrained "
                "student, labelled `1A` in the tables below (the model this round must beat).",
                "",
            ]
            if round_no > 1
            else []
        ),
        f"Trained on {s['pairs']:,} corrected pairs from stage 1D (x{s['pair_repeats']}; by tier: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["pair_tiers"].items()))
        + f") and {s['replay_rows']:,} replay rows"
        + (
            f": {s['replay_own_rows']:,} of them the student's own answers 1B's judges passed, the rest"
            if s["replay_own_rows"]
            else ""
        )
        + " of stage 0's train split.",
        "",
        *_objective_lines(s),
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
    if s["comparison"]:
        lines += _comparison_lines(s["comparison"], s["controls"])
    return "\n".join(lines)


def _objective_lines(s: dict) -> list[str]:
    objective = s.get("objective", "SFT")
    if objective == "SFT":
        return ["Objective: SFT on the mix (every row's reply).", ""]
    return [
        f"Objective: {objective} (axolotl `rl: dpo`, TRL's `sigmoid` and `sft` losses): "
        f"{s.get('pairs_rejected', 0):,} of the {s['pairs']:,} pairs have the student's failed 1B answer as the "
        "rejected reply; every other row is its own rejected reply, so it trains by the NLL term alone "
        "(a control none of whose rows has one trains by SFT: the same gradient, without the reference model).",
        "",
    ]


_CONTROL_TEXT = {
    "random": "gold answers to tasks drawn at random from what 1B answered, failed or not (per domain as many as "
    "the pairs), with the same replay rows",
    "replay": "replay rows of stage 0 alone, as many as 1R's whole mix",
    "gold": "the same failures as the pairs, each with its gold answer (the top tier alone), with the same replay rows",
    "pairs25": "a quarter of the pairs, with the same replay rows (the sample-efficiency curve)",
    "pairs50": "half of the pairs, with the same replay rows (the sample-efficiency curve)",
}


def _comparison_lines(c: dict, controls: dict) -> list[str]:
    """Does targeting failures help? The held-out evaluation table and the McNemar tests."""
    models = list(c["models"])
    groups = sorted({g for m in c["models"].values() for g in m["groups"]})
    lines = [
        "## Does targeting failures help?",
        "",
        "The same fine-tune (recipe, steps, replay rows) from the same 1A student, on other rows — the controls:",
        "",
        *[f"- **{name}** ({n:,} rows): {_CONTROL_TEXT[name]};" for name, n in controls.items()],
        "",
        "Pass rate on held-out evaluation tasks no stage trains or mines on (judged by 1B's judges; Wilson 95% "
        "intervals):",
        "",
        "| tasks | n | " + " | ".join(models) + " |",
        "|---|---:|" + "---:|" * len(models),
    ]

    def cell(r: dict) -> str:
        return f"{r['rate']:.1%} [{r['ci'][0]:.0%}, {r['ci'][1]:.0%}]"

    for g in groups:
        first = c["models"][models[0]]["groups"][g]
        lines.append(f"| {g} | {first['n']} | " + " | ".join(cell(c["models"][m]["groups"][g]) for m in models) + " |")
    first = c["models"][models[0]]
    lines += [
        f"| **all** | {first['n']} | " + " | ".join(f"**{cell(c['models'][m])}**" for m in models) + " |",
        "",
        "Exact McNemar tests on the same tasks (1R passed and the other failed / the reverse; two-sided p). "
        "Power: the chance this many tasks would show a 10-point gain at p < 0.01, at the share of tasks the two "
        "arms disagreed on (at least 10%): an evaluation that cannot show the effect cannot deny it either.",
        "",
        "| comparison | tasks | 1R only | other only | p | power (10 points, p < 0.01) |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| 1R vs {name} | {t['n']} | {t['a_only']} | {t['b_only']} | {t['p']:.3f} | {t.get('power_10pt', 0):.0%} |"
            for name, t in c["mcnemar"].items()
        ],
        "",
    ]
    return lines
