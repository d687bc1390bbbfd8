"""Stage 6C — threshold optimisation: the cascade's thresholds, chosen on held-out queries.

On stage 2G's evaluation half (tasks neither 2G's calibrator nor 6B's detector was fitted on),
every combination of

- ``router``: the router confidence at which the routed domain's adapter is used (else the default
  weights 2G answered with: the target with 2F's recovery LoRA, where it ships);
- ``qualifier``: the calibrated confidence at or above which the local answer is accepted;
- ``fallback``: the confidence below which the cloud answers instead (between the two: **cloud
  validation** — the cloud sees the question and the local answer and approves or corrects it);
- ``detector``: whether 6B's flag (p_fail >= its threshold) also sends an accepted answer to
  validation,

is scored by **judged quality** (share of queries whose final answer passes its judge), the
**share escalated** (queries that reach the cloud at all) and **dollars per 1K queries** at the
recipe's cloud prices. The cloud stand-in is the task's gold answer judged like any answer (2G
records its verdict and token counts): a real cloud model does no better, so cloud quality here is
an upper bound; validation is modelled as a judge that approves a passing answer (a short verdict)
and corrects a failing one with the cloud's answer (verdict + answer tokens). The choice follows the
recipe's objective: the best quality with at most ``max_escalated`` of queries escalated, the
cheaper on a tie — with a **margin** (``escalation_margin``): the cap must hold for the Wilson 95%
upper bound of the escalated share, not only for the share on these queries, so a threshold that
escalates 20% of a few hundred queries by luck of the sample is not taken at a 20% cap (a choice
at the in-sample cap exceeds it on fresh queries about half the time). The chosen values go into
``cascade.json`` (shape of the runtime's cascade config: ``router``, ``qualifier``, ``cloud``,
``escalation``), shipped in the bundle by stage X.

Outputs: ``cascade.json``, ``frontier.jsonl`` (every combination), ``frontier.png`` (quality vs
share escalated, coloured by cost, the Pareto frontier and the choice marked), ``THRESHOLDS_CARD.md``.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from kibidango.addons.confidence import Calibrator, EscalationDetector
from methods.failures import read_jsonl

LIBRARIES = ("numpy", "matplotlib")

log = logging.getLogger("kibidango.stage.6C")


class Cloud(StageConfig):
    name: str = Field(description="The cloud model the prices are of (recorded in cascade.json).")
    usd_per_1k_prompt: float = Field(ge=0, description="Dollars per 1,000 prompt tokens.")
    usd_per_1k_completion: float = Field(ge=0, description="Dollars per 1,000 completion tokens.")
    validation_prompt_tokens: int = Field(48, ge=0, description="The validation instruction around Q and A.")
    verdict_tokens: int = Field(8, ge=1, description="Tokens of an approving verdict.")


class Config(StageConfig):
    cloud: Cloud = Field(description="The cloud model whose prices the frontier is priced in.")
    max_escalated: float = Field(0.2, ge=0, le=1, description="Objective: at most this share of queries escalated.")
    router_thresholds: list[float] = Field(
        [0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 1.01],
        min_length=1,
        description="Router thresholds tried (above 1: never use an adapter).",
    )
    confidence_grid: int = Field(
        41, ge=2, description="Qualifier and fallback thresholds: this many quantiles of the local confidences."
    )
    escalation_margin: bool = Field(
        True, description="The cap holds for the Wilson 95% upper bound of the escalated share (out of sample)."
    )

    @model_validator(mode="after")
    def _sorted(self) -> Config:
        if any(t < 0 for t in self.router_thresholds):
            raise ValueError("router_thresholds: each is >= 0 (above 1: never use an adapter)")
        return self


def _queries(rows: list[dict], calibrator: Calibrator, detector: EscalationDetector) -> list[dict]:
    out = []
    for r in rows:
        if r["split"] != "eval" or r["base"]["outcome"] == "judge_error":
            continue
        q = {
            "route_confidence": r["route_confidence"] if r["route_confidence"] is not None else 0.0,
            "cloud_pass": bool(r["reference_passed"]),
            "query_tokens": r["query_tokens"],
            "reference_tokens": r["reference_tokens"],
        }
        for variant in ("base", "adapter"):
            a = r[variant]
            if a is None or a["outcome"] == "judge_error":
                a = r["base"]
            conf = calibrator.confidence(a["features"])
            q[variant] = {
                "pass": bool(a["passed"]),
                "confidence": conf,
                "flag": detector.p_fail(r["query"], conf) >= detector.threshold,
                "tokens": a["tokens"],
            }
        out.append(q)
    return out


def confidence_grid(queries: list[dict], size: int) -> np.ndarray:
    """Qualifier / fallback thresholds: ``size`` quantiles of the local answers' confidences (so
    each step moves about the same share of queries, however the confidences are spread), with 0
    (nothing below) and just above 1 (everything below)."""
    conf = np.array([q[v]["confidence"] for q in queries for v in ("base", "adapter")])
    return np.unique(np.concatenate([[0.0, 1.0 + 1e-9], np.quantile(conf, np.linspace(0, 1, size))]))


def sweep(queries: list[dict], cfg: Config, detector: bool = True) -> list[dict]:
    """Every threshold combination's quality, escalated share, tier split and $ per 1K queries;
    with the detector on and off, or (``detector`` False: 6B's did not earn its place) off only."""
    c = cfg.cloud
    n = len(queries)
    grid = confidence_grid(queries, cfg.confidence_grid)
    cloud_pass = np.array([q["cloud_pass"] for q in queries])
    q_tok = np.array([q["query_tokens"] for q in queries], dtype=np.float64)
    ref_tok = np.array([q["reference_tokens"] for q in queries], dtype=np.float64)
    cloud_usd = (q_tok * c.usd_per_1k_prompt + ref_tok * c.usd_per_1k_completion) / 1000
    results = []
    for r in cfg.router_thresholds:
        use = np.array([q["route_confidence"] >= r for q in queries])
        pick = [q["adapter"] if u else q["base"] for q, u in zip(queries, use)]
        local_pass = np.array([p["pass"] for p in pick])
        conf = np.array([p["confidence"] for p in pick])
        flag = np.array([p["flag"] for p in pick])
        ans_tok = np.array([p["tokens"] for p in pick], dtype=np.float64)
        valid_prompt = q_tok + ans_tok + c.validation_prompt_tokens
        valid_out = c.verdict_tokens + np.where(local_pass, 0, ref_tok)
        valid_usd = (valid_prompt * c.usd_per_1k_prompt + valid_out * c.usd_per_1k_completion) / 1000
        valid_pass = local_pass | cloud_pass
        for qual, fall, det in itertools.product(grid, grid, (False, True) if detector else (False,)):
            if fall > qual:
                continue
            cloud = conf < fall
            local = (conf >= qual) & ~(det & flag)
            valid = ~cloud & ~local
            quality = np.where(local, local_pass, np.where(valid, valid_pass, cloud_pass)).mean()
            usd = (np.where(valid, valid_usd, 0) + np.where(cloud, cloud_usd, 0)).sum() / n * 1000
            results.append(
                {
                    "router": float(r),
                    "qualifier": float(qual),
                    "fallback": float(fall),
                    "detector": det,
                    "quality": float(quality),
                    "escalated": float((valid | cloud).mean()),
                    "local": float(local.mean()),
                    "validated": float(valid.mean()),
                    "cloud": float(cloud.mean()),
                    "usd_per_1k_queries": float(usd),
                    "adapter_share": float(use.mean()),
                }
            )
    return results


def pareto(results: list[dict]) -> list[dict]:
    """The combinations no other beats on quality without escalating or costing more."""
    best: list[dict] = []
    for x in sorted(results, key=lambda x: (x["escalated"], x["usd_per_1k_queries"], -x["quality"])):
        if not best or x["quality"] > best[-1]["quality"] + 1e-12:
            best.append(x)
    return best


def choose(results: list[dict], max_escalated: float, queries: int | None = None) -> dict:
    """The objective's choice; with ``queries`` (how many the shares were measured on), the cap
    applies to the Wilson 95% upper bound of each combination's escalated share."""
    from methods.evaluation import wilson

    def share(x: dict) -> float:
        return wilson(round(x["escalated"] * queries), queries)[1] if queries else x["escalated"]

    allowed = [x for x in results if share(x) <= max_escalated + 1e-12]
    if not allowed:
        raise KibidangoError(f"no threshold combination escalates at most {max_escalated:.0%}")
    # Best quality; then cheaper; then fewer escalations; then the highest router threshold
    # (fewer adapter loads) and the lowest qualifier threshold (accept more locally).
    return max(
        allowed,
        key=lambda x: (round(x["quality"], 9), -x["usd_per_1k_queries"], -x["escalated"], x["router"], -x["qualifier"]),
    )


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    calibrator = Calibrator.load(inputs["calibration"] / "calibration.json")
    detector = EscalationDetector.load(inputs["detector"] / "escalation.json")
    rows = read_jsonl(inputs["calibration"] / "answers.jsonl", "the calibration input (stage 2G)")
    queries = _queries(rows, calibrator, detector)
    if not queries:
        raise KibidangoError("stage 2G's evaluation half has no judged query to sweep thresholds on")
    earns = bool(detector.metrics.get("earns_its_place", False))  # 6B: it beats confidence alone, or stays off
    results = sweep(queries, cfg, earns)
    front = pareto(results)
    chosen = choose(results, cfg.max_escalated, len(queries) if cfg.escalation_margin else None)
    local_only = choose(results, 0.0)
    cloud_only = max((x for x in results if x["cloud"] == 1.0), key=lambda x: (x["quality"], -x["usd_per_1k_queries"]))
    cascade = {
        "schema": 1,
        "source": "stage 6C (make stage-6c)",
        "router": {"threshold": chosen["router"]},
        "qualifier": {"threshold": chosen["qualifier"]},
        "cloud": {
            "fallback_threshold": chosen["fallback"],
            "model": cfg.cloud.name,
            "usd_per_1k_prompt": cfg.cloud.usd_per_1k_prompt,
            "usd_per_1k_completion": cfg.cloud.usd_per_1k_completion,
        },
        "escalation": {"use_detector": chosen["detector"]},
        "objective": {"max_escalated": cfg.max_escalated, "margin": "wilson-95" if cfg.escalation_margin else None},
        "expected": {
            k: chosen[k] for k in ("quality", "escalated", "local", "validated", "cloud", "usd_per_1k_queries")
        },
        "held_out_queries": len(queries),
    }
    (out_dir / "cascade.json").write_text(json.dumps(cascade, indent=2, sort_keys=True))
    with open(out_dir / "frontier.jsonl", "w", encoding="utf-8") as f:
        for x in results:
            f.write(json.dumps(x) + "\n")
    _plot(results, front, chosen, (local_only["quality"], cloud_only["quality"]), out_dir / "frontier.png")
    # the same share escalated at random: what a confidence that knows nothing reaches
    random_quality = local_only["quality"] + chosen["escalated"] * (cloud_only["quality"] - local_only["quality"])
    report = {
        "command": "make stage-6c",
        "random_escalation_quality": random_quality,
        "queries": len(queries),
        "combinations": len(results),
        "chosen": chosen,
        "local_only": local_only,
        "cloud_only": cloud_only,
        "frontier": front,
        "objective": cfg.max_escalated,
        "cloud": cfg.cloud.model_dump(),
    }
    (out_dir / "THRESHOLDS_CARD.md").write_text(_card(report))
    metrics = {f"chosen/{k}": float(v) for k, v in chosen.items()}
    metrics.update({"local_only/quality": local_only["quality"], "cloud_only/quality": cloud_only["quality"]})
    metrics["cloud_only/usd_per_1k_queries"] = cloud_only["usd_per_1k_queries"]
    metrics["random_escalation/quality"] = random_quality
    summary = (
        f"chosen (<= {cfg.max_escalated:.0%} escalated): router {chosen['router']:.2f}, qualifier "
        f"{chosen['qualifier']:.2f}, fallback {chosen['fallback']:.2f}, detector "
        f"{'on' if chosen['detector'] else 'off'} "
        f"-> quality {chosen['quality']:.1%}, escalated {chosen['escalated']:.1%}, "
        f"${chosen['usd_per_1k_queries']:.3f}/1K "
        f"queries (random escalation {random_quality:.1%}; local only {local_only['quality']:.1%}; cloud only "
        f"{cloud_only['quality']:.1%} at "
        f"${cloud_only['usd_per_1k_queries']:.3f}/1K) on {len(queries)} held-out queries"
    )
    return StageResult(metrics, ["THRESHOLDS_CARD.md", "frontier.png", "cascade.json"], summary)


def _plot(results: list[dict], front: list[dict], chosen: dict, ends: tuple[float, float], path: Path) -> None:
    """Every combination, the Pareto frontier, the choice, and the random line: escalating a share
    of the queries at random (from local-only quality at 0 to cloud-only quality at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    sc = ax.scatter(
        [x["escalated"] for x in results],
        [x["quality"] for x in results],
        c=[x["usd_per_1k_queries"] for x in results],
        s=6,
        cmap="viridis",
        alpha=0.5,
    )
    ax.plot(
        [x["escalated"] for x in front], [x["quality"] for x in front], color="#c33", lw=1.2, label="Pareto frontier"
    )
    ax.plot([0, 1], list(ends), color="#777", lw=1, ls="--", label="random escalation")
    ax.scatter([chosen["escalated"]], [chosen["quality"]], marker="*", s=160, color="#c33", label="chosen")
    fig.colorbar(sc, ax=ax, label="$ per 1K queries")
    ax.set_xlabel("share of queries escalated to the cloud")
    ax.set_ylabel("judged quality (share passing)")
    ax.set_title("cascade thresholds on held-out queries (6C)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _row(name: str, x: dict) -> str:
    return (
        f"| {name} | {x['router']:.2f} | {x['qualifier']:.4f} | {x['fallback']:.4f} | "
        f"{'on' if x['detector'] else 'off'} "
        f"| {x['quality']:.1%} | {x['escalated']:.1%} | {x['local']:.0%} / {x['validated']:.0%} / {x['cloud']:.0%} "
        f"| ${x['usd_per_1k_queries']:.4f} |"
    )


def _card(r: dict) -> str:
    front = r["frontier"]
    step = max(1, -(-len(front) // 20))
    shown = front[::step] + ([front[-1]] if (len(front) - 1) % step else [])
    head = [
        "| | router | qualifier | fallback | detector | quality | escalated | local / validated / cloud | $ / 1K "
        "queries |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    lines = [
        "# Cascade thresholds (stage 6C)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{r['command']}`), on {r['queries']} "
        f"held-out queries (stage 2G's evaluation half), {r['combinations']:,} threshold combinations. Cloud: "
        f"{r['cloud']['name']} at ${r['cloud']['usd_per_1k_prompt']}/1K prompt and "
        f"${r['cloud']['usd_per_1k_completion']}/1K completion tokens; its stand-in answer is the gold answer, "
        "judged (an upper bound on a real model); validation approves a passing local answer and corrects a "
        "failing one.",
        "",
        *head,
        _row(f"**chosen** (<= {r['objective']:.0%} escalated)", r["chosen"]),
        _row("local only", r["local_only"]),
        _row("cloud only", r["cloud_only"]),
        "",
        f"Escalating the same {r['chosen']['escalated']:.0%} of queries at random would reach "
        f"{r['random_escalation_quality']:.1%}: the difference is what the confidence (and the router) buy.",
        "",
        f"Pareto frontier (no combination is better on quality without escalating more or costing more; "
        f"{len(r['frontier'])} points, {len(shown)} shown, all in `frontier.jsonl` with every other combination):",
        "",
        *head,
        *(_row("", x) for x in shown),
        "",
        "![frontier](frontier.png)",
        "",
    ]
    return "\n".join(lines)


def report_loop(artifact: Path) -> list[str]:
    """This stage's part of the report's "Does the loop work?" section: the cascade at its chosen
    thresholds against escalating the same share at random."""
    manifest = artifact / "manifest.json"
    th = json.loads(manifest.read_text()).get("metrics", {}) if manifest.is_file() else {}
    if not th:
        return []
    return [
        "### The cascade against random escalation",
        "",
        f"At the chosen thresholds {th['chosen/escalated']:.0%} of held-out queries are escalated for a judged "
        f"quality of {th['chosen/quality']:.1%}; escalating the same share at random reaches "
        f"{th['random_escalation/quality']:.1%} (local only {th['local_only/quality']:.1%}, cloud only "
        f"{th['cloud_only/quality']:.1%}).",
    ]
