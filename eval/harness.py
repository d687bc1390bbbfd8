"""``make eval-harness``: EleutherAI's lm-evaluation-harness on the bundle, the way its users run it
against any OpenAI-compatible server — lm-eval's ``local-chat-completions`` model talking to
``kibidango serve`` on 127.0.0.1 (with an API key) — on GSM8K, beside stage 9's own figure on the
same tasks.

- **Tasks**: the GSM8K tasks of the newest stage-9 run in the workspace (its evaluation part of
  ``../shared/data/gsm8k/test.jsonl``: no stage trained or chose anything on them), written as a
  local JSONL and read by a local lm-eval task definition (``dataset_path: json``): nothing comes
  from a hub. The task follows lm-eval's own ``gsm8k`` task: the question as the prompt, the
  number after ``####`` as the target, greedy decoding, ``exact_match`` after its two filters —
  ``strict-match`` (the number after ``#### ``) and ``flexible-extract`` (the last number).
- **Bundle**: the one stage 9 evaluated (its ``bundle`` input), served with the router's adapter
  (``auto``), so the figure to compare is stage 9's ``auto``.
- **Compared**: accuracy with Wilson 95% intervals, per-task agreement of the two verdicts and an
  exact McNemar test. What differs is said in the output: the server renders the bundle's own chat
  template (stage 9 renders the family's training template), lm-eval's regexes against stage 9's
  math judge (the last number of the answer), and lm-eval's stop strings.
- **Recorded**: an MLflow run ``eval-harness`` in the preset's experiment, a child of the flow
  run that computed stage 9 (tags: the stage-9 run, the bundle), with both accuracies; every
  task's two answers in ``<workspace>/reports/eval-harness.json``; the table for ``make report``.

Code benchmarks stay in stage 9: lm-eval's HumanEval/MBPP tasks execute the model's programs in
its own process (``HF_ALLOW_CODE_EVAL=1``, no sandbox); ours run in the code judge's sandbox.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from core.measurements import make_command, shown_path, write_record
from core.paths import home, tracking_uri
from core.store import ArtifactStore

KEY_ENV = "KIBIDANGO_HARNESS_KEY"
TASK = "kibidango_gsm8k"

# lm-eval's own gsm8k task (lm_eval/tasks/gsm8k/gsm8k.yaml), the dataset local
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: {max_tokens}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
"""


def stage9_tasks(store: ArtifactStore, evaluation: Path, sample: str = "gsm8k") -> tuple[list[dict], Path]:
    """Stage 9's GSM8K tasks (question, gold answer, its ``auto`` verdict) and the bundle it evaluated."""
    from methods.benchmarks import load_tasks

    manifest = json.loads((evaluation / "manifest.json").read_text())
    spec = next((s for s in manifest["config"]["samples"] if s["name"] == sample), None)
    if spec is None or spec.get("source") != "gsm8k":
        raise SystemExit(f"stage 9 ({evaluation}) has no GSM8K sample named {sample!r}")
    key = manifest["inputs"]["bundle"]["key"]
    bundle = next((p / "bundle" for p in store.root.glob(f"*/{key}") if (p / "bundle" / "bundle.json").is_file()), None)
    if bundle is None:
        raise SystemExit(f"the bundle stage 9 evaluated (key {key}) is not in {store.root}")
    gold = {t.id: t.task for t in load_tasks("gsm8k", spec["path"])}
    rows = []
    for line in (evaluation / "answers.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if r["sample"] == sample:
            task = gold[r["id"]]
            rows.append(
                {"id": r["id"], "question": task.prompt, "answer": task.reference, "stage9": r["answers"]["auto"]}
            )
    return rows, bundle


def run_harness(rows: list[dict], base: str, model: str, max_tokens: int, tmp: Path) -> dict:
    """lm-eval's simple_evaluate with its local-chat-completions model on ``rows``; per task id:
    the answer and both filters' verdicts."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({k: r[k] for k in ("id", "question", "answer")}) + "\n" for r in rows))
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data, max_tokens=max_tokens))
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={
            "model": model,
            "base_url": f"{base}/chat/completions",
            "num_concurrent": 1,
            "max_retries": 3,
            "tokenized_requests": False,
            "timeout": 600,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tmp / "tasks")),
        apply_chat_template=True,
        log_samples=True,
    )
    per_task = {}
    for s in results["samples"][TASK]:
        doc_id = s["doc"]["id"]
        entry = per_task.setdefault(doc_id, {"answer": s["resps"][0][0]})
        entry[s["filter"]] = bool(s["exact_match"])
    metrics = results["results"][TASK]
    return {
        "accuracy": {f: metrics[f"exact_match,{f}"] for f in ("strict-match", "flexible-extract")},
        "per_task": per_task,
        "lm_eval_version": lm_eval.__version__,
    }


def compare(rows: list[dict], harness: dict) -> dict:
    """Both accuracies with Wilson intervals, their per-task agreement and an exact McNemar p-value
    (lm-eval's flexible-extract against stage 9's math judge: both take the last number)."""
    from methods.evaluation import mcnemar, wilson

    n = len(rows)
    ours = {r["id"]: bool(r["stage9"]["passed"]) for r in rows}
    theirs = {r["id"]: harness["per_task"][r["id"]]["flexible-extract"] for r in rows}
    strict = sum(harness["per_task"][r["id"]]["strict-match"] for r in rows)
    test = mcnemar(ours, theirs)
    return {
        "n": n,
        "stage9": {"accuracy": sum(ours.values()) / n, "ci": list(wilson(sum(ours.values()), n))},
        "flexible-extract": {"accuracy": sum(theirs.values()) / n, "ci": list(wilson(sum(theirs.values()), n))},
        "strict-match": {"accuracy": strict / n, "ci": list(wilson(strict, n))},
        "agree": n - test["a_only"] - test["b_only"],
        "only_stage9": test["a_only"],
        "only_harness": test["b_only"],
        "mcnemar_p": test["p"],
        "same_answer_text": sum(
            harness["per_task"][r["id"]]["answer"].strip() == (r["stage9"].get("text") or "").strip() for r in rows
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="whose bundle (default: tiny; make passes PRESET)")
    parser.add_argument("--evaluation", type=Path, help="a stage-9 artifact (default: the preset's newest)")
    parser.add_argument("--limit", type=int, help="at most this many of stage 9's GSM8K tasks")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from eval.lineage import newest
    from eval.server_load import serve_bundle, stop_server
    from methods.local_server import free_port

    store = ArtifactStore(home() / "store")
    evaluation = args.evaluation or newest(store, "9", args.preset)
    if evaluation is None:
        print("no stage-9 artifact in the workspace: run `make demo` first", file=sys.stderr)
        return 1
    rows, bundle = stage9_tasks(store, evaluation)
    rows = rows[: args.limit] if args.limit else rows
    if not rows:
        print(f"stage 9 ({evaluation}) evaluated no GSM8K task", file=sys.stderr)
        return 1
    manifest = json.loads((evaluation / "manifest.json").read_text())
    max_tokens = int(manifest["config"].get("max_new_tokens", 256))
    print(f"{len(rows)} GSM8K tasks of stage 9 ({shown_path(evaluation)}); bundle {shown_path(bundle)}", flush=True)

    key = "kbd-harness-" + os.urandom(12).hex()
    os.environ[KEY_ENV] = key
    os.environ["OPENAI_API_KEY"] = key  # lm-eval's local-chat-completions reads its key here
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kbd-harness-") as tmp:
        port = free_port()
        options = ("--api-key-env", KEY_ENV, "--threads", "1")
        proc = serve_bundle(bundle, port, Path(tmp) / "server.log", *options, timeout_s=300)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            import urllib.request

            request = urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
            model = json.loads(urllib.request.urlopen(request, timeout=30).read())["data"][0]["id"]
            harness = run_harness(rows, base, model, max_tokens, Path(tmp))
        finally:
            stop_server(proc)
    figures = compare(rows, harness)
    report = {
        "command": "make eval-harness",
        "evaluation": str(evaluation),
        "bundle": str(bundle),
        "model": model,
        "max_tokens": max_tokens,
        "lm_eval_version": harness["lm_eval_version"],
        "lm_eval_accuracy": harness["accuracy"],
        "figures": figures,
        "stage9_run_id": manifest.get("mlflow_run_id"),
        "wall_s": time.monotonic() - started,
    }
    out = args.out or home() / "reports" / f"eval-harness-{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = [{**r, "harness": harness["per_task"][r["id"]]} for r in rows]
    out.write_text(json.dumps({**report, "tasks": tasks}, indent=2, ensure_ascii=False))
    run_id = _log_mlflow(report)
    table = _table(report) + f"\n\nMLflow run `{run_id}`; every task's two answers: `{shown_path(out)}`."
    print(table)
    command = make_command("eval-harness", sys.argv[1:] if argv is None else argv)
    title = "lm-evaluation-harness on the bundle (GSM8K) against stage 9"
    print(f"record: {write_record('eval-harness', title, command, markdown=table, data=report, preset=args.preset)}")
    return 0


def _log_mlflow(report: dict) -> str | None:
    """An ``eval-harness`` run beside stage 9's: in its experiment, a child of its flow run."""
    import socket

    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient
    from mlflow.utils.time import get_current_time_millis

    stage9 = report["stage9_run_id"]
    if not stage9:
        return None
    client = MlflowClient(tracking_uri())
    run = client.get_run(stage9)
    tags = {
        "kibidango.measurement": "eval-harness",
        "kibidango.stage9_run_id": stage9,
        "kibidango.bundle": report["bundle"],
        "kibidango.lm_eval_version": report["lm_eval_version"],
        "kibidango.host": socket.gethostname(),
        "kibidango.pid": str(os.getpid()),
    }
    if run.data.tags.get("mlflow.parentRunId"):
        tags["mlflow.parentRunId"] = run.data.tags["mlflow.parentRunId"]
    run_id = client.create_run(run.info.experiment_id, run_name="eval-harness", tags=tags).info.run_id
    f, now = report["figures"], get_current_time_millis()
    figures = {
        "gsm8k/lm_eval/flexible_extract": f["flexible-extract"]["accuracy"],
        "gsm8k/lm_eval/strict_match": f["strict-match"]["accuracy"],
        "gsm8k/stage9/accuracy": f["stage9"]["accuracy"],
        "gsm8k/agreement": f["agree"] / f["n"],
        "gsm8k/mcnemar_p": f["mcnemar_p"],
    }
    params = {"tasks": str(f["n"]), "max_tokens": str(report["max_tokens"]), "model": "local-chat-completions"}
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in figures.items()],
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag("mlflow.runName", "eval-harness")],
    )
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _table(r: dict) -> str:
    f = r["figures"]

    def row(name: str, x: dict) -> str:
        return f"| {name} | {x['accuracy']:.1%} | [{x['ci'][0]:.1%}, {x['ci'][1]:.1%}] |"

    n = f["n"]
    return "\n".join(
        [
            f"{n} GSM8K tasks of stage 9's evaluation part; lm-eval {r['lm_eval_version']} "
            f"(`local-chat-completions` against `kibidango serve`, greedy, at most {r['max_tokens']} tokens)",
            "",
            "| GSM8K accuracy | value | Wilson 95% |",
            "|---|---:|---|",
            row("stage 9 (runtime, math judge: the last number)", f["stage9"]),
            row("lm-eval flexible-extract (the last number)", f["flexible-extract"]),
            row("lm-eval strict-match (the number after ####)", f["strict-match"]),
            "",
            f"Per task, stage 9 and flexible-extract agree on {f['agree']}/{n} (stage 9 only {f['only_stage9']}, "
            f"lm-eval only {f['only_harness']}; McNemar exact p = {f['mcnemar_p']:.3f}); the two answers are the "
            f"same text on {f['same_answer_text']}/{n}. Where they could differ: the prompt (the server renders "
            "the bundle's chat template, stage 9 the family's training template: the same text means the same "
            "prompt), lm-eval's `until` stop strings, and the extraction (lm-eval's regexes; stage 9's math judge "
            "takes the answer's last number, as flexible-extract does).",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
