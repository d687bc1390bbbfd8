"""Stage 6B — escalation detector: P(the local answer fails) from the query and the answer's
calibrated confidence, so the cascade can send a query to the cloud before trusting it.

Trained on stage 2G's judged answers (its fitting half; base and adapter answers alike), measured
on 2G's evaluation half (tasks the fit never saw). Features: the query's hashed n-grams (the
router's :func:`kibidango.addons.router.features`, 128-d) and the calibrated confidence (2G's
:class:`kibidango.addons.confidence.Calibrator`); the model is a logistic regression
(:func:`methods.calibration.fit_logistic`), shipped as the runtime's
:class:`kibidango.addons.confidence.EscalationDetector`. The decision threshold is the highest one whose
recall of failures reaches the recipe's ``recall`` **on the fitting half**; on the evaluation half
the card gives AUROC, the precision and recall at that threshold, and the precision at the recall
asked for, beside a confidence-only detector (1 - confidence) as the baseline. The detector
**earns its place** only when its AUROC beats confidence alone by a paired bootstrap (the 95%
interval of the difference above 0); otherwise stage 6C never switches it on and stage X ships
none.

Outputs: ``escalation.json``, ``escalation_eval.json``, ``ESCALATION_CARD.md``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from pydantic import Field, field_validator

from core.contract import KibidangoError, StageConfig, StageResult
from kibidango.addons.confidence import Calibrator, EscalationDetector, Logistic
from methods.calibration import auroc, choose_l2, fit_logistic, paired_auroc_difference, precision_at_recall
from methods.failures import read_jsonl

LIBRARIES = ("torch", "numpy")

log = logging.getLogger("kibidango.stage.6B")


class Config(StageConfig):
    recall: float = Field(0.9, gt=0, le=1, description="Share of failing answers the detector must flag.")
    dim: int = Field(128, gt=0, description="Hashed query feature dimensions.")
    salt: str = Field("kibidango-router-v1", description="Feature hash salt (the router's, so features are shared).")
    l2: list[float] = Field(
        [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0],
        min_length=1,
        description="L2 penalties on the query features (standardised; the confidence's weight is not penalised) "
        "tried by cross-validation on the fitting half; the lowest mean held-out log loss is fitted.",
    )
    folds: int = Field(5, ge=2, description="Cross-validation folds for the penalty (stratified by outcome).")

    @field_validator("l2")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(p < 0 for p in v):
            raise ValueError(f"L2 penalties must be >= 0, got {v}")
        return v


def examples(rows: list[dict], calibrator: Calibrator) -> list[dict]:
    """One example per judged answer of 2G's table: query, calibrated confidence, failed, split."""
    out = []
    for r in rows:
        for a in (r["base"], r["adapter"]):
            if a is None or a["outcome"] == "judge_error":
                continue
            out.append(
                {
                    "query": r["query"],
                    "confidence": calibrator.confidence(a["features"]),
                    "failed": not a["passed"],
                    "split": r["split"],
                    "domain": r["domain"],
                }
            )
    return out


def design_matrix(rows: list[dict], cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The detector's inputs for :func:`examples` rows (the runtime's own vector: hashed query n-grams,
    then the confidence) and whether each answer failed."""
    probe = EscalationDetector(_constant(EscalationDetector.feature_names(cfg.dim)), cfg.dim, cfg.salt, 0.5)
    x = np.stack([probe.vector(e["query"], e["confidence"]) for e in rows])
    return x, np.array([e["failed"] for e in rows], dtype=np.float64)


def _constant(names: list[str], bias: float = 0.0) -> Logistic:
    """A logistic regression that ignores its inputs (every weight 0, the features unscaled): ``bias``."""
    n = len(names)
    return Logistic(names, [0.0] * n, bias, [0.0] * n, [1.0] * n)


def fit_detector(x: np.ndarray, y: np.ndarray, cfg: Config) -> tuple[Logistic, float, dict[float, float]]:
    """The detector's logistic regression on :func:`design_matrix` rows, the L2 penalty on the query
    features only (the confidence, the last feature, is never penalised) chosen from ``cfg.l2`` by
    cross-validation (:func:`methods.calibration.choose_l2`); with one class, a constant (its rate) at
    the largest penalty. Returns (model, penalty, mean held-out log loss per penalty)."""
    names = EscalationDetector.feature_names(cfg.dim)
    if not 0 < y.sum() < len(y):
        rate = min(max(float(y.mean()), 1e-6), 1 - 1e-6)
        return _constant(names, float(np.log(rate / (1 - rate)))), max(cfg.l2), {}
    confidence = (len(names) - 1,)
    l2, cv_loss = choose_l2(x, y, cfg.l2, cfg.folds, free=confidence)
    return fit_logistic(x, y, names, l2, free=confidence), l2, cv_loss


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    calibration = inputs["calibration"]
    calibrator = Calibrator.load(calibration / "calibration.json")
    data = examples(read_jsonl(calibration / "answers.jsonl", "the calibration input (stage 2G)"), calibrator)
    fit = [e for e in data if e["split"] == "fit"]
    held = [e for e in data if e["split"] == "eval"]
    if not fit or not held:
        raise KibidangoError(f"stage 2G's answers have {len(fit)} fitting and {len(held)} evaluation rows; need both")
    fx, fy = design_matrix(fit, cfg)
    ex, ey = design_matrix(held, cfg)
    fitted = bool(0 < fy.sum() < len(fy))
    model, l2, cv_loss = fit_detector(fx, fy, cfg)
    if fitted:
        log.info(
            "6B: L2 penalty %g on the query features (%d-fold cross-validation on %d answers)", l2, cfg.folds, len(fy)
        )
    fit_scores, eval_scores = model.predict(fx), model.predict(ex)
    at = precision_at_recall(fit_scores, fy, cfg.recall)
    threshold = at[0] if at is not None else 1.0
    flagged = eval_scores >= threshold
    baseline = 1 - np.array([e["confidence"] for e in held])
    eval_at = precision_at_recall(eval_scores, ey, cfg.recall)
    base_at = precision_at_recall(baseline, ey, cfg.recall)
    versus = paired_auroc_difference(eval_scores, baseline, ey)
    report = {
        "command": "make stage-6b",
        "fitted": fitted,
        "fit_answers": len(fit),
        "fit_failures": int(fy.sum()),
        "l2": l2,
        "l2_cv_log_loss": {f"{k:g}": v for k, v in cv_loss.items()},
        "folds": cfg.folds,
        "eval_answers": len(held),
        "eval_failures": int(ey.sum()),
        "recall_asked": cfg.recall,
        "threshold": threshold,
        "auroc": auroc(eval_scores, ey),
        "auroc_confidence_only": auroc(baseline, ey),
        "auroc_difference": versus["difference"],
        "auroc_difference_ci": versus["ci"],
        "earns_its_place": bool(versus["ci"] is not None and versus["ci"][0] > 0),
        "eval_precision_at_threshold": float(ey[flagged].mean()) if flagged.any() else None,
        "eval_recall_at_threshold": float(flagged[ey == 1].mean()) if ey.any() else None,
        "eval_flagged_share": float(flagged.mean()),
        "eval_precision_at_recall": eval_at[1] if eval_at else None,
        "eval_precision_at_recall_confidence_only": base_at[1] if base_at else None,
        "eval_failure_rate": float(ey.mean()),
    }
    detector = EscalationDetector(
        model, cfg.dim, cfg.salt, threshold, {k: v for k, v in report.items() if k != "command"}
    )
    (out_dir / "escalation.json").write_text(json.dumps(detector.to_dict()))
    (out_dir / "escalation_eval.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out_dir / "ESCALATION_CARD.md").write_text(_card(report))
    metrics = {k: float(v) for k, v in report.items() if isinstance(v, int | float)}
    summary = (
        f"AUROC {_f(report['auroc'])} on {len(held)} held-out answers ({int(ey.sum())} failures; confidence alone "
        f"{_f(report['auroc_confidence_only'])}); at threshold {threshold:.3f} (recall {cfg.recall:.0%} on the fit "
        f"half): precision {_f(report['eval_precision_at_threshold'])}, recall {_f(report['eval_recall_at_threshold'])}"
    )
    return StageResult(metrics, ["ESCALATION_CARD.md", "escalation_eval.json"], summary)


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _penalty(r: dict) -> str:
    losses = r.get("l2_cv_log_loss") or {}
    if not losses:
        return (
            f"L2 penalty on the query features: {r['l2']:g} (the largest asked: too few answers of one outcome "
            "to cross-validate)."
        )
    curve = ", ".join(f"{k}: {v:.3f}" for k, v in losses.items())
    return (
        f"L2 penalty on the query features: **{r['l2']:g}**, the lowest mean held-out log loss of "
        f"{r['folds']}-fold cross-validation on the fitting half ({curve}); the confidence's weight is not "
        "penalised, so the largest penalty is close to confidence alone."
    )


def _card(r: dict) -> str:
    lines = [
        "# Escalation detector (stage 6B)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{r['command']}`).",
        "",
        f"Trained on {r['fit_answers']} judged answers of stage 2G's fitting half ({r['fit_failures']} failures), "
        f"measured on {r['eval_answers']} answers of its evaluation half ({r['eval_failures']} failures, "
        f"{r['eval_failure_rate']:.1%}).",
        "",
        _penalty(r),
        "",
        "| detector | AUROC | precision at recall " + f"{r['recall_asked']:.0%} |",
        "|---|---:|---:|",
        f"| query n-grams + calibrated confidence | {_f(r['auroc'])} | {_f(r['eval_precision_at_recall'])} |",
        f"| 1 - calibrated confidence | {_f(r['auroc_confidence_only'])} | "
        f"{_f(r['eval_precision_at_recall_confidence_only'])} |",
        "",
        f"Against confidence alone: AUROC difference {_f(r.get('auroc_difference'))} "
        + (
            f"[{r['auroc_difference_ci'][0]:.3f}, {r['auroc_difference_ci'][1]:.3f}] (paired bootstrap, 95%)"
            if r.get("auroc_difference_ci")
            else "(undefined: one class)"
        )
        + (
            ": it **earns its place** (6C may switch it on; X ships it)."
            if r.get("earns_its_place")
            else ": it does **not** beat confidence alone, so 6C never switches it on and X ships no detector."
        ),
        "",
        f"Threshold {r['threshold']:.4f} (chosen on the fitting half for recall {r['recall_asked']:.0%}): "
        f"on the evaluation half it flags {r['eval_flagged_share']:.1%} of answers, precision "
        f"{_f(r['eval_precision_at_threshold'])}, recall {_f(r['eval_recall_at_threshold'])}.",
        "",
    ]
    if not r["fitted"]:
        lines.append("The fitting half has one class: the detector is a constant (its failure rate).")
    if r["eval_failure_rate"] > 0.7:
        lines.append(
            "Most local answers fail here, so flagging everything already has a high precision; the AUROC says "
            "whether the detector ranks failures first."
        )
    lines.append("")
    return "\n".join(lines)
