"""Stage 2G — confidence calibration of the compressed target, as the bundle ships it (the 2B
checkpoint for torch, with its default adapter — 2F's recovery LoRA, the ``recovery`` input, which
stage X then ships as the bundle's ``default_adapter``; the 2D GGUF for llama.cpp).

1. **Token level**: temperature scaling. Stage 0's validation rows in the chat format; the
   target's next-token logits over each answer; rows split by a salted hash into a fitting half
   and an evaluation half. One temperature per backend minimises the fitting half's NLL
   (:func:`methods.calibration.fit_temperature`); ECE (15 **equal-mass** bins of top-1
   confidence) and NLL before/after are measured on the evaluation half.
2. **Answer level**: Platt scaling. The target answers held-out tasks (:class:`methods.heldout.HeldOutTasks`, as
   stage 1B: benchmarks' mining halves, stage 0's held-out rows), once with the default weights (the
   target with ``default_adapter``) and once with the domain adapter the router (6A) picks, and
   every answer is judged (1B's judges). An
   answer's features (:data:`kibidango.addons.confidence.ANSWER_FEATURES`: mean and min token
   log-probability, mean entropy, length, mean log-probability at the fitted temperature) ->
   logistic regression to P(judge passes), fitted on one half of the tasks, measured on the other:
   ECE, Brier and AUROC of the raw confidence (exp mean log-probability) and of the calibrated one.
   With one label class in the fitting half there is nothing to fit: no answer model is written
   and the runtime falls back to exp(calibrated mean log-probability); the card says so. The
   answers are greedy; ``calibration.json`` says so (``decoding``), and the runtime's cascade
   decodes its local answers that way (the bundle's sampling defaults would be another
   distribution of answers, scored lower and failing more: 6C's thresholds would not hold).

Resumable like 1B: every judged task is appended to the work directory's ``base/rows.jsonl`` (then
``adapter/rows.jsonl``).

Outputs: ``calibration.json`` (the runtime's :class:`kibidango.addons.confidence.Calibrator`),
``answers.jsonl`` (every judged answer with its features, split, route: stages 6B and 6C read
it; with the gold answer's verdict and token counts, the cloud stand-in of 6C), ``calibration_eval.json``,
``reliability_tokens.png``, ``reliability_answers.png``,
``CALIBRATION_CARD.md``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
from pydantic import Field

from core.contract import KibidangoError, StageResult
from kibidango.addons.confidence import ANSWER_FEATURES, Calibrator
from kibidango.addons.router import Router
from methods.benchmarks import unit_hash
from methods.calibration import auroc, brier, ece, fit_logistic, fit_temperature, reliability_plot, token_confidence
from methods.failures import task_record, training_texts, verdict_record
from methods.heldout import HeldOutTasks, answer_and_judge, select_tasks
from methods.judges import sandbox_note
from methods.measure.generate import ScoredAnswerer
from methods.training.adapter_manifest import ships
from methods.training.chat import encode, load_split, messages, prompt_text

RESUMABLE = True
LIBRARIES = ("transformers", "torch", "llama_cpp_python", "datasets", "sacrebleu", "peft")

log = logging.getLogger("kibidango.stage.2G")

BINS = 15


class Config(HeldOutTasks):
    tier: str = Field("target", description="Tier directory of the `target` input (the compressed target).")
    gguf: bool = Field(True, description="Also fit the temperature of the target's GGUF (llama.cpp backend).")
    token_rows: int = Field(300, gt=1, description="Stage-0 validation rows for the token-level fit and measure.")
    max_positions: int = Field(40000, gt=10, description="At most this many answer positions (logits held in memory).")
    max_len: int = Field(256, gt=8, description="Tokens per validation row.")
    fit_share: float = Field(0.5, gt=0, lt=1, description="Share of rows / tasks (by hash) used for fitting.")
    l2: float = Field(1e-2, ge=0, description="L2 penalty of the answer-level logistic regression.")
    seed: int = Field(1, description="Which held-out tasks a sample takes (1B's default is 0).")
    default_adapter: str | None = Field(
        "recovery",
        description="The adapter (by its domain) the torch target runs with where no domain adapter is routed: "
        "the bundle's default weights, calibrated here; not among the inputs (a preset without 2F), or unfit by "
        "its stage's task check (2F's `default_weights: false`) -> the bare weights. None: the bare weights.",
    )


def _manifest_of(adapter_dirs: list[Path], domain: str | None) -> tuple[Path, dict] | None:
    """The directory and ``adapter.json`` of ``domain``'s adapter; None for None or no such adapter."""
    for d in adapter_dirs:
        manifest = json.loads((d / "adapter.json").read_text())
        if domain is not None and manifest.get("domain") == domain:
            return d, manifest
    return None


def _fit_as_default(adapter_dirs: list[Path], domain: str) -> bool:
    """Whether the adapter of ``domain`` may be the default weights: its manifest's
    ``default_weights`` (2F's task check), True where its stage made no such check."""
    found = _manifest_of(adapter_dirs, domain)
    return True if found is None else bool(found[1].get("default_weights", True))


def _forms(adapter_dirs: list[Path], domain: str | None) -> set[str]:
    """The formats (``peft``, ``gguf``) the adapter of ``domain`` ships in; empty for None."""
    found = _manifest_of(adapter_dirs, domain)
    return set() if found is None else set(found[1]["formats"])


def _fit_half(row_id: str, share: float) -> bool:
    return unit_hash(f"kibidango/calibration-split/v1:{row_id}") < share


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    data = inputs["data"] / "dataset"
    target = inputs["target"] / cfg.tier
    if not (target / "config.json").is_file():
        raise KibidangoError(f"the target input has no transformers checkpoint at {target}")
    # the adapters that ship (a domain adapter its stage's check found no better is left out, as X leaves it)
    adapter_dirs = sorted(p for p in inputs.values() if (p / "adapter.json").is_file() and ships(p))
    router = Router.load(inputs["router"] / "router.json") if "router" in inputs else None

    answerer = ScoredAnswerer(target, cfg.max_new_tokens, adapter_dirs, parallel=cfg.parallel)
    have = answerer.adapters.adapters.domains if answerer.adapters is not None else []
    default = cfg.default_adapter if cfg.default_adapter in have else None
    if cfg.default_adapter is not None and default is None:
        log.info(f"no {cfg.default_adapter!r} adapter among the inputs: calibrating the bare weights")
    if default is not None and not _fit_as_default(adapter_dirs, default):
        log.info(
            f"the {default!r} adapter passed fewer held-out tasks than the bare weights (its stage's check): "
            "calibrating the bare weights, the bundle's default"
        )
        default = None
    forms = _forms(adapter_dirs, default)
    # each backend runs the default in the form it has (2F's `base: gguf`: a GGUF adapter alone)
    torch_default = default if "peft" in forms else None
    if torch_default is not None:
        answerer.adapters.use(torch_default)  # the token-level fit reads the torch target as it ships
    gguf_lora = _manifest_of(adapter_dirs, default)[0] if "gguf" in forms else None
    tokens = _token_level(cfg, data, answerer, inputs, out_dir, gguf_lora)
    temperature = tokens["torch"]["temperature"]

    seen = training_texts(load_split(data, "train"))
    rows, _ = select_tasks(cfg, data, seen)
    if not rows:
        raise KibidangoError("no held-out tasks to answer: every sample is absent or empty")
    table = _answers(cfg, rows, answerer, router, temperature, work_dir, torch_default)
    answers = _answer_level(cfg, table, out_dir)

    calibrator = Calibrator(
        {backend: v["temperature"] for backend, v in tokens.items()},
        answers.pop("model"),
        {"token": tokens, "answer": {k: v for k, v in answers.items() if k != "curves"}},
        # what the answers were decoded with: the runtime's cascade decodes its local answer the same way
        {"temperature": answerer.config.temperature, "max_new_tokens": answerer.config.max_new_tokens},
    )
    (out_dir / "calibration.json").write_text(json.dumps(calibrator.to_dict(), indent=2, sort_keys=True))
    with open(out_dir / "answers.jsonl", "w", encoding="utf-8") as f:
        for r in table:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    report = {
        "command": "make stage-2g",
        "code_sandbox": sandbox_note(cfg.judges),
        "bins": f"{BINS} equal-mass",
        "token": tokens,
        "answer": answers,
        "decoding": calibrator.decoding,
        "default_adapter": default,  # stage X ships it as the bundle's default_adapter
        "default_adapter_forms": sorted(forms),  # the backends it applies to: peft (torch), gguf (llama.cpp)
    }
    reliability_plot(answers.pop("curves"), out_dir / "reliability_answers.png", "answers: P(judge passes)", BINS)
    (out_dir / "calibration_eval.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out_dir / "CALIBRATION_CARD.md").write_text(_card(report))

    metrics = {f"token/{b}/{k}": v for b, d in tokens.items() for k, v in d.items() if isinstance(v, int | float)}
    metrics.update({f"answer/{k}": v for k, v in answers.items() if isinstance(v, int | float) and v is not None})
    t = tokens["torch"]
    summary = (
        f"token ECE {t['ece_before']:.3f} -> {t['ece_after']:.3f} at T={t['temperature']:.2f} (torch"
        + (f"; gguf T={tokens['llamacpp']['temperature']:.2f}" if "llamacpp" in tokens else "")
        + f"); answers: {answers['answers']} judged, pass rate {answers['pass_rate']:.1%}; "
        + (
            f"ECE {answers['ece_before']:.3f} -> {answers['ece_after']:.3f}, Brier {answers['brier_before']:.3f} -> "
            f"{answers['brier_after']:.3f}"
            if answers["fitted"]
            else "one label class in the fitting half: no answer model (confidence = exp calibrated mean log-prob)"
        )
    )
    files = ["CALIBRATION_CARD.md", "calibration_eval.json", "reliability_tokens.png", "reliability_answers.png"]
    return StageResult(metrics, files, summary, tables={"answers.json": "answers.jsonl"})


def _token_level(
    cfg: Config, data: Path, answerer: ScoredAnswerer, inputs: dict, out_dir: Path, gguf_lora: Path | None = None
) -> dict:
    """Per backend: the fitted temperature, NLL and ECE before/after on the evaluation half; the
    GGUF with ``gguf_lora`` (the default adapter's GGUF form) applied, as llama.cpp runs it."""
    rows = [r for r in load_split(data, "validation", limit=cfg.token_rows) if r["output"]]
    encoded = [(r["id"], *encode(answerer.tokenizer, messages(r), cfg.max_len)) for r in rows]
    models = {"torch": answerer.model}
    if cfg.gguf:
        from kibidango.backends.llamacpp_backend import LlamaCppModel
        from methods.compression.gguf import tier_gguf

        if "gguf" not in inputs:
            raise KibidangoError("gguf: true needs the `gguf` input (stage 2D's GGUF files); the graph gives none")
        models["llamacpp"] = LlamaCppModel(tier_gguf(inputs["gguf"], cfg.tier, "the gguf input"), name="target")
        if gguf_lora is not None:
            from kibidango.addons.adapters import Adapter

            models["llamacpp"].load_lora("default", Adapter.from_dir(gguf_lora))
            models["llamacpp"].set_lora("default")
    out, curves = {}, {}
    for backend, model in models.items():
        fit_logits, fit_labels, eval_logits, eval_labels = [], [], [], []
        positions = 0
        for row_id, ids, start in encoded:
            if positions >= cfg.max_positions or start >= len(ids):
                continue
            logits = model.new_session().feed(ids, first=start - 1)[:-1]
            labels = ids[start:]
            positions += len(labels)
            (fit_logits if _fit_half(row_id, cfg.fit_share) else eval_logits).append(logits)
            (fit_labels if _fit_half(row_id, cfg.fit_share) else eval_labels).append(labels)
        if not fit_labels or not eval_labels:
            raise KibidangoError(f"too few validation rows ({len(encoded)}) for a fitting and an evaluation half")
        fx, fy = np.concatenate(fit_logits), np.concatenate(fit_labels)
        ex, ey = np.concatenate(eval_logits), np.concatenate(eval_labels)
        t = fit_temperature(fx, fy)
        before, after = token_confidence(ex, ey), token_confidence(ex, ey, t)
        out[backend] = {
            "temperature": t,
            "fit_positions": int(len(fy)),
            "eval_positions": int(len(ey)),
            "nll_before": float(before["nll"].mean()),
            "nll_after": float(after["nll"].mean()),
            "ece_before": ece(before["confidence"], before["correct"], BINS),
            "ece_after": ece(after["confidence"], after["correct"], BINS),
            "ece_equal_width_before": ece(before["confidence"], before["correct"], BINS, "equal_width"),
            "ece_equal_width_after": ece(after["confidence"], after["correct"], BINS, "equal_width"),
            "top1_accuracy": float(before["correct"].mean()),
        }
        curves[f"{backend} T=1"] = (before["confidence"], before["correct"])
        curves[f"{backend} T={t:.2f}"] = (after["confidence"], after["correct"])
        log.info(
            f"token level ({backend}): T={t:.3f}, ECE {out[backend]['ece_before']:.4f} -> "
            f"{out[backend]['ece_after']:.4f}"
        )
    reliability_plot(curves, out_dir / "reliability_tokens.png", "next tokens: top-1", BINS)
    return out


def _answers(
    cfg, rows, answerer: ScoredAnswerer, router, temperature: float, work_dir: Path, default: str | None
) -> list[dict]:
    """Every task answered with the default weights (``default``: an adapter, or None for the bare
    weights; the ``base`` answer) and, where the router picks a domain with an adapter, with that
    adapter, each answer judged; resumable (:func:`methods.heldout.answer_and_judge`).
    Two passes: every base answer, then the adapter answers grouped by adapter — answers decoded
    together share a forward only when they use the same weights, so interleaving base and adapter
    answers (or adapters) would split each step into one forward per adapter."""
    domains = answerer.adapters.adapters.domains if answerer.adapters is not None else []

    def variant(row: dict, adapter: str | None, judge) -> tuple[dict, bool]:
        a, feats = answerer.answer(row["instruction"], row["input"], adapter, temperature)
        judged = verdict_record(judge(row["task"], a.text), judge.kind)
        record = {
            "adapter": adapter,
            "answer": a.text,
            "tokens": a.tokens,
            "finish_reason": a.finish_reason,
            "features": feats,
            **judged,
        }
        return record, judged["retryable"]

    def base(row: dict, prior: dict | None, judge) -> dict:
        query = prompt_text(row["instruction"], row["input"])
        route, route_conf = router.route(query) if router is not None else ("base", None)
        record = {**task_record(row), "query": query, "route": route, "route_confidence": route_conf}
        record["split"] = "fit" if _fit_half(row["id"], cfg.fit_share) else "eval"
        # The gold answer judged like the model's: the cloud stand-in of stage 6C's sweep.
        reference = verdict_record(judge(row["task"], row["task"].reference), judge.kind)
        record["reference_passed"] = reference["passed"]
        record["query_tokens"] = len(answerer.tokenizer(query)["input_ids"])
        record["reference_tokens"] = len(answerer.tokenizer(row["task"].reference)["input_ids"])
        record["base"], retryable = variant(row, default, judge)
        record["retryable"] = retryable or reference["retryable"]
        return record

    def adapted(route: dict[str, str]):
        def answer(row: dict, prior: dict | None, judge) -> dict:
            record, retryable = variant(row, route[row["id"]], judge)
            return {"id": row["id"], "adapter": record, "retryable": retryable}

        return answer

    try:
        table = answer_and_judge(cfg, rows, work_dir / "base", "2G answers (base)", base, cfg.parallel)[0]
        route = {r["id"]: r["route"] for r in table if r["route"] in domains and r["route"] != default}
        routed = sorted((row for row in rows if row["id"] in route), key=lambda row: route[row["id"]])
        answers = answer_and_judge(
            cfg, routed, work_dir / "adapter", "2G answers (adapter)", adapted(route), cfg.parallel
        )[0]
    finally:
        answerer.close()
    by_id = {a["id"]: a for a in answers}
    for record in table:
        a = by_id.get(record["id"])
        record["adapter"] = None if a is None else a["adapter"]
        record["retryable"] = record["retryable"] or (a is not None and a["retryable"])
    return table


def _matrix(answers: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[a["features"][f] for f in ANSWER_FEATURES] for a in answers], dtype=np.float64)
    y = np.array([a["passed"] for a in answers], dtype=np.float64)
    return x.reshape(len(answers), len(ANSWER_FEATURES)), y


def _answer_level(cfg: Config, table: list[dict], out_dir: Path) -> dict:
    """The Platt model and its figures on the evaluation half."""
    every = [
        {**a, "split": r["split"], "domain": r["domain"]}
        for r in table
        for a in (r["base"], r["adapter"])
        if a is not None and a["outcome"] != "judge_error"
    ]
    scored = [a for a in every if a["features"] is not None]  # an empty answer has no features (confidence 0)
    fit = [a for a in scored if a["split"] == "fit"]
    held = [a for a in scored if a["split"] == "eval"]
    fx, fy = _matrix(fit)
    ex, ey = _matrix(held)
    raw = np.exp(ex[:, ANSWER_FEATURES.index("mean_logprob")]) if len(held) else np.zeros(0)
    out = {
        "answers": len(every),
        "scored": len(scored),
        "pass_rate": float(np.mean([a["passed"] for a in every])) if every else 0.0,
        "fit_answers": len(fit),
        "fit_passes": int(fy.sum()),
        "eval_answers": len(held),
        "eval_passes": int(ey.sum()),
        "by_domain": {
            d: {"answers": c, "passes": sum(1 for a in every if a["domain"] == d and a["passed"])}
            for d, c in sorted(Counter(a["domain"] for a in every).items())
        },
        "features": list(ANSWER_FEATURES),
        "ece_before": ece(raw, ey, BINS),
        "brier_before": brier(raw, ey),
        "auroc_before": auroc(raw, ey),
    }
    constant = np.full(len(ey), fy.mean() if len(fy) else 0.0)  # the fitting half's pass rate, for every answer
    out.update(ece_constant=ece(constant, ey, BINS), brier_constant=brier(constant, ey))
    fitted = bool(0 < fy.sum() < len(fy))
    model = fit_logistic(fx, fy, list(ANSWER_FEATURES), cfg.l2) if fitted else None
    after = model.predict(ex) if model is not None and len(held) else raw
    out.update(
        fitted=fitted,
        ece_after=ece(after, ey, BINS) if fitted else None,
        brier_after=brier(after, ey) if fitted else None,
        auroc_after=auroc(after, ey) if fitted else None,
        model=model,
        curves={"exp(mean log-prob)": (raw, ey), **({"Platt": (after, ey)} if fitted else {})},
    )
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _default_said(r: dict) -> str:
    """Which weights the token-level fit read, per backend."""
    name = r.get("default_adapter")
    if not name:
        return "The target's bare weights (no default adapter)."
    forms = r.get("default_adapter_forms", ["peft"])
    on = [b for b, f in (("torch", "peft"), ("llama.cpp", "gguf")) if f in forms]
    return f"The target as the bundle ships it: with its default adapter `{name}` on {' and '.join(on)}."


def _card(r: dict) -> str:
    a = r["answer"]
    lines = [
        "# Confidence calibration (stage 2G)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{r['command']}`). "
        f"ECE: {r['bins']} bins (each bin holds the same number of predictions). " + r.get("code_sandbox", ""),
        "",
        "## Token level: temperature scaling",
        "",
        _default_said(r),
        "",
        "| backend | T | positions fit / eval | NLL before | NLL after | ECE before | ECE after | top-1 acc |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, t in r["token"].items():
        lines.append(
            f"| {backend} | {t['temperature']:.3f} | {t['fit_positions']:,} / {t['eval_positions']:,} | "
            f"{t['nll_before']:.4f} | {t['nll_after']:.4f} | {t['ece_before']:.4f} | {t['ece_after']:.4f} | "
            f"{t['top1_accuracy']:.1%} |"
        )
    lines += [
        "",
        "## Answer level: Platt scaling to P(the judge passes)",
        "",
        f"{a['answers']:,} judged answers (the default weights"
        + (
            f", the target with its `{r['default_adapter']}` adapter,"
            if "peft" in r.get("default_adapter_forms", ["peft"]) and r.get("default_adapter")
            else ""
        )
        + " and the routed adapter; greedy at temperature "
        f"{r['decoding']['temperature']:g}, at most {r['decoding']['max_new_tokens']} new tokens: the runtime's "
        f"cascade decodes its local answers the same way), pass rate **{a['pass_rate']:.1%}**; "
        f"fitting half {a['fit_answers']:,} answers ({a['fit_passes']:,} pass), evaluation half "
        f"{a['eval_answers']:,} ({a['eval_passes']:,} pass). By domain: "
        + ", ".join(f"{d} {v['passes']}/{v['answers']}" for d, v in a["by_domain"].items())
        + ".",
        "",
        "| confidence | ECE | Brier | AUROC |",
        "|---|---:|---:|---:|",
        f"| exp(mean log-prob), raw | {_fmt(a['ece_before'])} | {_fmt(a['brier_before'])} | "
        f"{_fmt(a['auroc_before'])} |",
        f"| constant: the fitting half's pass rate | {_fmt(a['ece_constant'])} | {_fmt(a['brier_constant'])} | 0.5 |",
        f"| Platt ({', '.join(a['features'])}) | {_fmt(a['ece_after'])} | {_fmt(a['brier_after'])} | "
        f"{_fmt(a['auroc_after'])} |",
        "",
    ]
    if not a["fitted"]:
        lines.append(
            "The fitting half has one label class: nothing to fit, no answer model is shipped, and the runtime "
            "reports exp(calibrated mean log-prob). AUROC is undefined with one class."
        )
    elif min(a["eval_passes"], a["eval_answers"] - a["eval_passes"]) < 20:
        lines.append(
            "Few answers of the minority class: with this label balance a constant predictor already has a low "
            "ECE and Brier score, and AUROC rests on a handful of answers; read the figures as a check of the "
            "machinery, not of the model."
        )
    lines.append("")
    return "\n".join(lines)


def report_loop(artifact: Path) -> list[str]:
    """This stage's part of the report's "Does the loop work?" section: answer-level calibration."""
    manifest = artifact / "manifest.json"
    cal = json.loads(manifest.read_text()).get("metrics", {}) if manifest.is_file() else {}
    if not cal.get("answer/fitted"):
        return []
    return [
        "### Answer-level calibration",
        "",
        f"{int(cal['answer/fit_answers'])} judged answers fitted, {int(cal['answer/eval_answers'])} evaluated "
        f"({int(cal['answer/eval_passes'])} passing): ECE {cal['answer/ece_before']:.3f} -> "
        f"{cal['answer/ece_after']:.3f} (a constant at the pass rate: {cal['answer/ece_constant']:.3f}), Brier "
        f"{cal['answer/brier_before']:.3f} -> {cal['answer/brier_after']:.3f}, AUROC "
        f"{cal['answer/auroc_before']:.3f} -> {cal['answer/auroc_after']:.3f}.",
    ]
