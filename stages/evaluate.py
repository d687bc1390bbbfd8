"""Stage 9 — evaluation of the bundle, as its users get it: through the runtime (``kibidango``),
with the bundle's decoding mode and settings but greedy (temperature 0, so that every figure is
reproducible run to run), on tasks no stage trained or mined on
(:mod:`methods.evaluation`: the benchmarks' evaluation parts, self-instruct's seed tasks).

1. **Quality**: every task answered once per adapter policy — ``auto`` (as the runtime routes:
   the router's domain adapter, else the bundle's default adapter, 2F's recovery LoRA) and
   ``none`` (the bare compressed target: the control; an exact McNemar test per sample of ``auto``
   against it) — in the model's chat format, each answer
   judged (the sandboxed code judge: HumanEval / MBPP pass@1; the math judge: GSM8K accuracy; the
   reference judge on general instructions). Each rate with its 95% Wilson interval, per sample and
   per domain and over all; the perplexity of the gold answers under the base target, a graded
   measure where pass rates sit at zero. Resumable: answers are logged as they are judged. A task
   that ``auto`` routes to no adapter keeps its ``none`` answer (the same weights, greedy).
2. **Size**: the bundle's bytes on disk, per tier and weight form.
3. **Memory**: peak RSS of a fresh process that loads the bundle and generates (``VmHWM``, its own high-water mark).
4. **Speed**: ``kibidango bench`` on the first evaluation queries: tokens/s of ``ar``, ``sd`` and
   ``pyramid`` measured side by side (ratios to ``ar``: absolute timings on a shared machine are
   noise), acceptance per tier, target forwards per token.

Why not lm-evaluation-harness: its HumanEval/MBPP tasks run model code unsandboxed (behind
``HF_ALLOW_CODE_EVAL``), its datasets come from the hub (unreachable here), and it knows nothing of
this pipeline's mining/evaluation split; it could drive ``kibidango serve`` for its other tasks.

Outputs: ``evaluation.json`` (every figure), ``answers.jsonl`` (every answer and verdict),
``EVALUATION_CARD.md``.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from pydantic import Field

from core.contract import KibidangoError, StageResult
from kibidango.backends.base import ContextLengthError
from methods.evaluation import EvalSample, evaluation_tasks, mcnemar, mined_bands, wilson
from methods.failures import task_record, training_texts, verdict_record
from methods.heldout import Judged, answer_and_judge, parallel_field
from methods.judges import sandbox_note
from methods.training.chat import load_split, prompt_ids

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft")

log = logging.getLogger("kibidango.stage.9")

_METRIC = {"gsm8k": "accuracy", "mbpp": "pass_at_1", "humaneval": "pass_at_1", "alpaca_seed": "pass_rate"}
"""Metric names per source (MLflow allows no "@" in a name: pass@1 is `pass_at_1`)."""


class Config(Judged):
    samples: list[EvalSample] = Field(min_length=1)
    max_new_tokens: int = Field(128, gt=0)
    policies: list[Literal["auto", "none"]] = Field(["auto", "none"], min_length=1)
    backend: Literal["torch", "llamacpp"] = "torch"
    seed: int = Field(0, description="Which tasks a sample of a given size takes.")
    parallel: int = parallel_field()
    speed_prompts: int = Field(8, ge=0, description="Evaluation queries the speed benchmark runs (0: none).")
    speed_new_tokens: int = Field(48, gt=0)
    speed_modes: list[str] = Field(["ar", "sd", "pyramid"], min_length=1)

    def domains(self) -> dict[str, str]:
        return {s.name: s.sample_domain for s in self.samples}


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    from kibidango import Pipeline
    from kibidango.bundle import load_bundle

    bundle_dir = inputs["bundle"] / "bundle"
    if not (bundle_dir / "bundle.json").is_file():
        raise KibidangoError(f"{bundle_dir} is not a bundle (no bundle.json); wire stage X as input 'bundle'")
    data = inputs["data"] / "dataset"
    seen = set().union(*(training_texts(load_split(data, split)) for split in _splits(data)))
    rows = evaluation_tasks(cfg.samples, cfg.seed, seen, mined_bands(inputs.get("mined")))
    if not rows:
        raise KibidangoError("no evaluation tasks: every sample is empty")
    # every adapter loaded at once: batched answers routed to different adapters share each forward
    domains = load_bundle(bundle_dir, verify=False).adapters.domains
    pipe = Pipeline.from_bundle(bundle_dir, backend=cfg.backend, adapter="auto", adapter_cache=max(1, len(domains)))
    policies = [p for p in cfg.policies if p == "none" or pipe.adapter == "auto"]  # no router or adapters: base only
    table = _answers(cfg, rows, pipe, policies, work_dir)

    quality = _quality(table, policies)
    for s in cfg.samples:
        if s.seen_by_base and s.name in quality:
            quality[s.name]["seen_by_base"] = s.seen_by_base
    report = {
        "command": "make stage-9",
        "code_sandbox": sandbox_note(cfg.judges),
        "tasks": len(rows),
        "policies": policies,
        "default_adapter": pipe.default_adapter,
        "quality": quality,
        "size": _size(pipe.bundle),
        "peak_rss_mb": _peak_rss_mb(bundle_dir, cfg.backend, rows[0]["task"].prompt),
        "speed": _speed(bundle_dir, cfg, _speed_prompts(pipe, rows, cfg)),
    }
    (out_dir / "evaluation.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    with open(out_dir / "answers.jsonl", "w", encoding="utf-8") as f:
        for r in table:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    (out_dir / "EVALUATION_CARD.md").write_text(_card(report))

    metrics: dict[str, float] = {"tasks": float(len(rows)), "bundle_bytes": float(report["size"]["bytes"])}
    if report["peak_rss_mb"] is not None:
        metrics["peak_rss_mb"] = report["peak_rss_mb"]
    for key, q in quality.items():
        for policy, v in q["policies"].items():
            metrics[f"{key}/{policy}/{q['metric']}"] = v["rate"]
            metrics[f"{key}/{policy}/ci_low"] = v["ci"][0]
            metrics[f"{key}/{policy}/ci_high"] = v["ci"][1]
            metrics[f"{key}/{policy}/mean_score"] = v["mean_score"]
        if "auto_vs_none" in q:
            metrics[f"{key}/auto_vs_none/p"] = q["auto_vs_none"]["p"]
        if q["reference_perplexity"] is not None:
            metrics[f"{key}/reference_perplexity"] = q["reference_perplexity"]
    for row in report["speed"].get("rows", []):
        if row.get("speed_vs_ar") is not None:
            metrics[f"speed/{row['mode']}_vs_ar"] = row["speed_vs_ar"]
        for tier, rate in (row.get("acceptance") or {}).items():
            if rate is not None:
                metrics[f"acceptance/{row['mode']}/{tier}"] = rate
    summary = "; ".join(
        f"{key} {q['metric']} "
        + ", ".join(f"{p} {v['rate']:.1%} [{v['ci'][0]:.1%}, {v['ci'][1]:.1%}]" for p, v in q["policies"].items())
        + f" (n={q['n']})"
        for key, q in quality.items()
        if key in {s.name for s in cfg.samples}
    )
    return StageResult(
        metrics,
        ["EVALUATION_CARD.md", "evaluation.json"],
        summary,
        tables={"answers.json": "answers.jsonl"},
    )


def _splits(data: Path) -> list[str]:
    from datasets import load_from_disk

    return list(load_from_disk(str(data)).keys())


def _answers(cfg: Config, rows: list[dict], pipe, policies: list[str], work_dir: Path) -> list[dict]:
    """Every task answered under each policy and judged (resumable); with ``parallel`` > 1 the
    answers of that many tasks decode together (the runtime's batching; judged outside it)."""
    from kibidango.batching import Batcher
    from kibidango.tune import lossless

    batcher = Batcher(pipe, cfg.parallel) if cfg.parallel > 1 else None
    alone = threading.Lock()
    # Batched, a lossless mode's answers are decoded as ar: greedy, they are the same tokens (up to
    # rounding at near-ties), and ar steps of all requests are one forward where sd's or lookup's
    # verifications of different lengths split each step into a forward per length. A lossy
    # shipped mode (pyramid with tau > 0) is evaluated as it decodes. Its speed is _speed's part.
    mode = {"mode": "ar"} if batcher is not None and lossless(asdict(pipe.config(temperature=0.0))) else {}

    def generate(ids: list[int], query: str, policy: str) -> tuple[str, dict]:
        try:  # greedy: the figures are reproducible run to run
            result = pipe.generate(
                ids,
                query=query,
                adapter=policy,
                max_new_tokens=cfg.max_new_tokens,
                score=False,
                temperature=0.0,
                **mode,
            )
            m = result.metrics
            reply = {"tokens": m.generated_tokens, "finish_reason": m.finish_reason}
            return result.text, {**reply, "domain": m.domain, "adapter": m.adapter}
        except ContextLengthError:  # the task does not fit the context: no answer, a failure
            return "", {"tokens": 0, "finish_reason": "context", "domain": None, "adapter": None}

    base: dict[str, dict] = {}  # the `none` pass's records by task id

    def answering(policy: str):
        def answer(row: dict, prior: dict | None, judge) -> dict:
            query = row["task"].prompt
            if policy != "none" and row["id"] in base and pipe.resolve_adapter(query, policy)[0] is None:
                return {"id": row["id"], **{k: base[row["id"]][k] for k in ("answer", "retryable")}}  # same weights
            ids = prompt_ids(pipe.tokenizer, [{"role": "user", "content": query}])
            record = {"id": row["id"]}
            with batcher.turn() if batcher is not None else alone:
                text, reply = generate(ids, query, policy)
                if policy == "none":  # the base target, as it stands now: how likely it finds the gold answer
                    record["reference"] = _reference_nll(pipe, ids, row["task"].reference)
            verdict = verdict_record(judge(row["task"], text), judge.kind)
            record["answer"] = {"text": text, **reply, **verdict}
            record["retryable"] = verdict["retryable"]
            return record

        return answer

    # one pass per policy: answers decoded together share a forward only when they use the same
    # weights (an adapter's answers beside the base target's would split every step in two). The
    # base weights' pass first: a task that `auto` routes to no adapter takes its answer from it
    # (greedy decoding of the same weights), so only the routed tasks are decoded twice.
    table = [{**task_record(row), "answers": {}, "retryable": False} for row in rows]
    try:
        for policy in sorted(policies, key=lambda p: p != "none"):
            answers = answer_and_judge(
                cfg, rows, work_dir / policy, f"9 answers ({policy})", answering(policy), cfg.parallel
            )[0]
            if policy == "none":
                base.update((a["id"], a) for a in answers)
            for record, a in zip(table, answers):
                record["answers"][policy] = a["answer"]
                record["retryable"] = record["retryable"] or a["retryable"]
                if "reference" in a:
                    record["reference"] = a["reference"]
        return table
    finally:
        if batcher is not None:  # the speed benchmark runs the pipeline alone
            batcher.close()


def _reference_nll(pipe, prompt_ids: list[int], reference: str) -> dict | None:
    """Mean negative log-likelihood of the gold answer's tokens after the prompt (one forward
    pass of the target, cut to its context): a graded measure where pass rates sit at zero."""
    from kibidango.confidence import score_answer

    answer = list(pipe.tokenizer(reference, add_special_tokens=False)["input_ids"]) if reference else []
    feats = score_answer(pipe.models["target"], prompt_ids, answer) if answer else None
    if feats is None:
        return None
    n = min(len(answer), pipe.models["target"].context_length - len(prompt_ids))
    return {"nll": -feats["mean_logprob"], "tokens": n}


def _quality(table: list[dict], policies: list[str]) -> dict:
    """Per sample, per ladder level (``<sample>/L<level>``) and per domain (``domain:<name>``): n,
    passes and the Wilson interval per policy."""
    groups: dict[str, list[dict]] = {}
    for key in (
        lambda r: r["sample"],
        lambda r: f"{r['sample']}/L{r['level']}" if r.get("level") else None,
        lambda r: f"domain:{r['domain']}",
        lambda r: "all",
    ):
        for r in table:
            if key(r) is not None:
                groups.setdefault(key(r), []).append(r)
    out = {}
    for key, rs in groups.items():
        source = rs[0]["source"]
        per = {}
        for p in policies:
            # a judge error is no verdict on the answer (the judge ran it again first): counted apart
            judged = [r for r in rs if r["answers"][p].get("outcome") != "judge_error"]
            passes = sum(bool(r["answers"][p]["passed"]) for r in judged)
            per[p] = {
                "passes": passes,
                "judged": len(judged),
                "judge_errors": len(rs) - len(judged),
                "rate": passes / len(judged) if judged else 0.0,
                "ci": list(wilson(passes, len(judged))) if judged else [0.0, 1.0],
                "mean_score": sum(r["answers"][p]["score"] for r in judged) / len(judged) if judged else 0.0,
                "past_context": sum(r["answers"][p]["finish_reason"] == "context" for r in rs),
            }
        metric = _METRIC.get(source, "pass_rate") if key in {r["sample"] for r in rs} else "pass_rate"
        scored = [r["reference"] for r in rs if r.get("reference")]
        tokens = sum(x["tokens"] for x in scored)
        ppl = math.exp(sum(x["nll"] * x["tokens"] for x in scored) / tokens) if tokens else None
        out[key] = {"n": len(rs), "metric": metric, "policies": per, "reference_perplexity": ppl}
        if {"auto", "none"} <= set(policies):  # paired: the same tasks with and without the adapters
            both = [r for r in rs if all(r["answers"][p].get("outcome") != "judge_error" for p in ("auto", "none"))]
            out[key]["auto_vs_none"] = mcnemar(
                *({r["id"]: bool(r["answers"][p]["passed"]) for r in both} for p in ("auto", "none"))
            )
    return out


def _size(bundle) -> dict:
    files = bundle.manifest.files
    tiers = {}
    for name, tier in bundle.tiers.items():
        for form in ("hf", "gguf"):
            path = getattr(tier, form)
            if path is None:
                continue
            prefix = (
                path.relative_to(bundle.root).as_posix()
                if form == "hf"
                else path.parent.relative_to(bundle.root).as_posix()
            )
            tiers[f"{name}/{form}"] = sum(f.size for f in files if f.path.startswith(prefix + "/"))
    return {"bytes": sum(f.size for f in files), "tiers": tiers}


# VmHWM is this process's own high-water mark. ru_maxrss is not: Linux carries the parent's peak
# into a child across fork (or vfork) and exec, so a probe started by a large flow would report the
# flow's memory, not the bundle's.
_RSS_PROBE = """
import resource, sys
from kibidango import Pipeline
pipe = Pipeline.from_bundle(sys.argv[1], backend=sys.argv[2])
pipe.generate(sys.argv[3], max_new_tokens=int(sys.argv[4]))
try:
    with open("/proc/self/status") as status:
        print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")))
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_rss_mb(bundle_dir: Path, backend: str, prompt: str, new_tokens: int = 32) -> float | None:
    """Peak resident memory (MB) of a fresh process that loads the bundle and generates: what a
    user's process needs, without this flow's own memory."""
    probe = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(bundle_dir), backend, prompt[:2000], str(new_tokens)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if probe.returncode != 0:
        log.warning(f"peak RSS probe failed (exit {probe.returncode}): {probe.stderr.strip()[-300:]}")
        return None
    return int(probe.stdout.strip().splitlines()[-1]) / 1024  # both in KiB on Linux


def _speed_prompts(pipe, rows: list[dict], cfg: Config) -> list[str]:
    """The first ``speed_prompts`` evaluation queries that leave room for the generated tokens."""
    room = min(m.context_length for m in pipe.models.values()) - cfg.speed_new_tokens
    fits = (r["task"].prompt for r in rows if len(pipe.encode(r["task"].prompt)) < room)
    return [p for _, p in zip(range(cfg.speed_prompts), fits, strict=False)]


def _speed(bundle_dir: Path, cfg: Config, prompts: list[str]) -> dict:
    if not prompts:
        return {}
    from kibidango.bench import run_bench
    from kibidango.bundle import load_bundle

    have = set(load_bundle(bundle_dir, verify=False).tiers)
    needs = {"ar": {"target"}, "sd": {"draft", "target"}, "pyramid": {"draft", "qualifier", "target"}}
    modes = [m for m in cfg.speed_modes if needs.get(m.split("-")[0], set()) <= have]
    if "ar" not in modes:
        modes = ["ar", *modes]
    result = run_bench(bundle_dir, prompts, modes, cfg.speed_new_tokens, 1, (), cfg.backend, temperature=0.0)
    return {
        "prompts": len(prompts),
        "new_tokens": cfg.speed_new_tokens,
        "rows": result.rows,
        "cost_ratio": result.cost_ratio,
        "notes": result.notes,
    }


def _card(r: dict) -> str:
    paired = {"auto", "none"} <= set(r["policies"])
    default = r.get("default_adapter")
    lines = [
        "# Stage 9 — evaluation of the bundle",
        "",
        f"{r['tasks']} tasks no stage trained or mined on (the benchmarks' evaluation parts; self-instruct seed "
        "tasks), answered through the runtime in the bundle's decoding mode, greedy, judged (`make stage-9`). "
        "95% Wilson intervals. " + r.get("code_sandbox", ""),
        "",
        "Adapter `auto`: the router's domain adapter where it routes to one, else "
        + (f"the bundle's default adapter `{default}` (2F)" if default else "the bare weights")
        + "; `none`: the bare compressed target"
        + (", the control of `auto` (paired, same tasks)." if paired else "."),
        "",
        "| sample | metric | n | "
        + " | ".join(f"adapter `{p}`" for p in r["policies"])
        + (" | auto vs none: auto only / none only, McNemar p" if paired else "")
        + " | gold-answer perplexity (base) |",
        "|---|---|---:|" + "---:|" * len(r["policies"]) + ("---:|" if paired else "") + "---:|",
    ]
    for key, q in r["quality"].items():
        cells = [f"{v['rate']:.1%} [{v['ci'][0]:.1%}, {v['ci'][1]:.1%}]" for v in q["policies"].values()]
        if "auto_vs_none" in q:
            t = q["auto_vs_none"]
            cells.append(f"{t['a_only']} / {t['b_only']}, p={t['p']:.3f}")
        ppl = "-" if q["reference_perplexity"] is None else f"{q['reference_perplexity']:.1f}"
        metric = q["metric"].replace("_at_", "@")
        flag = " (not held out\\*)" if q.get("seen_by_base") else ""
        lines.append(f"| {key}{flag} | {metric} | {q['n']} | " + " | ".join(cells) + f" | {ppl} |")
    lines += [
        f"\n\\* {key}: not held out for this preset's base model — {q['seen_by_base']}"
        for key, q in r["quality"].items()
        if q.get("seen_by_base")
    ]
    errors = {p: v["judge_errors"] for p, v in r["quality"].get("all", {}).get("policies", {}).items()}
    if any(errors.values()):
        lines.append(
            "\nJudge errors (no verdict after the judge's own retries; counted apart, not as failures, and judged "
            "again by a rerun): " + ", ".join(f"`{p}` {n}" for p, n in errors.items()) + "."
        )
    size = r["size"]
    lines += [
        "",
        f"Bundle on disk: {size['bytes'] / 1e6:.2f} MB ("
        + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in size["tiers"].items())
        + ").",
    ]
    if r["peak_rss_mb"] is not None:
        lines.append(f"Peak RSS of a process that loads the bundle and generates: {r['peak_rss_mb']:.0f} MB.")
    speed = r["speed"]
    if speed:
        lines += [
            "",
            f"Speed on {speed['prompts']} evaluation queries, {speed['new_tokens']} tokens each, "
            "measured side by side (ratios, not absolute timings):",
            "",
            "| mode | tokens/s vs ar | acceptance | target forwards per token |",
            "|---|---:|---|---:|",
        ]
        for row in speed["rows"]:
            acc = ", ".join(f"{t} {a:.1%}" for t, a in (row.get("acceptance") or {}).items() if a is not None) or "-"
            ratio = "-" if row.get("speed_vs_ar") is None else f"{row['speed_vs_ar']:.2f}x"
            fwd = row.get("target_forwards_per_token")
            lines.append(f"| {row['mode']} | {ratio} | {acc} | {'-' if fwd is None else f'{fwd:.2f}'} |")
    return "\n".join(lines) + "\n"
