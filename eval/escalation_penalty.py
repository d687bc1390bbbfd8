"""Stage 6B's escalation detector under its two penalty rules, on one stage 2G artifact: a fixed L2
penalty on every feature (6B before the cross-validated penalty) and 6B's own rule (the penalty on
the query features chosen by cross-validation, the confidence unpenalised), each against confidence
alone, with the fitting half whole and subsampled (the small preset fits on ~55 answers).

    python -m eval.escalation_penalty STORE/2G/KEY [--fixed 0.05] [--sizes 110,55] [--draws 5]

The detector is fitted on the fitting half (or a seeded subsample of it) and measured on the whole
evaluation half, as 6B does: AUROC for a failure, and the paired bootstrap of the difference from
confidence alone (6B's "earns its place" test). Printed as a table; nothing is written."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    from kibidango.addons.confidence import Calibrator, EscalationDetector
    from methods.calibration import auroc, fit_logistic, paired_auroc_difference
    from methods.failures import read_jsonl
    from stages.escalation import Config, design_matrix, examples, fit_detector

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calibration", type=Path, help="a stage 2G artifact (answers.jsonl, calibration.json)")
    ap.add_argument("--fixed", type=float, default=0.05, help="the fixed penalty compared (6B's before)")
    ap.add_argument("--sizes", default="110,55", help="fitting-half subsample sizes, besides the whole half")
    ap.add_argument("--draws", type=int, default=5, help="seeded subsamples per size")
    args = ap.parse_args(argv)

    cfg = Config()
    calibrator = Calibrator.load(args.calibration / "calibration.json")
    data = examples(read_jsonl(args.calibration / "answers.jsonl", "the calibration input (stage 2G)"), calibrator)
    names = EscalationDetector.feature_names(cfg.dim)
    fit = [e for e in data if e["split"] == "fit"]
    ex, ey = design_matrix([e for e in data if e["split"] == "eval"], cfg)
    baseline = 1 - ex[:, -1]
    rng = np.random.default_rng(0)
    print(f"{len(fit)} fitting answers, {len(ey)} evaluation answers ({int(ey.sum())} failures)")
    print(f"confidence alone: AUROC {auroc(baseline, ey):.3f}\n")
    print("| fitting answers | draw | fixed L2 AUROC | cross-validated L2 | its AUROC | minus confidence [95%] |")
    print("|---:|---:|---:|---:|---:|---|")
    sizes = [len(fit)] + [int(s) for s in args.sizes.split(",") if s and int(s) < len(fit)]
    for size in sizes:
        for draw in range(1 if size == len(fit) else args.draws):
            sub = [fit[i] for i in sorted(rng.choice(len(fit), size, replace=False))]
            fx, fy = design_matrix(sub, cfg)
            if not 0 < fy.sum() < size:
                print(f"| {size} | {draw} | one class | | | |")
                continue
            fixed = fit_logistic(fx, fy, names, args.fixed).predict(ex)
            model, l2, _ = fit_detector(fx, fy, cfg)
            chosen = model.predict(ex)
            d = paired_auroc_difference(chosen, baseline, ey)
            ci = f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d["ci"] else "-"
            print(
                f"| {size} | {draw} | {auroc(fixed, ey):.3f} | {l2:g} | {auroc(chosen, ey):.3f} | "
                f"{d['difference']:+.3f} {ci} |"
            )


if __name__ == "__main__":
    main()
