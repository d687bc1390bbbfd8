"""Stage 1C — critique filtering: from stage 1B's failures, keep the critical ones.

The funnel: **tested** (1B's answers) -> **judged** (a verdict, not a judge error) -> **failed** ->
**unique** (near-duplicate prompts collapsed with stage 0's MinHash LSH, the most severe failure of
each cluster kept) -> **critical** (the ``top_k`` most severe per domain; with ``per_level``, shared
among the domain's ladder levels in proportion to their unique failures).

Severity (:func:`methods.failures.severity`): the domain's weight x (1 - judge score) x how
confident the student was of its wrong answer (its mean token probability, measured by 1B).

Critique (``critique``): ``self`` asks the student to explain its error, ``llm`` asks an
OpenAI-compatible judge (its ``reason`` is the explanation); ``none`` skips it. Failures are
critiqued in severity order, only until each domain has its ``top_k``. An ``llm`` critic that finds
a failure judged by the ``reference`` judge (chrF: a weak signal) to be right after all
**disputes** it and the failure is dropped; the verdict of a verifiable judge (math, code) stands.
Critiques are resumable (a paid call is never repeated by a rerun).

Outputs: ``critical/`` (a ``datasets`` table), ``critical.jsonl`` (an MLflow table),
``funnel.json`` and ``FAILURE_CARD.md``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from core.progress import Progress
from methods.curation.dedup import DedupConfig, find_duplicates
from methods.failures import FAILURES, RowLog, read_jsonl, severity, task_of
from methods.judges import make_judge
from methods.judges.settings import LLMJudgeSettings

RESUMABLE = True
LIBRARIES = ("datasketch", "datasets", "transformers", "torch")

log = logging.getLogger("kibidango.stage.1C")


CRITIQUE_PROMPT = "The answer below was judged wrong ({reason}). Explain the mistake in one or two sentences."
CRITIC_RUBRIC = (
    "An automatic judge marked the answer to this task as wrong. Check it. Reply with a JSON object only: "
    '{"passed": true if the answer is in fact acceptable, "score": 0 to 1, "reason": "what is wrong with it, '
    'in one or two sentences"}.'
)


class Config(StageConfig):
    top_k: int | dict[str, int] = Field(
        description="Critical failures kept per domain (the most severe): one number for every domain, or per domain."
    )
    domain_weights: dict[str, float] = Field(
        default_factory=dict, description="Severity weight per domain (absent: 1.0)."
    )
    confidence_weight: float = Field(
        0.5, ge=0, le=1, description="How much the student's confidence in a wrong answer adds to its severity."
    )
    dedup: DedupConfig = Field(
        default_factory=lambda: DedupConfig(threshold=0.7),
        description="Near-duplicate prompts collapsed (stage 0's MinHash LSH) before ranking.",
    )
    per_level: bool = Field(
        False,
        description="Share each domain's top_k among its levels (a task's ladder level; one share for tasks "
        "without one) in proportion to their unique failures, the most severe of each level first; what a "
        "level leaves unused goes to the most severe of the rest.",
    )
    critique: Literal["none", "self", "llm"] = Field("none", description="Who explains each kept failure.")
    critic: LLMJudgeSettings | None = Field(
        None, description="critique=llm: the llm judge's settings (base_url, model, api_key_env, ...)."
    )
    tier: str = Field("target", description="critique=self: the tier directory of the `student` input.")
    critique_max_new_tokens: int = Field(96, gt=0, description="critique=self: most tokens of the student's critique.")

    @model_validator(mode="after")
    def _critic(self) -> Config:
        if self.critique == "llm":
            if not self.critic:
                raise ValueError("critique: llm needs `critic` (base_url, model, api_key_env)")
        ks = self.top_k.values() if isinstance(self.top_k, dict) else [self.top_k]
        if any(k < 1 for k in ks):
            raise ValueError("top_k must be >= 1")
        return self

    def k(self, domain: str) -> int:
        return self.top_k if isinstance(self.top_k, int) else self.top_k.get(domain, 0)


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    answers = read_jsonl(inputs["mined"] / "answers.jsonl", "the mined input (stage 1B)")
    judged = [r for r in answers if r["outcome"] != "judge_error"]
    failed = [r for r in judged if r["outcome"] in FAILURES]
    for r in failed:
        r["severity"] = severity(
            r["score"], r["confidence"], cfg.domain_weights.get(r["domain"], 1.0), cfg.confidence_weight
        )
    failed.sort(key=lambda r: (-r["severity"], r["id"]))  # the first of a cluster is its most severe
    dups = find_duplicates([r["prompt"] for r in failed], cfg.dedup)
    dropped = {d.index: failed[d.kept]["id"] for d in dups}
    unique = [r for i, r in enumerate(failed) if i not in dropped]
    log.info(f"{len(failed):,} failures, {len(unique):,} after collapsing {len(dropped):,} near-duplicate prompts")

    if cfg.per_level:
        unique = _level_shares_first(unique, cfg)
    critic = _critic(cfg, inputs)
    notes = RowLog(work_dir / "critiques.jsonl")
    critical: list[dict] = []
    disputed: list[dict] = []
    per_domain: Counter[str] = Counter()
    progress = Progress("1C critiques", min(len(unique), sum(cfg.k(d) for d in {r["domain"] for r in unique})), log)
    try:
        for r in unique:
            if per_domain[r["domain"]] >= cfg.k(r["domain"]):
                continue
            note = notes.get(r["id"])
            if note is None and critic is not None:
                note = {"id": r["id"], **critic(r)}
                notes.add(note)
            r = {**r, "critique": (note or {}).get("critique", ""), "critic_passed": (note or {}).get("passed")}
            if note and note.get("passed") and r["judge"] == "reference":
                disputed.append(r)  # the weak judge is overruled by the critic
                continue
            critical.append(r)
            per_domain[r["domain"]] += 1
            progress.update(len(critical) + len(disputed))
        progress.finish(len(critical) + len(disputed))
    finally:
        notes.close()

    funnel = _funnel(answers, judged, failed, unique, critical, disputed, cfg, notes.resumed)
    _write(critical, out_dir)
    (out_dir / "funnel.json").write_text(json.dumps(funnel, indent=2, sort_keys=True))
    (out_dir / "FAILURE_CARD.md").write_text(_card(funnel, critical))
    f = funnel["all"]
    metrics = {
        **{k: float(v) for k, v in f.items()},
        "disputed": float(len(disputed)),
        "critiques_resumed": float(notes.resumed),
        **{f"{k}/{d}": float(v) for d, counts in funnel["domains"].items() for k, v in counts.items()},
    }
    summary = (
        f"funnel tested {f['tested']:,} -> judged {f['judged']:,} -> failed {f['failed']:,} -> unique {f['unique']:,} "
        f"-> critical {f['critical']:,} (top {_top_k(cfg.top_k)} per domain; critique: {cfg.critique}"
        + (f", {len(disputed)} disputed" if disputed else "")
        + ")"
    )
    return StageResult(
        metrics, ["FAILURE_CARD.md", "funnel.json"], summary, tables={"critical_failures.json": "critical.jsonl"}
    )


def _critic(cfg: Config, inputs: dict[str, Path]):
    """A function row -> {"critique", "passed"} for the configured critic, or None."""
    if cfg.critique == "none":
        return None
    if cfg.critique == "llm":
        critic = cfg.critic
        if "rubric" not in critic.model_fields_set:  # the critic's own rubric unless the recipe gives one
            critic = critic.model_copy(update={"rubric": CRITIC_RUBRIC})
        judge = make_judge(critic)

        def ask_llm(r: dict) -> dict:
            v = judge(task_of(r), r["answer"])
            if v.outcome == "judge_error":  # no critique; the failure stands
                return {"critique": "", "passed": None, "critic_error": v.reason, "usd": v.details.get("usd", 0.0)}
            return {"critique": v.reason, "passed": v.passed, "usd": v.details.get("usd", 0.0)}

        return ask_llm
    from methods.measure.generate import Answerer

    student = inputs.get("student")
    if student is None:
        raise KibidangoError("critique: self needs the `student` input (stage 1A)")
    answerer = Answerer(student / cfg.tier, cfg.critique_max_new_tokens)

    def ask_self(r: dict) -> dict:
        a = answerer(
            CRITIQUE_PROMPT.format(reason=r["reason"][:200]), f"Task:\n{r['prompt']}\n\nAnswer:\n{r['answer']}"
        )
        return {"critique": a.text.strip(), "passed": None}

    return ask_self


def _level_shares_first(unique: list[dict], cfg: Config) -> list[dict]:
    """``unique`` (most severe first) reordered so that each domain's first ``top_k`` are its levels'
    shares: level L of a domain with N unique failures, n_L of them, gets k * n_L / N (largest
    remainder), filled most severe first; the rest follow, most severe first. Confidence ranks
    severity, so without shares a level where the student is unsure of its wrong answers (the edge
    of what it can do) lost almost every place: 3 of 55 math level-4 failures were kept, against 57
    of 70 at level 5, and the retrained model fell below its student there (docs/status.md)."""
    counts: Counter[tuple] = Counter((r["domain"], r.get("level")) for r in unique)
    shares: dict[tuple, int] = {}
    for domain in {d for d, _ in counts}:
        groups = {g: n for g, n in counts.items() if g[0] == domain}
        total = sum(groups.values())
        k = min(cfg.k(domain), total)
        exact = {g: k * n / total for g, n in groups.items()}
        shares |= {g: int(x) for g, x in exact.items()}
        left = k - sum(shares[g] for g in groups)
        for g in sorted(groups, key=lambda g: (-(exact[g] - int(exact[g])), str(g[1])))[:left]:
            shares[g] += 1
    taken: Counter[tuple] = Counter()
    first, rest = [], []
    for r in unique:
        g = (r["domain"], r.get("level"))
        (first if taken[g] < shares[g] else rest).append(r)
        taken[g] += 1
    return first + rest


def _funnel(answers, judged, failed, unique, critical, disputed, cfg, resumed) -> dict:
    steps = {"tested": answers, "judged": judged, "failed": failed, "unique": unique, "critical": critical}
    domains = sorted({r["domain"] for r in answers})
    return {
        "command": "make stage-1c",
        "top_k": cfg.top_k,
        "critique": cfg.critique,
        "all": {name: len(rows) for name, rows in steps.items()},
        "domains": {
            d: {name: sum(1 for r in rows if r["domain"] == d) for name, rows in steps.items()} for d in domains
        },
        "levels": {
            d: dict(sorted(Counter(str(r.get("level")) for r in critical if r["domain"] == d).items())) for d in domains
        },
        "per_level": cfg.per_level,
        "disputed": len(disputed),
        "critiques_resumed": resumed,
    }


def _write(critical: list[dict], out_dir: Path) -> None:
    from datasets import Dataset

    with open(out_dir / "critical.jsonl", "w", encoding="utf-8") as f:
        for r in critical:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    if critical:
        Dataset.from_list(critical).save_to_disk(str(out_dir / "critical"))


def _card(funnel: dict, critical: list[dict]) -> str:
    f = funnel["all"]
    lines = [
        "# Critical failures (stage 1C)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{funnel['command']}`).",
        "",
        "| domain | tested | judged | failed | unique | critical |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d, c in funnel["domains"].items():
        lines.append(
            f"| {d} | {c['tested']:,} | {c['judged']:,} | {c['failed']:,} | {c['unique']:,} | {c['critical']:,} |"
        )
    lines += [
        f"| **all** | {f['tested']:,} | {f['judged']:,} | {f['failed']:,} | {f['unique']:,} | **{f['critical']:,}** |",
        "",
        f"Kept: the {_top_k(funnel['top_k'])} most severe unique failures per domain"
        + (", shared among its levels in proportion to their unique failures. " if funnel["per_level"] else ". ")
        + "Kept per level: "
        + "; ".join(
            f"{d} " + ", ".join(f"L{lv} {n}" if lv != "None" else f"no level {n}" for lv, n in levels.items())
            for d, levels in funnel["levels"].items()
            if levels
        )
        + ". "
        f"Critique: {funnel['critique']}"
        + (
            f"; {funnel['disputed']} reference-judged failures disputed by the critic and dropped."
            if funnel["disputed"]
            else "."
        ),
        "",
    ]
    if critical:
        lines += ["## The most severe", "", "| id | domain | judge | severity | reason |", "|---|---|---|---:|---|"]
        for r in sorted(critical, key=lambda r: -r["severity"])[:5]:
            reason = r["reason"].replace("|", "\\|").replace("\n", " ")[:100]
            lines.append(f"| {r['id']} | {r['domain']} | {r['judge']} | {r['severity']:.3f} | {reason} |")
        lines.append("")
    return "\n".join(lines)


def _top_k(top_k: int | dict[str, int]) -> str:
    """``20``, or ``math 40, code 40, general 10`` for a per-domain cut."""
    return f"{top_k:,}" if isinstance(top_k, int) else ", ".join(f"{d} {k:,}" for d, k in top_k.items())
