"""Stage 1B — failure mining: the 1A student answers held-out tasks and every answer is judged.

Samples (the recipe's ``samples``): the **mining** half of the verifiable benchmarks (GSM8K test,
MBPP, HumanEval; :mod:`methods.benchmarks`), less any task whose text is in stage 0's train split,
and rows of stage 0's held-out splits (validation, test) per domain. Each domain is judged by the
recipe's judge for it (``judges``: math, code, reference or llm; :mod:`methods.judges`). The
student generates with the runtime (``kibidango``, greedy, the family's chat format).

Resumable: every judged row is appended (fsynced) to the work directory's ``rows.jsonl``; a
killed attempt's rerun generates and judges only the rows not there, and re-judges only answers
whose judge was unreachable (``judge_error``, retryable) — a paid judge call is never repeated.

Outputs: ``answers/`` (a ``datasets`` table: id, sample, domain, prompt, answer, reference,
verdict, score, reason, judge kind, tokens, confidence, the task's tests, ...), ``answers.jsonl`` (the same rows;
the first 1,000 are an MLflow table), ``mining.json`` (every figure) and ``MINING_CARD.md``.
Failure = an answer the judge read and rejected (failed, timeout, error); a judge error is no
verdict on the student and is counted apart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageResult
from core.hashing import file_sha256
from core.progress import report_metrics
from methods.evaluation import wilson
from methods.failures import RowLog, answered_tasks, failure_rate, task_record, training_texts, verdict_record
from methods.heldout import HeldOutTasks, answer_and_judge, band_rows, choose_band, levels_above, select_tasks
from methods.judges import sandbox_note
from methods.ladder import LEVELS
from methods.measure.generate import Answerer, once
from methods.training.chat import load_split

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "datasets", "sacrebleu")

log = logging.getLogger("kibidango.stage.1B")


class Config(HeldOutTasks):
    tier: str = Field("target", description="Tier directory of the `student` input (stage 1A's output).")
    max_judge_error_rate: float = Field(
        0.5, ge=0, le=1, description="Fail the stage (rows kept for the rerun) when more answers got no verdict."
    )


def external_inputs(cfg: Config) -> dict[str, str]:
    """The benchmark files' digests ("absent" for a missing optional one)."""
    out = {}
    for s in cfg.samples:
        if s.path is not None:
            present = Path(s.path).is_file()
            if not present and not s.optional:
                raise KibidangoError(f"sample {s.name!r}: benchmark file not found: {s.path}")
            out[f"benchmark:{s.name}"] = file_sha256(Path(s.path)) if present else "absent"
    return out


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    data = inputs["data"] / "dataset"
    seen = training_texts(load_split(data, "train"))
    round_no, earlier = _earlier_rounds(inputs.get("previous"))
    rows, excluded = select_tasks(cfg, data, seen, earlier)
    if not rows:
        raise KibidangoError("no held-out rows to test: every sample is absent or empty")
    student_dir = inputs["student"] / cfg.tier
    if not (student_dir / "config.json").is_file():
        raise KibidangoError(f"the student input has no transformers checkpoint at {student_dir}")

    answerer = once(lambda: Answerer(student_dir, cfg.max_new_tokens, parallel=cfg.parallel))
    counts = {"generated": 0, "rejudged": 0}
    outcomes: list[str] = []
    lock = threading.Lock()

    def answer(row: dict, prior: dict | None, judge) -> dict:
        if prior is not None:  # answered before; its judge was unreachable: judge it again
            reply = {k: prior[k] for k in ("answer", "tokens", "finish_reason", "mean_logprob", "confidence")}
            reply["gen_seconds"] = prior["gen_seconds"]
            with lock:
                counts["rejudged"] += 1
        else:
            a = answerer()(row["instruction"], row["input"])
            reply = {
                "answer": a.text,
                "tokens": a.tokens,
                "finish_reason": a.finish_reason,
                "mean_logprob": a.mean_logprob,
                "confidence": a.confidence,
                "gen_seconds": a.seconds,
            }
            with lock:
                counts["generated"] += 1
        record = {**task_record(row), **reply, **verdict_record(judge(row["task"], reply["answer"]), judge.kind)}
        with lock:
            outcomes.append(record["outcome"])
            if counts["generated"] and len(outcomes) % 25 == 0:
                report_metrics(
                    {"answers_done": len(outcomes), "failure_rate_so_far": failure_rate(outcomes)[0]}, len(outcomes)
                )
        return record

    started = time.monotonic()
    try:
        bands, reused = {}, 0
        if any(s.band is not None for s in cfg.samples):  # the probe first, then the band's rows
            probed, resumed = answer_and_judge(cfg, rows, work_dir, "1B probe", answer, cfg.parallel)
            rows, bands = _banded(cfg, rows, probed, earlier)
            reused = len({r["id"] for r in rows} & {r["id"] for r in probed})  # the band's rows the probe answered
            table, _ = answer_and_judge(cfg, rows, work_dir, "1B answers", answer, cfg.parallel)
        else:
            table, resumed = answer_and_judge(cfg, rows, work_dir, "1B answers", answer, cfg.parallel)
    finally:
        answerer.close()
    # Wall clock: with answers decoded together, the sum of their own times counts each step N times.
    generated, rejudged, gen_seconds = counts["generated"], counts["rejudged"], time.monotonic() - started
    errors = sum(1 for r in table if r["outcome"] == "judge_error")
    if errors > cfg.max_judge_error_rate * len(table):
        first = next(r["reason"] for r in table if r["outcome"] == "judge_error")
        raise KibidangoError(
            f"{errors:,} of {len(table):,} answers got no verdict (max_judge_error_rate {cfg.max_judge_error_rate}); "
            f"first: {first}. The answers are kept: a rerun judges only these again."
        )
    metrics, stats = _figures(cfg, table, excluded, generated, rejudged, resumed, gen_seconds)
    stats["bands"], stats["round"], stats["earlier_rounds_tasks"] = bands, round_no, len(earlier)
    stats["probe_reused"] = metrics["rows_probe_reused"] = reused
    metrics["round"] = round_no
    # every task this round and the earlier ones answered: the next round mines none of them
    answered = sorted(earlier | {r["id"] for r in table} | {r["id"] for r in _probed(work_dir)})
    (out_dir / "answered_tasks.json").write_text(json.dumps({"round": round_no, "ids": answered}))
    for name, b in bands.items():
        metrics[f"band/{name}/lowest"], metrics[f"band/{name}/highest"] = min(b["levels"]), max(b["levels"])
        for level, p in b["probe"].items():
            metrics[f"probe_pass_rate/{name}/L{level}"] = p["rate"]
    _write_table(table, out_dir)
    (out_dir / "mining.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    (out_dir / "MINING_CARD.md").write_text(_card(stats))
    summary = (
        (f"round {round_no}: " if round_no > 1 else "")
        + f"{stats['tested']:,} answers judged, {stats['failed']:,} failures "
        f"({stats['failure_rate']:.1%} of {stats['judged']:,} with a verdict), {errors:,} judge errors; "
        + ", ".join(f"{d} {v['failure_rate']:.0%}" for d, v in stats["domains"].items())
        + f"; {generated:,} generated now"
        + (f", {reused:,} of the band's rows the probe's answers, reused" if reused else "")
        + (f", {resumed:,} resumed from an interrupted attempt" if resumed else "")
    )
    return StageResult(
        metrics,
        ["MINING_CARD.md", "mining.json", "answered_tasks.json"],
        summary,
        tables={"answers.json": "answers.jsonl"},
    )


def _earlier_rounds(previous: Path | None) -> tuple[int, frozenset[str]]:
    """This round's number and the tasks the earlier rounds answered (the `previous` input: the
    last round's stage 1B), which this round never mines."""
    if previous is None:
        return 1, frozenset()
    round_no, ids = answered_tasks(previous, "the previous round's 1B output")
    return round_no + 1, ids


def _probed(work_dir: Path) -> list[dict]:
    """Every row this run answered (the probe's outside the band included)."""
    log_ = RowLog(work_dir / "rows.jsonl")
    log_.close()
    return list(log_.rows.values())


def _banded(
    cfg: Config, rows: list[dict], probed: list[dict], earlier: frozenset[str] = frozenset()
) -> tuple[list[dict], dict]:
    """The rows to mine once the probe is answered: each band sample's band rows (its probe's
    tasks at the band's levels first, then ``size`` more there), every other sample's rows as
    they were; and per band sample the band and the probe's pass rate per level."""
    bands, out = {}, []
    for s in cfg.samples:
        mine = [(r, p) for r, p in zip(rows, probed) if r["sample"] == s.name]
        if s.band is None:
            out += [r for r, _ in mine]
            continue
        rates: dict[int, tuple[int, int]] = {}
        for r, p in mine:
            if p["outcome"] != "judge_error":
                passed, n = rates.get(r["level"], (0, 0))
                rates[r["level"]] = (passed + bool(p["passed"]), n + 1)
        levels = choose_band(rates, s.band)
        above = levels_above(levels, s.band.above, LEVELS[s.domain])
        bands[s.name] = {
            "levels": levels,
            "above": above,
            "low": s.band.low,
            "high": s.band.high,
            "probe": {
                lv: {"passed": a, "answered": n, "rate": a / n if n else 0.0} for lv, (a, n) in sorted(rates.items())
            },
        }
        chosen = band_rows(s.domain, levels + above, s.band.probe, s.size, cfg.seed, earlier)
        out += [{**r, "sample": s.name, "source": s.source, "domain": s.sample_domain} for r in chosen]
        log.info(
            f"sample {s.name}: band levels {levels} (pass rates in [{s.band.low:.0%}, {s.band.high:.0%}] on the "
            f"probe: "
            + ", ".join(f"L{lv} {a}/{n}" for lv, (a, n) in sorted(rates.items()))
            + ")"
            + (f", and above it {above}" if above else "")
            + f"; {len(chosen)} rows"
        )
    return out, bands


def _failure_rate(rows) -> tuple[float, int, int]:
    return failure_rate(r["outcome"] for r in rows)


def _figures(cfg, table, excluded, generated, rejudged, resumed, gen_seconds) -> tuple[dict, dict]:
    rate, failed, judged = _failure_rate(table)
    domains = {}
    for d in sorted({r["domain"] for r in table}):
        d_rate, d_failed, d_judged = _failure_rate([r for r in table if r["domain"] == d])
        domains[d] = {"tested": sum(1 for r in table if r["domain"] == d), "failed": d_failed, "judged": d_judged}
        domains[d]["format_failures"] = sum(1 for r in table if r["domain"] == d and r.get("format_failure"))
        domains[d]["wrong_working"] = sum(1 for r in table if r["domain"] == d and r.get("wrong_working"))
        domains[d]["failure_rate"] = d_rate
    samples = {}
    for s in cfg.samples:
        mine = [r for r in table if r["sample"] == s.name]
        samples[s.name] = {
            "source": s.source,
            "tested": len(mine),
            "failed": _failure_rate(mine)[1],
            "seen_in_training_excluded": excluded.get(s.name, 0),
            "outcomes": dict(Counter(r["outcome"] for r in mine)),
        }
    levels = {}  # ladder samples: the failure rate per level, where the loop's frontier shows
    for r in table:
        if r.get("level"):
            levels.setdefault(f"{r['sample']}/L{r['level']}", []).append(r)
    levels = {
        k: dict(zip(("failure_rate", "failed", "judged"), _failure_rate(rs), strict=True)) for k, rs in levels.items()
    }
    stats = {
        "command": "make stage-1b",
        "code_sandbox": sandbox_note(cfg.judges),
        "tested": len(table),
        "judged": judged,
        "failed": failed,
        "failure_rate": rate,
        "judge_errors": len(table) - judged,
        "format_failures": sum(1 for r in table if r.get("format_failure")),
        "wrong_working": sum(1 for r in table if r.get("wrong_working")),
        "outcomes": dict(Counter(r["outcome"] for r in table)),
        "domains": domains,
        "samples": samples,
        "levels": levels,
        "generated_now": generated,
        "resumed": resumed,
        "rejudged": rejudged,
        "answers_per_second": generated / gen_seconds if gen_seconds else 0.0,
        "parallel": cfg.parallel,
        "mean_tokens": sum(r["tokens"] for r in table) / len(table),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in table)),
        "judge_usd": sum(r["judge_usd"] for r in table),
        "judges": {d: j.kind for d, j in cfg.judges.items()},
    }
    metrics = {
        "tested": len(table),
        "judged": judged,
        "failed": failed,
        "failure_rate": rate,
        "judge_errors": stats["judge_errors"],
        "format_failures": stats["format_failures"],
        "wrong_working": stats["wrong_working"],
        "rows_generated": generated,
        "rows_resumed": resumed,
        "rows_rejudged": rejudged,
        "answers_per_second": stats["answers_per_second"],
        "judge_usd": stats["judge_usd"],
        **{f"failure_rate/{d}": v["failure_rate"] for d, v in domains.items()},
        **{f"tested/{d}": v["tested"] for d, v in domains.items()},
        **{f"failure_rate/{k}": v["failure_rate"] for k, v in levels.items()},
    }
    return metrics, stats


def _write_table(table: list[dict], out_dir: Path) -> None:
    from datasets import Dataset

    with open(out_dir / "answers.jsonl", "w", encoding="utf-8") as f:
        for r in table:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    Dataset.from_list(table).save_to_disk(str(out_dir / "answers"))


def _levels_table(levels: dict) -> list[str]:
    if not levels:
        return []
    lines = ["| ladder sample / level | with a verdict | failed | failure rate (95% Wilson) |", "|---|---:|---:|---:|"]
    for key, v in sorted(levels.items(), key=lambda kv: (kv[0].split("/L")[0], int(kv[0].split("/L")[1]))):
        lo, hi = wilson(v["failed"], v["judged"])
        lines.append(f"| {key} | {v['judged']:,} | {v['failed']:,} | {v['failure_rate']:.1%} [{lo:.1%}, {hi:.1%}] |")
    return [*lines, ""]


def _bands_table(bands: dict) -> list[str]:
    """The probe of each band sample: the student's pass rate per level on the mining part, and
    the levels chosen (where it sits between the band's bounds)."""
    lines = []
    for name, b in bands.items():
        lines += [
            f"Band of `{name}`: levels {', '.join(map(str, b['levels']))}, where the student passed between "
            f"{b['low']:.0%} and {b['high']:.0%} of the probe's mining tasks (or nearest to that, when no level "
            "did); chosen on the mining part only, never the evaluation part."
            + (
                f" Mined too, above the band: level{'s' if len(b['above']) > 1 else ''} "
                f"{', '.join(map(str, b['above']))} (the teachers above the student's own samples teach it)."
                if b.get("above")
                else ""
            ),
            "",
            "| level | probe passed / answered | pass rate (95% Wilson) | mined |",
            "|---:|---:|---:|:---:|",
        ]
        for level, p in b["probe"].items():
            lo, hi = wilson(p["passed"], p["answered"])
            mark = "band" if int(level) in b["levels"] else "above" if int(level) in b.get("above", []) else ""
            lines.append(
                f"| {level} | {p['passed']} / {p['answered']} | {p['rate']:.0%} [{lo:.0%}, {hi:.0%}] | {mark} |"
            )
        lines.append("")
    return lines


def _card(stats: dict) -> str:
    lines = [
        "# Failure mining (stage 1B)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{stats['command']}`).",
        "",
        "| sample | source | tested | failed | outcomes | left out (seen in training) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for name, s in stats["samples"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
        lines.append(
            f"| {name} | {s['source']} | {s['tested']:,} | {s['failed']:,} | {outcomes} "
            f"| {s['seen_in_training_excluded']:,} |"
        )
    lines += [
        "",
        "| domain | judge | tested | with a verdict | failed | of which format (no runnable code) "
        "| of which right number, wrong working | failure rate |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d, v in stats["domains"].items():
        lines.append(
            f"| {d} | {stats['judges'].get(d, '?')} | {v['tested']:,} | {v['judged']:,} | {v['failed']:,} "
            f"| {v.get('format_failures', 0):,} | {v.get('wrong_working', 0):,} | {v['failure_rate']:.1%} |"
        )
    lines += [
        f"| **all** | | {stats['tested']:,} | {stats['judged']:,} | {stats['failed']:,} | "
        f"{stats.get('format_failures', 0):,} | {stats.get('wrong_working', 0):,} | **{stats['failure_rate']:.1%}** |",
        "",
        "A format failure is an answer whose code the judge could not find or parse (after taking it out of its "
        "fences and prose as EvalPlus's sanitizer does): a failure of the answer's form, counted apart from wrong "
        "answers. Right number, wrong working: a math answer whose final number is the reference's but whose own "
        "arithmetic is wrong (`41 + 57 = 58`; the recipe's math judge `working: true`), a failure the loop teaches.",
        "",
        *_levels_table(stats.get("levels", {})),
        *_bands_table(stats.get("bands", {})),
        f"Judge errors (no verdict): {stats['judge_errors']:,}. Mean answer length {stats['mean_tokens']:.1f} tokens; "
        f"{stats['answers_per_second']:.2f} answers/s answered and judged in this run, "
        f"{stats.get('parallel', 1)} at once ({stats['generated_now']:,} generated, "
        + (f"{stats['probe_reused']:,} of the band's rows answered by its probe, " if stats.get("probe_reused") else "")
        + f"{stats['resumed']:,} resumed from an interrupted attempt). Judge spend ${stats['judge_usd']:.4f}.",
        "Answers by how they ended: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(stats["finish_reasons"].items()))
        + " (`length`: cut at max_new_tokens; `context`: the prompt alone fills the student's context, no answer).",
        "",
        stats.get("code_sandbox", ""),
        "",
    ]
    return "\n".join(lines)
