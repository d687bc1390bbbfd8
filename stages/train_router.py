"""Stage 6A — domain router: which domain adapter (or none: ``base``) a query should get.

Trained on stage 0's domain labels (train split), evaluated on its test split; the features are
the runtime's hashed n-grams and the model an MLP dim-64-32-K (:mod:`kibidango.addons.router`, trained by
:mod:`methods.routing`), so the runtime loads ``router.json`` with numpy alone. The labels are
``domains`` whose adapter input is wired and ships (the bundle's adapters) plus ``base`` for a
row of any other domain. A control trained
on shuffled labels shows what the features alone do not explain.

Outputs: ``router.json``, ``router_eval.json`` (accuracy, majority baseline, control, per-domain
confusion), ``ROUTER_CARD.md``. Latency is a benchmark, not a stage figure: ``make bench-router``.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult
from methods.routing import confusion, train_router
from methods.training.adapter_manifest import ships
from methods.training.chat import load_split, prompt_text

LIBRARIES = ("torch", "numpy", "datasets")

log = logging.getLogger("kibidango.stage.6A")


class Config(StageConfig):
    domains: list[str] = Field(
        description="Domains that may have an adapter (an input of that name): those whose adapter is wired and "
        "ships are routed to; every other row is labelled `base`."
    )
    dim: int = Field(128, gt=0, description="Hashed feature dimensions (the plan's 128).")
    hidden: list[int] = Field([64, 32], description="Hidden layer widths (the plan's 64-32).")
    epochs: int = Field(20, gt=0, description="Passes over the training rows.")
    learning_rate: float = Field(3e-3, gt=0, description="Adam's learning rate.")
    balanced: bool = Field(True, description="Weight the loss by inverse class frequency.")
    max_train_rows: int | None = Field(None, gt=0, description="Most training rows (None: all).")
    seed: int = Field(0, description="Seed of the initialisation and the row order.")


def query_text(row: dict) -> str:
    """What the router sees of a stage-0 row: the instruction and input, or a plain text's start."""
    return prompt_text(row["instruction"], row["input"]) or row["output"][:200]


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    data = inputs["data"] / "dataset"
    # route only to adapters that ship: a domain whose adapter input (named for the domain) is not
    # wired (the preset does not run its stage) or whose stage's check found it no better than the
    # weights it modifies is routed to `base`
    domains = [d for d in cfg.domains if d in inputs and ships(inputs[d])]
    unwired = [d for d in cfg.domains if d not in inputs]
    if unwired:
        log.info(f"routing no query to {', '.join(unwired)}: no adapter input (the preset does not run its stage)")
    dropped = sorted(set(cfg.domains) - set(domains) - set(unwired))
    if dropped:
        log.info(f"routing no query to {', '.join(dropped)}: those adapters do not ship")
    labels = [*domains, "base"]

    def rows(split: str, limit: int | None = None) -> tuple[list[str], list[str]]:
        got = load_split(data, split, limit=limit)
        return [query_text(r) for r in got], [r["domain"] if r["domain"] in domains else "base" for r in got]

    train_x, train_y = rows("train", cfg.max_train_rows)
    test_x, test_y = rows("test")
    if not train_x or not test_x:
        raise KibidangoError(f"stage 0's output ({data}) has an empty train or test split")
    settings = dict(hidden=tuple(cfg.hidden), dim=cfg.dim, epochs=cfg.epochs, lr=cfg.learning_rate)
    settings.update(seed=cfg.seed, balanced=cfg.balanced)
    router = train_router(train_x, train_y, labels, **settings)
    result = confusion(router, test_x, test_y)
    shuffled = train_y[:]
    random.Random(cfg.seed).shuffle(shuffled)
    control = confusion(train_router(train_x, shuffled, labels, **settings), test_x, test_y)
    majority = max(test_y.count(d) for d in labels) / len(test_y)
    per_domain = {
        d: (result["confusion"].get(d, {}).get(d, 0) / test_y.count(d)) if test_y.count(d) else None for d in labels
    }
    router.metrics = {"test_accuracy": result["accuracy"], "majority_baseline": majority}
    (out_dir / "router.json").write_text(json.dumps(router.to_dict()))
    report = {
        "command": "make stage-6a",
        "labels": labels,
        "train_rows": len(train_x),
        "test_rows": len(test_x),
        "accuracy": result["accuracy"],
        "majority_baseline": majority,
        "shuffled_label_control": control["accuracy"],
        "recall": per_domain,
        "confusion": result["confusion"],
        "class_counts": {d: train_y.count(d) for d in labels},
    }
    (out_dir / "router_eval.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out_dir / "ROUTER_CARD.md").write_text(_card(report))
    metrics = {
        "test_accuracy": result["accuracy"],
        "majority_baseline": majority,
        "shuffled_label_control": control["accuracy"],
        "train_rows": len(train_x),
        **{f"recall/{d}": r for d, r in per_domain.items() if r is not None},
    }
    summary = (
        f"test accuracy {result['accuracy']:.1%} on {len(test_x):,} rows (majority class {majority:.1%}, "
        f"shuffled-label control {control['accuracy']:.1%}); recall "
        + ", ".join(f"{d} {r:.0%}" for d, r in per_domain.items() if r is not None)
    )
    return StageResult(metrics, ["ROUTER_CARD.md", "router_eval.json"], summary)


def _card(r: dict) -> str:
    labels = r["labels"]
    lines = [
        "# Domain router (stage 6A)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{r['command']}`).",
        "",
        f"Test accuracy **{r['accuracy']:.1%}** on {r['test_rows']:,} rows of stage 0's test split (majority class "
        f"{r['majority_baseline']:.1%}; the same model trained on shuffled labels {r['shuffled_label_control']:.1%}). "
        f"Training rows per label: " + ", ".join(f"{d} {r['class_counts'][d]:,}" for d in labels) + ".",
        "",
        "| true \\ predicted | " + " | ".join(labels) + " | recall |",
        "|---|" + "---:|" * (len(labels) + 1),
    ]
    for t in labels:
        row = r["confusion"].get(t, {})
        recall = r["recall"][t]
        lines.append(
            f"| {t} | "
            + " | ".join(str(row.get(p, 0)) for p in labels)
            + f" | {'-' if recall is None else f'{recall:.0%}'} |"
        )
    lines.append("")
    return "\n".join(lines)
