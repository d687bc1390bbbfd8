"""Stage 9A (quality gates): a working tiny bundle passes the tiny preset's evaluation gates and is
stamped releasable; a deliberately broken one (the target's weights shuffled) fails them with the
table, is stamped not releasable (the runtime warns on load) and fails the flow; a waiver is
recorded; a gate on a metric nobody measured names the metrics there are."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from core.contract import KibidangoError
from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"
DATA = SHARED / "data"
SAMPLES = [
    {"name": "gsm8k", "source": "gsm8k", "path": str(DATA / "gsm8k" / "test.jsonl"), "size": 3},
    {"name": "general", "source": "alpaca_seed", "path": str(DATA / "alpaca_seed" / "seed_tasks.jsonl"), "size": 6},
]


def _shuffled(src: Path, dest: Path) -> Path:
    """A copy of the checkpoint whose every weight tensor has its entries permuted."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dest)
    model = AutoModelForCausalLM.from_pretrained(str(src))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    model.save_pretrained(str(dest))
    return dest


def _evaluate(hf: Path, root: Path, stage0: Path) -> Path:
    """Stage X's and stage 9's artifacts (with manifests) for a bundle of ``hf`` as every tier."""
    from kibidango import write_bundle
    from stages import load_stage

    x = root / "X" / "k"
    x.mkdir(parents=True)
    write_bundle(x / "bundle", {"target": {"hf": hf, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [1, 2]})
    module = load_stage("9")
    cfg = module.Config.model_validate(
        {
            "samples": SAMPLES,
            "judges": {"math": {"kind": "math"}, "general": {"kind": "reference"}},
            "max_new_tokens": 16,
            "speed_prompts": 0,
        }
    )
    out = root / "9" / "k"
    out.mkdir(parents=True)
    (root / "work").mkdir(exist_ok=True)
    result = module.run(cfg, {"bundle": x, "data": stage0}, out, root / "work" / hf.name)
    (out / "manifest.json").write_text(json.dumps({"stage_id": "9", "metrics": result.metrics, "mlflow_run_id": "r9"}))
    return x


@pytest.fixture(scope="module")
def stage0(tmp_path_factory) -> Path:
    from datasets import Dataset, DatasetDict

    cols = {"id": ["s/1"], "instruction": [""], "input": [""], "output": ["Once upon a time."], "domain": ["general"]}
    root = tmp_path_factory.mktemp("stage0")
    DatasetDict({"train": Dataset.from_dict(cols)}).save_to_disk(str(root / "dataset"))
    return root


@pytest.fixture(scope="module")
def tiny_gates() -> list[dict]:
    """The tiny preset's gates on stage 9's evaluation (the others gate artifacts this test does not build)."""
    gates = yaml.safe_load(Path("recipes/stage9A/tiny.yaml").read_text())["gates"]
    return [g for g in gates if g["input"] == "evaluation"]


def _gate(inputs: dict[str, Path], out: Path, gates: list[dict], waive: list[str] = ()):
    from stages import load_stage

    module = load_stage("9A")
    out.mkdir(parents=True)
    cfg = {"gates": gates, "waive": list(waive), "backends": ["torch"]}  # the test bundles are torch-only
    return module.run(module.Config.model_validate(cfg), inputs, out)


def test_a_working_bundle_passes_and_a_broken_one_fails_the_tiny_gates(stage0, tiny_gates, tmp_path, caplog):
    from kibidango import load_bundle

    if not (STORIES / "model.safetensors").is_file() or not Path(SAMPLES[0]["path"]).is_file():
        pytest.skip("needs stories260K and the GSM8K / self-instruct files in ../shared")
    good = _evaluate(STORIES, tmp_path / "good", stage0)
    result = _gate({"bundle": good, "evaluation": tmp_path / "good" / "9" / "k"}, tmp_path / "g1", tiny_gates)
    assert result.failure is None and result.metrics["releasable"] == 1
    stamped = load_bundle(tmp_path / "g1" / "bundle")
    assert stamped.manifest.release.releasable is True and len(stamped.manifest.release.gates) == len(tiny_gates)
    assert (stamped.manifest.profile.name, stamped.manifest.profile.backends) == ("default", ["torch"])
    assert result.metrics["bundle_bytes"] == result.metrics["full_bundle_bytes"]  # ar on torch: nothing to leave out

    bad = _evaluate(_shuffled(STORIES, tmp_path / "shuffled"), tmp_path / "bad", stage0)
    inputs = {"bundle": bad, "evaluation": tmp_path / "bad" / "9" / "k"}
    result = _gate(inputs, tmp_path / "g2", tiny_gates)
    assert result.metrics["releasable"] == 0 and "gold-answer-perplexity" in result.failure
    assert "| gate | stage | metric | value | threshold | outcome |" in result.failure and "**FAIL**" in result.failure
    assert "| 9 | all/reference_perplexity |" in result.failure  # the stage each value came from
    with caplog.at_level(logging.WARNING, logger="kibidango.bundle"):
        stamped = load_bundle(tmp_path / "g2" / "bundle")
    assert stamped.manifest.release.releasable is False and "NOT releasable" in caplog.text
    assert "Not releasable" in (tmp_path / "g2" / "GATES_CARD.md").read_text()

    failed = stamped.manifest.release.failed
    waived = _gate(inputs, tmp_path / "g3", tiny_gates, waive=failed)
    assert waived.failure is None and waived.metrics["gates_waived"] == len(failed)
    release = load_bundle(tmp_path / "g3" / "bundle").manifest.release
    assert release.waived == failed and release.releasable is True


def test_a_gate_on_a_metric_nobody_measured_names_the_metrics_there_are(tmp_path):
    art = tmp_path / "9" / "k"
    art.mkdir(parents=True)
    (art / "manifest.json").write_text(json.dumps({"stage_id": "9", "metrics": {"gsm8k/none/accuracy": 0.0}}))
    gate = [{"name": "g", "input": "evaluation", "metric": "gsm8k/auto/accuracy", "min": 0.5}]
    with pytest.raises(KibidangoError, match=r"no metric 'gsm8k/auto/accuracy'; it has \['gsm8k/none/accuracy'\]"):
        _gate({"bundle": tmp_path, "evaluation": art}, tmp_path / "out", gate)
    from stages.gates import Config

    with pytest.raises(ValueError, match="give min, max or both"):
        Config.model_validate({"gates": [{"name": "g", "input": "evaluation", "metric": "m"}]})
    with pytest.raises(ValueError, match="no gate named"):
        Config.model_validate({"gates": gate, "waive": ["nope"]})


def test_failed_gates_publish_the_stamped_bundle_and_fail_the_flow_on_every_run(workspace):
    """Through the cached runner: the verdict is published (its bundle stamped not releasable),
    the stage still fails the flow, and so does every later cache hit of it."""
    from core.store import ArtifactStore
    from flows.runner import RunContext, execute_stage
    from kibidango import load_bundle, write_bundle
    from stages import load_stage

    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    store = ArtifactStore(workspace / "store")
    staging = store.new_staging_dir("X", "kx")
    write_bundle(staging / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"})
    bundle = store.publish("X", "kx", staging, {"metrics": {}})
    staging = store.new_staging_dir("9", "k9")
    (staging / "evaluation.json").write_text("{}")
    evaluation = store.publish("9", "k9", staging, {"metrics": {"all/reference_perplexity": 1.9e6}})
    cfg = load_stage("9A").Config.model_validate(
        {
            "gates": [
                {
                    "name": "gold-answer-perplexity",
                    "input": "evaluation",
                    "metric": "all/reference_perplexity",
                    "max": 512,
                }
            ],
            "backends": ["torch"],
        }
    )
    ctx = RunContext("test", "exp-test", str(workspace / "store"), None, "prefect-run-1", ())
    inputs = {"bundle": bundle, "evaluation": evaluation}
    for _ in range(2):  # computed, then a cache hit: both stop the flow
        with pytest.raises(KibidangoError, match=r"stage 9A \(gates\): quality gates failed: gold-answer"):
            execute_stage("9A", cfg, inputs, ctx)
    (published,) = [p for p in (workspace / "store" / "9A").iterdir() if not p.name.startswith(".")]
    assert load_bundle(published / "bundle").manifest.release.failed == ["gold-answer-perplexity"]
    assert (
        "| gold-answer-perplexity | 9 | all/reference_perplexity | 1.9e+06 | <= 512 | **FAIL** |"
        in (published / "GATES_CARD.md").read_text()
    )
