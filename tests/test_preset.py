"""Presets and recipes: every shipped YAML validates against its stage config; bad keys are
named; the GPU preset resolves its plan in a dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.contract import KibidangoError
from flows.plan import describe_plan
from flows.preset import PRESETS_DIR, REPO_ROOT, load_preset
from methods.compression.llmc import read_recipe
from stages import load_stage


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_every_shipped_preset_validates(preset):
    plan = load_preset(preset)
    assert plan.order() and set(plan.configs) == set(plan.spec.stages)


@pytest.mark.parametrize("path", sorted(str(p) for p in (REPO_ROOT / "recipes/experiments").glob("*.yaml")))
def test_every_experiment_preset_validates(path):
    """recipes/experiments/: presets of one-off measurements (a stop note cites them); they must
    stay runnable as the recipes they extend change."""
    plan = load_preset(path)
    assert plan.order() and set(plan.configs) == set(plan.spec.stages)


def _llmc_files(value) -> set[str]:
    """Every llm-compressor recipe a stage recipe names, at any depth."""
    if isinstance(value, dict):
        return set().union(*(_llmc_files(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_llmc_files(v) for v in value))
    return {value} if isinstance(value, str) and value.endswith(".llmc.yaml") else set()


def test_every_stage_recipe_is_used_by_a_preset_and_validates():
    used = {plan.recipe for p in PRESETS_DIR.glob("*.yaml") for plan in load_preset(p.stem).spec.stages.values()}
    llmc_used = set()
    for recipe in REPO_ROOT.glob("recipes/stage*/*.yaml"):
        rel = recipe.relative_to(REPO_ROOT).as_posix()
        if rel.endswith(".llmc.yaml"):  # llm-compressor's own format: checked below
            continue
        assert rel in used, f"{rel} is not referenced by any preset"
        llmc_used |= _llmc_files(yaml.safe_load(recipe.read_text()))  # 2A-2C's `recipe`, 2D's AWQ rows' `awq`
        stage_id = recipe.parent.name.removeprefix("stage").upper()
        load_stage(stage_id).Config.model_validate(yaml.safe_load(recipe.read_text()))
    for recipe in REPO_ROOT.glob("recipes/stage*/*.llmc.yaml"):
        rel = recipe.relative_to(REPO_ROOT).as_posix()
        read_recipe(recipe, rel)  # llm-compressor YAML with *_stage blocks
        assert rel in llmc_used or recipe.name == "sparsegpt-2of4.llmc.yaml", f"{rel} is not used by any stage recipe"


def _preset(tmp_path, stage0: dict) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "experiment": "e", "stages": {"0": {"config": stage0}}}))
    return str(path)


SRC = [{"name": "s", "path": "x.jsonl", "format": "alpaca", "license": "MIT"}]


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    path = _preset(tmp_path, {"sources": SRC, "dedup": {"threshhold": 0.7}})
    with pytest.raises(KibidangoError, match=r"p\.yaml: stage 0: unknown key 'dedup\.threshhold'"):
        load_preset(path)
    path = _preset(tmp_path, {"sources": [{**SRC[0], "formatt": "alpaca"}]})
    with pytest.raises(KibidangoError, match=r"unknown key 'sources\.0\.formatt'"):
        load_preset(path)
    (tmp_path / "top.yaml").write_text("name: p\nexperiment: e\nstagez: {}\nstages: {}\n")
    with pytest.raises(KibidangoError, match="unknown key 'stagez'"):
        load_preset(str(tmp_path / "top.yaml"))


def test_wrong_values_and_unknown_presets_are_explained(tmp_path):
    with pytest.raises(KibidangoError, match=r"'dedup\.threshold': Input should be less than 1"):
        load_preset(_preset(tmp_path, {"sources": SRC, "dedup": {"threshold": 1.5}}))
    with pytest.raises(
        KibidangoError,
        match="unknown preset 'nope'; known presets: llama31-8b, small, small-rounds, small-study, tiny, "
        "tiny-rounds, tiny-study",
    ):
        load_preset("nope")


def test_overrides_set_one_value(tmp_path):
    path = _preset(tmp_path, {"sources": SRC})
    plan = load_preset(path, ["0.dedup.threshold=0.7", "0.sources.0.limit=5"])
    assert plan.configs["0"].dedup.threshold == 0.7 and plan.configs["0"].sources[0].limit == 5
    with pytest.raises(KibidangoError, match="has no stage '9'"):
        load_preset(path, ["9.x=1"])
    with pytest.raises(KibidangoError, match="expected STAGE.KEY=VALUE"):
        load_preset(path, ["0.dedup.threshold"])


def test_gpu_preset_dry_run_prints_the_plan(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)  # a dry run reads no key
    text = describe_plan(load_preset("llama31-8b"))
    assert "stage 0 (curate): key " in text
    assert "input source:dolly: hf:databricks/databricks-dolly-15k@main:None:train" in text
    assert "hf: Open-Orca/OpenOrca" in text
    # The plan's failure mining: 50K answers, K = 4,000, general rows judged by an LLM whose key
    # is named, not given (the dry run needs no key).
    assert "stage 1B (mine_failures)" in text and "api_key_env: OPENROUTER_API_KEY" in text
    assert "kind: llm" in text and "size: 48827" in text
    assert "stage 1C (critique_filter)" in text and "general: 3200" in text
    # multi-GPU training (issue "Beyond one machine"): the full fine-tune under ZeRO-3 on 8 GPUs,
    # launched by accelerate, with the shipped DeepSpeed config resolved to a file that exists
    assert (
        "axolotl run 'sft' (GPU; 8 process(es): <axolotl python> -m accelerate.commands.launch --num_processes 8 "
        in text
    )
    shipped = [line.split("deepspeed: ", 1)[1] for line in text.splitlines() if line.startswith("    deepspeed: /")]
    assert shipped and all(Path(p).is_file() for p in shipped) and any(p.endswith("zero3_bf16.json") for p in shipped)
    assert "axolotl run 'draft' (GPU; 1 process(es): <axolotl python> -m axolotl.cli.train" in text
    assert "stage 1F (tune_decoding)" in text


def test_pools_route_by_stage_id_then_tag_and_unknown_keys_are_errors(tmp_path):
    spec = yaml.safe_load((REPO_ROOT / "recipes" / "presets" / "tiny.yaml").read_text())
    spec["pools"] = {"gpu": "gpu-pool", "2B": "big-gpu"}
    path = tmp_path / "routed.yaml"
    path.write_text(yaml.safe_dump(spec))
    plan = load_preset(str(path))
    assert plan.pool("1A") == "gpu-pool" and plan.pool("2B") == "big-gpu"  # the id wins over the tag
    assert plan.pool("0") is None and plan.pool("X") is None  # untagged: the flow's own process
    assert plan.pool("0", {"0": "cpu-pool"}) == "cpu-pool"  # --pool routes add to the preset's
    spec["pools"] = {"gpus": "gpu-pool"}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(KibidangoError, match="pools: 'gpus' is neither a stage of this preset nor a stage tag"):
        load_preset(str(path))


def test_a_preset_on_the_graph_states_only_where_it_differs(tmp_path):
    """Both shipped presets run recipes/graph.yaml: a preset leaves stages out and overrides a
    stage's inputs or config; each stage's recipe is recipes/stage<id>/<preset>.yaml (1S: 1R's, the
    graph's `recipes`)."""
    graph = yaml.safe_load((REPO_ROOT / "recipes/graph.yaml").read_text())["stages"]
    for name in ("tiny", "llama31-8b"):
        spec = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
        assert spec["graph"] == "recipes/graph.yaml" and len(spec.get("stages", {})) <= 3
        plan = load_preset(name)
        assert set(plan.spec.stages) == set(graph) - set(spec.get("without", []))
        assert all(p.recipe == f"recipes/stage{s}/{name}.yaml" for s, p in plan.spec.stages.items())
    assert load_preset("tiny-study").spec.stages["1S"].recipe == "recipes/stage1R/tiny.yaml"
    gpu = load_preset("llama31-8b")
    assert "P" not in gpu.spec.stages and gpu.needs("1A") == {"data": "0"} and gpu.needs("1B") == graph["1B"]
    # an optional input ("1T?") is dropped where its stage is left out, kept (as "1T") where it runs
    assert gpu.needs("1D") == {"critical": "1C", "mined": "1B", "student": "1A"} and "1T" not in gpu.spec.stages
    assert load_preset("tiny").needs("1D") == {"critical": "1C", "mined": "1B", "teachers": "1T", "student": "1A"}

    def preset(**spec) -> str:
        path = tmp_path / "g.yaml"
        path.write_text(yaml.safe_dump({"name": "tiny", "experiment": "e", "graph": "recipes/graph.yaml", **spec}))
        return str(path)

    with pytest.raises(KibidangoError, match=r"without: 'Q' is not a stage of recipes/graph\.yaml"):
        load_preset(preset(without=["Q"]))
    with pytest.raises(KibidangoError, match=r"stage 1A needs stage 'P', which the preset does not run"):
        load_preset(preset(without=["P"]))
    one = load_preset(preset(stages={"9": {"config": {"max_new_tokens": 7}}}))
    assert one.configs["9"].max_new_tokens == 7 and one.needs("9") == {**graph["9"], "mined": "1B", "family": "P"}


def test_a_stage_has_one_name_everywhere():
    """The module is the name: stages.stage_name, the plan, the MLflow run name, and --force (so
    ``make stage-2g`` and ``make stage-calibrate`` rerun the same stage)."""
    from stages import STAGES, stage_ids, stage_name

    for sid, module in STAGES.items():
        assert stage_name(sid) == module.rsplit(".", 1)[1]
        assert not hasattr(load_stage(sid), "NAME"), f"{module} still has a NAME of its own"
    order = load_preset("tiny").order()
    assert stage_ids("2g", order) == stage_ids("calibrate", order) == ["2G"]
    assert stage_ids("domain_lora", order) == ["3", "4", "5"] and stage_ids("domain-lora", order) == ["3", "4", "5"]
    with pytest.raises(KibidangoError, match=r"stage 'calibration' is not in this preset; its stages: 0 \(curate\)"):
        stage_ids("calibration", order)
    assert "stage 2G (calibrate): key" in describe_plan(load_preset("tiny"))


def test_an_override_that_does_not_fit_names_its_key(tmp_path):
    """A wrong path or a YAML alias bomb crashed with TypeError, ValueError, IndexError or
    RecursionError: each is an error naming the override's key."""
    path = _preset(tmp_path, {"sources": SRC})
    for bad, message in (
        ("0.sources.x.limit=5", r"override 0\.sources\.x\.limit: sources\.x: 'x' is not an index of a list of 1"),
        ("0.sources.7.limit=5", r"sources\.7: '7' is not an index of a list of 1"),
        ("0.dedup.threshold.x=1", r"dedup\.threshold\.x: dedup\.threshold is a float, not a table"),
        ("0.dedup..threshold=1", r"an empty part"),
        ("0.title=" + "&a [" + "*a, " * 9 + "*a]", r"override 0\.title: not a YAML value: .*aliases"),
        ("0.title=&a [*a]", r"override 0\.title: not a YAML value: .*aliases"),
        ("0.title=" + "[" * 3000 + "]" * 3000, r"override 0\.title: (nested too deeply|not a YAML value)"),
    ):
        with pytest.raises(KibidangoError, match=message):
            load_preset(path, ["0.dedup.threshold=0.7", bad])


def test_rounds_run_the_loop_again_on_the_last_rounds_student(tmp_path):
    """``rounds: 2``: 1B.2 ... 1R.2 are the loop's stages again, with the same recipes, mining and
    retraining round 1's 1R; 1B.2 reads 1B (what round 1 mined, never mined again); the stages
    after the loop read round 2."""
    from stages import base_id, load_stage, stage_name

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "experiment": "e", "graph": "recipes/graph.yaml", "rounds": 2}))
    plan = load_preset(str(path))
    assert plan.needs("1B.2") == {"student": "1R", "data": "0", "previous": "1B"}
    assert plan.needs("1C.2") == {"mined": "1B.2", "student": "1R"}
    assert plan.needs("1D.2") == {"critical": "1C.2", "mined": "1B.2", "teachers": "1T", "student": "1R"}
    assert plan.needs("1R.2") == {"student": "1R", "pairs": "1D.2", "mined": "1B.2", "data": "0"}
    assert plan.needs("1E")["teacher"] == "1R.2" and plan.needs("3")["pairs"] == "1D.2"
    assert plan.needs("9")["mined"] == "1B.2" and plan.needs("1R") == {
        "student": "1A",
        "pairs": "1D",
        "mined": "1B",
        "data": "0",
    }
    order = plan.order()
    assert order.index("1R") < order.index("1B.2") < order.index("1R.2") < order.index("1E")
    assert plan.configs["1B.2"] == plan.configs["1B"] and stage_name("1B.2") == "mine_failures"
    assert base_id("1B.2") == "1B" and base_id("2B") == "2B" and load_stage("1R.2").__name__ == "stages.retrain"
    over = load_preset(str(path), ["1B.2.max_new_tokens=7"])
    assert over.configs["1B.2"].max_new_tokens == 7 and over.configs["1B"].max_new_tokens != 7


def test_a_study_preset_runs_its_presets_loop_as_it_runs_it_and_every_arm():
    """``make study-loop`` runs <preset>-study: ``extends`` the preset, so every stage up to 1R has
    the same config and inputs (the same cache keys: cache hits after make demo), and adds 1S, 1R's
    stage with 1R's recipe and every arm beside 1R's own model (``retrained``)."""
    for name in ("tiny", "small"):
        base, study = load_preset(name), load_preset(f"{name}-study")
        assert "1S" not in base.spec.stages and study.needs("1S")["retrained"] == "1R"
        for sid in ("0", "1A", "1B", "1C", "1D", "1R"):
            assert study.configs[sid] == base.configs[sid] and study.needs(sid) == base.needs(sid), (name, sid)
        assert set(study.configs["1S"].controls) == {"random", "replay", "gold", "pairs25", "pairs50"}
        # 1R's own recipe (one declaration of the fine-tune): every field but the arms and the
        # evaluation's size (small's study evaluates more tasks, for non-inferiority) is 1R's
        own, retrain = study.configs["1S"], base.configs["1R"]
        same = {"controls": retrain.controls, "evaluation": retrain.evaluation}
        assert own.model_copy(update=same) == retrain
        assert [e.model_copy(update={"size": r.size}) for e, r in zip(own.evaluation, retrain.evaluation)] == (
            retrain.evaluation
        )
        assert all(e.size >= r.size for e, r in zip(own.evaluation, retrain.evaluation))
        assert not {"9", "X", "2E"} & set(study.spec.stages)


def test_a_rounds_preset_runs_its_presets_first_round_as_it_runs_it_then_a_second():
    """``make study-loop`` runs <preset>-rounds after the study: round 1 is the preset's own loop (the
    same configs and inputs: cache hits after make demo), round 2 mines, teaches and retrains round 1's
    1R with the same recipes, and nothing after the loop runs."""
    for name in ("tiny", "small"):
        base, rounds = load_preset(name), load_preset(f"{name}-rounds")
        for sid in ("0", "1A", "1B", "1C", "1D", "1R"):
            assert rounds.configs[sid] == base.configs[sid] and rounds.needs(sid) == base.needs(sid), (name, sid)
        assert rounds.needs("1B.2")["student"] == "1R" and rounds.needs("1B.2")["previous"] == "1B"
        assert rounds.needs("1R.2")["student"] == "1R" and rounds.needs("1R.2")["pairs"] == "1D.2"
        for sid in ("1B", "1C", "1D", "1R"):
            assert rounds.configs[f"{sid}.2"] == base.configs[sid], (name, sid)
        assert not {"1S", "2D", "X", "9"} & set(rounds.spec.stages)


def test_a_misspelt_runtime_default_fails_at_dry_run_naming_the_recipe_and_the_key(tmp_path):
    """Stage X's ``runtime_defaults`` are read now by the runtime's own reader (DecodeConfig.from_mapping):
    a typo fails when the preset loads (make dry-run), naming the recipe it is in and the key, not when a
    user loads the bundle (and not silently dropped, as it once was)."""
    recipe = tmp_path / "x.yaml"
    recipe.write_text((REPO_ROOT / "recipes/stageX/tiny.yaml").read_text().replace("top_p:", "top_pp:"))
    preset = tmp_path / "t.yaml"
    preset.write_text(yaml.safe_dump({"name": "t", "extends": "tiny", "stages": {"X": {"recipe": str(recipe)}}}))
    with pytest.raises(
        KibidangoError,
        match=rf"{recipe}: stage X: 'runtime_defaults': .*'top_pp' is not a decoding setting \(did you mean 'top_p'",
    ):
        load_preset(str(preset))
    with pytest.raises(
        KibidangoError, match=r"override X\.runtime_defaults\.kk: stage X: .*'kk' is not a decoding setting"
    ):
        load_preset("tiny", ["X.runtime_defaults.kk=3"])
    assert load_preset("tiny", ["X.runtime_defaults.kv_cache=q8_0"]).configs["X"].runtime_defaults["kv_cache"] == "q8_0"
