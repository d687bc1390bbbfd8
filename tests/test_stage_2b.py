"""`make stage-2b` through the real CLI on a compression-only preset (stage 0 -> 2A on
stories260K -> 2B, 2D -> X -> 2E): forcing 2B recomputes 2B, MLflow records every upstream stage
as a cache hit, and downstream stages recompute only if their inputs' bytes changed. (The slow test
asserts the same after the full tiny preset.)"""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import pytest
import yaml

from eval.shared_data import SHARED
from flows.tracking import TAG
from tests.test_flow import _cli

STORIES = SHARED / "models" / "stories260K" / "hf"
SMALL = {"calibration_samples": 8, "calibration_max_len": 64, "eval_rows": 8, "eval_max_len": 64}


def _preset(tmp_path: Path) -> Path:
    source = SHARED / "data" / "tinystories_sample" / "tiny_stories.txt"
    stages = {
        "0": {
            "config": {
                "sources": [
                    {
                        "name": "s",
                        "path": str(source),
                        "format": "text",
                        "text_split": "single_newline",
                        "limit": 300,
                        "license": "CDLA-Sharing-1.0",
                    }
                ],
                "split": {"validation": 0.1, "test": 0.05},
            }
        },
        "2A": {
            "needs": {"data": "0"},
            "config": {"recipe": "recipes/stage2A/sparsegpt-tiny.llmc.yaml", "base_model": str(STORIES), **SMALL},
        },
        "2B": {
            "needs": {"model": "2A", "data": "0"},
            "config": {"recipe": "recipes/stage2B/awq-w4a16-channel.llmc.yaml", "tiers": ["target"], **SMALL},
        },
        "2D": {
            "needs": {"target": "2A", "data": "0"},
            "config": {
                "tiers": {"target": {"input": "target", "quant": "Q8_0"}},
                "prompts": 4,
                "new_tokens": 8,
                "eval_rows": 8,
            },
        },
        "X": {
            "needs": {"target": "2B", "gguf": "2D", "prune": "2A"},
            "config": {"preset": "stage2b-test", "hf_tiers": {"target": "target"}, "runtime_defaults": {"mode": "ar"}},
        },
        "2E": {"needs": {"bundle": "X"}, "config": {"dict_size": 8192}},
    }
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump({"name": "stage2b-test", "experiment": "kibidango-stage2b-test", "stages": stages}))
    return path


def _runs(home: Path, stage: str) -> list:
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    return mlflow.search_runs(
        experiment_names=["kibidango-stage2b-test"],
        filter_string=f"tags.`{TAG}stage_id` = '{stage}'",
        order_by=["attributes.start_time ASC"],
        output_format="list",
    )


def test_forcing_2b_reuses_upstream_and_recomputes_downstream_only_on_change(tmp_path):
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES} (absent on this machine)")
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    preset, home = _preset(tmp_path), tmp_path / "home"
    first = _cli(home, "run", "--preset", str(preset), timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "== a story from the packed bundle" in first.stdout
    forced = _cli(home, "run", "--preset", str(preset), "--force", "2b", timeout=1200)  # what `make stage-2b` runs
    assert forced.returncode == 0, forced.stderr[-3000:]
    ran = set(re.findall(r"stage (\w+) \([\w-]+\): running", forced.stderr))
    assert ran & {"0", "2A", "2D"} == set() and "2B" in ran, ran

    assert [r.data.tags[f"{TAG}cached"] for r in _runs(home, "2B")] == ["no", "no"]
    for stage in ("0", "2A", "2D"):
        assert [r.data.tags[f"{TAG}cached"] for r in _runs(home, stage)] == ["no", "yes"], stage
    b1, b2 = (r.data.tags[f"{TAG}digest"] for r in _runs(home, "2B"))
    assert _runs(home, "X")[-1].data.tags[f"{TAG}cached"] == ("yes" if b1 == b2 else "no")
    # X holds nothing that depends on when it was built: when 2B's new bytes leave the shipped weights
    # as they were (its report's timings differ, say), X publishes the same bytes and 2E stays a hit
    x1, x2 = (r.data.tags[f"{TAG}digest"] for r in _runs(home, "X")[:2])
    assert _runs(home, "2E")[-1].data.tags[f"{TAG}cached"] == ("yes" if x1 == x2 else "no")
