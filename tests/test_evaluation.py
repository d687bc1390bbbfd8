"""Stage 9 (evaluation of the bundle): the tasks it evaluates on are disjoint from everything
mining, teaching and training read; Wilson intervals; the stage on a small real bundle
(stories260K tiers) through the runtime, with the real judges."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.contract import KibidangoError
from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"
DATA = SHARED / "data"
BENCH = {
    "gsm8k": DATA / "gsm8k" / "test.jsonl",
    "mbpp": DATA / "mbpp" / "mbpp.jsonl",
    "humaneval": DATA / "humaneval" / "HumanEval.jsonl.gz",
}
SEEDS = DATA / "alpaca_seed" / "seed_tasks.jsonl"


def _needs(*paths: Path) -> None:
    for p in paths:
        if not p.exists():
            pytest.skip(f"needs {p} (absent on this machine)")


@pytest.fixture(scope="module")
def stage0(tmp_path_factory) -> Path:
    """A stage-0 artifact whose train split holds the first seed task's text (so it is left out)."""
    from datasets import Dataset, DatasetDict

    _needs(SEEDS)
    first = json.loads(SEEDS.read_text().splitlines()[0])
    rows = [
        {
            "id": "s0/1",
            "instruction": first["instruction"],
            "input": first["instances"][0]["input"],
            "output": "x",
            "domain": "general",
        },
        {
            "id": "s0/2",
            "instruction": "",
            "input": "",
            "output": "Once upon a time there was a cat.",
            "domain": "general",
        },
    ]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    root = tmp_path_factory.mktemp("stage0")
    DatasetDict({"train": Dataset.from_dict(cols), "validation": Dataset.from_dict(cols)}).save_to_disk(
        str(root / "dataset")
    )
    return root


def test_wilson_intervals():
    from methods.evaluation import wilson

    lo, hi = wilson(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert wilson(40, 40)[1] == 1.0 and wilson(40, 40)[0] == pytest.approx(0.9124, abs=1e-4)


def test_evaluation_tasks_are_never_mined_taught_or_trained_on(stage0):
    """The benchmarks' evaluation parts and the seed tasks against what 1B (and so 1C, 1D, 1R,
    which read only 1B's table) selects: no task in both, whatever the seed and size."""
    import yaml

    from methods.benchmarks import load_tasks
    from methods.evaluation import EvalSample, evaluation_tasks
    from methods.heldout import select_tasks
    from stages.mine_failures import Config as MiningConfig

    _needs(*BENCH.values())
    for name, path in BENCH.items():
        mining = {t.id for t in load_tasks(name, path, "mining")}
        evaluation = {t.id for t in load_tasks(name, path, "evaluation")}
        assert mining and evaluation and not mining & evaluation, name

    samples = [EvalSample(name=n, source=n, path=str(p), size=10_000) for n, p in BENCH.items()]
    samples.append(EvalSample(name="general", source="alpaca_seed", path=str(SEEDS), size=10_000))
    for domain, top in (("math", 7), ("code", 6)):  # the ladder: 100 evaluation tasks per level
        levels = list(range(1, top + 1))
        samples.append(EvalSample(name=f"l_{domain}", source="ladder", domain=domain, levels=levels, size=100 * top))
    evaluated = {r["id"] for r in evaluation_tasks(samples, seed=0, seen=set())}
    first_seed = f"alpaca_seed/{json.loads(SEEDS.read_text().splitlines()[0])['id']}"
    assert first_seed in evaluated
    from methods.failures import training_texts
    from methods.training.chat import load_split

    seen = training_texts(load_split(stage0 / "dataset", "train"))
    assert first_seed not in {r["id"] for r in evaluation_tasks(samples, seed=0, seen=seen)}  # stage 0 holds it

    mined_ids: set[str] = set()
    for preset in ("tiny", "llama31-8b"):  # what 1B would mine, at every size its recipe could ask
        recipe = yaml.safe_load(Path(f"recipes/stage1B/{preset}.yaml").read_text())

        def wide(s: dict, every: dict = {"math": list(range(1, 8)), "code": list(range(1, 7))}) -> dict:  # noqa: B006
            # a band may land on any level of its domain
            if s["source"] != "ladder":
                return {**s, "size": 10_000}
            levels = s.get("levels") or every[s["domain"]]
            return {**{k: v for k, v in s.items() if k != "band"}, "levels": levels, "size": 100 * len(levels)}

        # the benchmark and ladder samples (the ladder's: 100 per level)
        recipe["samples"] = [wide(s) for s in recipe["samples"] if s["source"] != "stage0"]
        recipe["judges"] = {k: v for k, v in recipe["judges"].items() if v["kind"] != "llm"} or {
            "math": {"kind": "math"}
        }
        recipe["judges"].setdefault("code", {"kind": "code"})
        recipe["judges"].setdefault("math", {"kind": "math"})
        mined, _ = select_tasks(MiningConfig.model_validate(recipe), stage0 / "dataset", set())
        assert mined and not {r["id"] for r in mined} & evaluated, preset
        mined_ids |= {r["id"] for r in mined}
        if preset == "tiny":
            assert {r["source"] for r in mined} >= {"ladder"} and any(i.startswith("ladder-") for i in evaluated)

    # and stage 0's ladder sources read the train part only: no mined or evaluated id among them
    from methods.curation.ingest import SourceSpec, read_source

    stage0_recipe = yaml.safe_load(Path("recipes/stage0/tiny.yaml").read_text())
    ladder_sources = [SourceSpec.model_validate(s) for s in stage0_recipe["sources"] if s["format"] == "ladder"]
    assert ladder_sources
    trained = {ex.id for spec in ladder_sources for ex in read_source(spec)}
    assert trained and not trained & evaluated and not trained & mined_ids
    # nor do the stand-in teachers (1T), which learn every level of the train part
    from stages.stand_in_teachers import Config as TeachersConfig

    teachers = TeachersConfig.model_validate(yaml.safe_load(Path("recipes/stage1T/tiny.yaml").read_text()))
    taught = {t.id for source in teachers.ladder for t in source.rows()}
    assert taught and not taught & evaluated and not taught & mined_ids


def test_stage_9_evaluates_a_bundle_through_the_runtime(stage0, tmp_path):
    from kibidango import write_bundle
    from stages import load_stage

    _needs(STORIES / "model.safetensors", *BENCH.values())
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "qualifier", "target")}
    (tmp_path / "X").mkdir()
    write_bundle(tmp_path / "X" / "bundle", tiers, {"mode": "sd", "k": 3, "stop_ids": [1, 2]}, preset="test")
    module = load_stage("9")
    cfg = module.Config.model_validate(
        {
            "samples": [
                {"name": "gsm8k", "source": "gsm8k", "path": str(BENCH["gsm8k"]), "size": 2},
                {"name": "mbpp", "source": "mbpp", "path": str(BENCH["mbpp"]), "size": 2, "seen_by_base": "P saw it"},
                {"name": "general", "source": "alpaca_seed", "path": str(SEEDS), "size": 2},
            ],
            "judges": {"math": {"kind": "math"}, "code": {"kind": "code"}, "general": {"kind": "reference"}},
            "max_new_tokens": 8,
            "speed_prompts": 2,
            "speed_new_tokens": 8,
        }
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = module.run(cfg, {"bundle": tmp_path / "X", "data": stage0}, out, work)
    report = json.loads((out / "evaluation.json").read_text())
    assert report["tasks"] == 6 and report["policies"] == ["none"]  # no router, no adapters: base only
    for name, metric in (("gsm8k", "accuracy"), ("mbpp", "pass_at_1"), ("general", "pass_rate")):
        q = report["quality"][name]
        assert q["n"] == 2 and q["metric"] == metric
        lo, hi = q["policies"]["none"]["ci"]
        assert 0 <= lo <= q["policies"]["none"]["rate"] <= hi <= 1
        assert f"{name}/none/{metric}" in result.metrics
    from mlflow.utils.validation import _validate_metric_name

    for name in result.metrics:  # MLflow refuses a run whose metric names it cannot store
        _validate_metric_name(name)
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 6 and all(a["answers"]["none"]["judge"] for a in answers)
    assert report["size"]["bytes"] > 0 and set(report["size"]["tiers"]) == {"draft/hf", "qualifier/hf", "target/hf"}
    assert report["peak_rss_mb"] > 50
    modes = {r["mode"] for r in report["speed"]["rows"]}
    assert {"ar", "sd"} <= modes and any(m.startswith("pyramid") for m in modes)
    assert result.metrics["speed/sd_vs_ar"] > 0
    card = (out / "EVALUATION_CARD.md").read_text()
    assert "| gsm8k | accuracy | 2 |" in card and "Peak RSS" in card
    # A sample the base model trained on is flagged beside its figures, with the reason.
    assert "| mbpp (not held out\\*) | pass@1 | 2 |" in card
    assert "mbpp: not held out for this preset's base model — P saw it" in card
    assert report["quality"]["mbpp"]["seen_by_base"] == "P saw it" and "seen_by_base" not in report["quality"]["gsm8k"]
    assert report["quality"]["all"]["n"] == 6 and result.metrics["all/reference_perplexity"] > 1
    # Resumable: a rerun with the work directory answers nothing again.
    shutil.rmtree(out)
    out.mkdir()
    again = module.run(cfg, {"bundle": tmp_path / "X", "data": stage0}, out, work)
    assert again.metrics["gsm8k/none/accuracy"] == result.metrics["gsm8k/none/accuracy"]
    # Reproducible: a run from scratch writes the same answers, verdicts and rates (greedy).
    fresh_out, fresh_work = tmp_path / "out2", tmp_path / "work2"
    fresh_out.mkdir()
    fresh_work.mkdir()
    quick = cfg.model_copy(update={"speed_prompts": 0})  # the speed figures are not what this compares
    third = module.run(quick, {"bundle": tmp_path / "X", "data": stage0}, fresh_out, fresh_work)
    redo = [json.loads(line) for line in (fresh_out / "answers.jsonl").read_text().splitlines()]
    strip = lambda a: {k: v for k, v in a.items() if k != "judge_seconds"}  # noqa: E731
    assert [{p: strip(x) for p, x in r["answers"].items()} for r in redo] == [
        {p: strip(x) for p, x in r["answers"].items()} for r in answers
    ]
    measured = ("speed/", "acceptance/", "peak_rss")  # timings and the speed run: not quality
    quality = {k: v for k, v in third.metrics.items() if not k.startswith(measured)}
    assert quality == {k: v for k, v in result.metrics.items() if not k.startswith(measured)}
    # Answers decoded together (parallel): every task answered and judged, and the speed run after
    # it measures the pipeline alone again (the batcher gave its models back).
    batched_out, batched_work = tmp_path / "out3", tmp_path / "work3"
    batched_out.mkdir()
    batched_work.mkdir()
    batched = module.run(
        cfg.model_copy(update={"parallel": 3}), {"bundle": tmp_path / "X", "data": stage0}, batched_out, batched_work
    )
    rows = [json.loads(line) for line in (batched_out / "answers.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in answers] and all(r["answers"]["none"]["judge"] for r in rows)
    assert batched.metrics["speed/sd_vs_ar"] > 0


def _lora(dest: Path, domain: str) -> None:
    """A peft LoRA on stories260K (random, not zero-initialised: it changes the answers) with the
    adapter.json the runtime reads."""
    import hashlib

    import torch

    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(str(STORIES))
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, cfg).save_pretrained(str(dest / "adapter"))
    files = [
        {
            "path": f"adapter/{n}",
            "size": (dest / "adapter" / n).stat().st_size,
            "sha256": hashlib.sha256((dest / "adapter" / n).read_bytes()).hexdigest(),
        }
        for n in ("adapter_config.json", "adapter_model.safetensors")
    ]
    (dest / "adapter.json").write_text(json.dumps({"schema": 1, "domain": domain, "formats": {"peft": files}}))


def test_stage_9_measures_the_default_adapter_against_the_bare_weights(stage0, tmp_path):
    """A bundle whose default adapter is 2F's recovery LoRA: policy ``auto`` answers with it (no
    router), ``none`` with the bare weights, and the card pairs them (McNemar) task by task."""
    from kibidango import write_bundle
    from stages import load_stage

    _needs(STORIES / "model.safetensors", BENCH["gsm8k"], SEEDS)

    def finalize(tmp):
        (tmp / "adapters" / "recovery").mkdir(parents=True)
        _lora(tmp / "adapters" / "recovery", "recovery")
        return {"default_adapter": "recovery"}

    (tmp_path / "X").mkdir()
    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    write_bundle(tmp_path / "X" / "bundle", tiers, {"mode": "ar", "stop_ids": [1, 2]}, finalize, preset="test")
    module = load_stage("9")
    cfg = module.Config.model_validate(
        {
            "samples": [
                {"name": "gsm8k", "source": "gsm8k", "path": str(BENCH["gsm8k"]), "size": 2},
                {"name": "general", "source": "alpaca_seed", "path": str(SEEDS), "size": 2},
            ],
            "judges": {"math": {"kind": "math"}, "general": {"kind": "reference"}},
            "max_new_tokens": 8,
            "speed_prompts": 0,
        }
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = module.run(cfg, {"bundle": tmp_path / "X", "data": stage0}, out, work)
    report = json.loads((out / "evaluation.json").read_text())
    assert report["policies"] == ["auto", "none"] and report["default_adapter"] == "recovery"
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert {a["answers"]["auto"]["adapter"] for a in answers} == {"recovery"}
    assert {a["answers"]["none"]["adapter"] for a in answers} == {None}
    assert any(a["answers"]["auto"]["text"] != a["answers"]["none"]["text"] for a in answers)
    paired = report["quality"]["all"]["auto_vs_none"]
    assert paired["n"] == 4 and 0 <= paired["p"] <= 1 and result.metrics["all/auto_vs_none/p"] == paired["p"]
    card = (out / "EVALUATION_CARD.md").read_text()
    assert "the bundle's default adapter `recovery` (2F)" in card and "McNemar p" in card


def test_stage_9_answers_the_same_tasks_with_the_input_model_beside_the_bundle(stage0, tmp_path):
    """The model the preset started from (here a damaged copy of stories260K given as stage P's
    family, converted to F16 for llama.cpp) answers every task as policy ``input``, beside the
    bundle on llama.cpp: paired per sample, its bytes, peak RSS and the speed ratio in the card."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    from kibidango import write_bundle
    from stages import load_stage
    from tests.conftest import noisy_copy

    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    _needs(STORIES / "model.safetensors", gguf, BENCH["gsm8k"], SEEDS)
    tiers = {"target": {"hf": STORIES, "gguf": gguf, "vocab_size": 512}}
    (tmp_path / "X").mkdir()
    write_bundle(tmp_path / "X" / "bundle", tiers, {"mode": "ar", "stop_ids": [1, 2]}, preset="test")
    noisy_copy(STORIES, tmp_path / "P" / "target", 0.2)
    module = load_stage("9")
    config = {
        "samples": [
            {"name": "gsm8k", "source": "gsm8k", "path": str(BENCH["gsm8k"]), "size": 3},
            {"name": "general", "source": "alpaca_seed", "path": str(SEEDS), "size": 3},
        ],
        "judges": {"math": {"kind": "math"}, "general": {"kind": "reference"}},
        "max_new_tokens": 12,
        "backend": "llamacpp",
        "parallel": 2,
        "speed_prompts": 2,
        "speed_new_tokens": 4,
        "speed_modes": ["ar"],
        "input_model": {"input": "family", "speed_rounds": 2, "speed_prompts": 5},
    }
    cfg = module.Config.model_validate(config)
    inputs = {"bundle": tmp_path / "X", "data": stage0, "family": tmp_path / "P"}
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = module.run(cfg, inputs, out, work)
    report = json.loads((out / "evaluation.json").read_text())
    assert report["policies"] == ["none", "input"]
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 6 and all(a["answers"]["input"]["judge"] for a in answers)
    assert any(a["answers"]["input"]["text"] != a["answers"]["none"]["text"] for a in answers)  # other weights
    paired = report["quality"]["all"]["bundle_vs_input"]
    assert paired["n"] == 6 and result.metrics["all/bundle_vs_input/p"] == paired["p"]
    assert "gsm8k/input/accuracy" in result.metrics and "auto_vs_none" not in report["quality"]["all"]
    m = report["input_model"]
    assert m["name"] == "family/target" and m["file"] == "target-F16.gguf" and m["bytes"] > 0
    assert m["peak_rss_mb"] > 50 and m["speed"]["ci"][0] <= m["speed"]["ratio"] <= m["speed"]["ci"][1]
    assert result.metrics["input/speed_ratio"] == m["speed"]["ratio"] and m["speed"]["prompts"] == 5  # its own count
    run = m["speed"]["as_run"]  # whole requests, the bundle in its own mode
    assert run["mode"] == "ar" and run["ci"][0] <= run["ratio"] <= run["ci"][1] and run["input_tokens_per_s"] > 0
    assert result.metrics["input/speed_ratio_as_run"] == run["ratio"]
    card = (out / "EVALUATION_CARD.md").read_text()
    assert "### Beside the input model" in card and "| input model |" in card and "bundle vs input" in card
    assert "tokens/s of whole greedy requests (prompt + a fixed count), as each runs (input: ar; bundle: ar)" in card
    assert m["speed"]["adapter"] is None and "ran with its bare weights" in card  # this bundle has no default LoRA
    # Resumable: the input's answers are journaled like the bundle's; the F16 is converted once.
    shutil.rmtree(out)
    out.mkdir()
    again = module.run(cfg, inputs, out, work)
    assert again.metrics["gsm8k/input/accuracy"] == result.metrics["gsm8k/input/accuracy"]
    # A GGUF file runs on llama.cpp only, and a missing input is named.
    with pytest.raises(Exception, match="input_model takes one of path"):
        module.Config.model_validate({**config, "input_model": {}})
    torch_cfg = module.Config.model_validate({**config, "backend": "torch", "input_model": {"path": str(gguf)}})
    with pytest.raises(KibidangoError, match="is a GGUF file, which runs on backend llamacpp"):
        module.run(torch_cfg, inputs, tmp_path / "o2", tmp_path / "w2")
    with pytest.raises(KibidangoError, match="input_model reads input 'family', which the preset does not give"):
        module.run(cfg, {"bundle": tmp_path / "X", "data": stage0}, tmp_path / "o3", tmp_path / "w3")


def test_mcnemar_counts_the_discordant_tasks_and_tests_them_exactly():
    from methods.evaluation import mcnemar

    a = {f"t{i}": i < 10 for i in range(20)}  # passes t0..t9
    b = {f"t{i}": i in (0, 1, 10) for i in range(20)}  # passes t0, t1, t10; t19 unknown to a below
    del a["t19"]
    test = mcnemar(a, b)
    assert (test["n"], test["a_only"], test["b_only"]) == (19, 8, 1)
    assert abs(test["p"] - 2 * (1 + 9) / 2**9) < 1e-12  # two-sided exact binomial, P(X <= 1 | 9, 1/2) x 2
    assert mcnemar(a, a)["p"] == 1.0 and mcnemar(a, a)["a_only"] == 0


def test_a_judge_error_is_counted_apart_never_as_a_failure():
    """An answer the judge gave no verdict on (its sandbox failed, after the judge's own retries)
    is left out of the pass rate and the paired test, and counted as a judge error."""
    from stages.evaluate import _quality

    def row(i: int, auto: str, none: str) -> dict:
        answer = lambda outcome: {  # noqa: E731
            "outcome": outcome,
            "passed": outcome == "passed",
            "score": float(outcome == "passed"),
            "finish_reason": "stop",
        }
        return {
            "id": f"t{i}",
            "sample": "mbpp",
            "source": "mbpp",
            "domain": "code",
            "answers": {"auto": answer(auto), "none": answer(none)},
        }

    table = [row(0, "passed", "failed"), row(1, "judge_error", "passed"), row(2, "failed", "judge_error")]
    q = _quality(table, ["auto", "none"])["mbpp"]
    assert q["policies"]["auto"] == {**q["policies"]["auto"], "passes": 1, "judged": 2, "judge_errors": 1, "rate": 0.5}
    assert q["policies"]["none"]["rate"] == 0.5 and q["policies"]["none"]["judge_errors"] == 1
    assert q["auto_vs_none"]["a_only"] == 1 and q["auto_vs_none"]["b_only"] == 0  # only t0 has both verdicts


def test_mcnemar_power_matches_a_simulation_of_the_test():
    """The power of an exact McNemar test at p < 0.01: what sizes an evaluation (100 paired tasks
    show a 10-point gain at 20% discordance less than a third of the time)."""
    import numpy as np
    from scipy.stats import binomtest

    from methods.evaluation import mcnemar_power

    rng = np.random.default_rng(0)
    n, d, g, hits, runs = 150, 0.2, 0.1, 0, 2000
    for _ in range(runs):
        k = rng.binomial(n, d)
        hits += bool(k) and binomtest(rng.binomial(k, (d + g) / (2 * d)), k, 0.5).pvalue < 0.01
    assert abs(mcnemar_power(n, g, d) - hits / runs) < 0.03
    assert mcnemar_power(100, 0.1, 0.2) < 1 / 3 < 0.9 < mcnemar_power(300, 0.1, 0.2)
    assert mcnemar_power(100, 0.0, 0.2) < 0.01  # no gain: the test's own false-positive rate


def test_a_band_sample_evaluates_on_1bs_band_and_the_level_above(tmp_path):
    """An evaluation sample with `band` takes the levels stage 1B chose on the mining part (its
    `mining.json`) and `above` levels over them; `rest` tasks at every other level."""
    from core.contract import KibidangoError
    from methods.evaluation import EvalSample, evaluation_tasks, mined_bands

    (tmp_path / "mining.json").write_text(json.dumps({"bands": {"lm": {"levels": [2, 3], "probe": {}}}}))
    bands = mined_bands(tmp_path)
    assert bands == {"lm": [2, 3]}
    s = EvalSample(name="m", source="ladder", domain="math", band="lm", above=1, rest=2, size=30)
    rows = evaluation_tasks([s], 0, set(), bands)
    per = {lv: sum(r["level"] == lv for r in rows) for lv in range(1, 8)}
    assert per == {1: 2, 2: 10, 3: 10, 4: 10, 5: 2, 6: 2, 7: 2}
    with pytest.raises(KibidangoError, match="no band 'lm' from stage 1B"):
        evaluation_tasks([s], 0, set(), {})
    with pytest.raises(ValueError, match="takes `levels` or a `band`"):
        EvalSample(name="m", source="ladder", domain="math", levels=[1], band="lm", size=3)
