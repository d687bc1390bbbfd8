"""Stage 1F (speculative-decoding tuning) on a real bundle: every candidate of the grid is timed
against target-only decoding on stage 0's validation prompts, the tuned copy of the bundle carries
the choice per backend (what a plain load then decodes with), the card, plot and MLflow table are
written, and a bundle the stage cannot tune fails with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.contract import KibidangoError
from stages import load_stage
from tests.test_evaluation import STORIES, _needs

STORIES_TEXT = [
    "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog.",
    "Tom had a big red ball. He kicked it high into the sky and laughed with his friends.",
    "One day, a cat found a shiny box under the tree. The cat was very curious.",
]


@pytest.fixture(scope="module")
def stage0(tmp_path_factory) -> Path:
    from datasets import Dataset, DatasetDict

    rows = [
        {"id": f"v/{i}", "instruction": "", "input": "", "output": t, "domain": "general"}
        for i, t in enumerate(STORIES_TEXT)
    ]
    rows.append(
        {
            "id": "v/i",
            "instruction": "Tell me a story about a dog.",
            "input": "",
            "output": "A dog ran.",
            "domain": "general",
        }
    )
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    root = tmp_path_factory.mktemp("stage0")
    DatasetDict({"train": Dataset.from_dict(cols), "validation": Dataset.from_dict(cols)}).save_to_disk(
        str(root / "dataset")
    )
    return root


def _bundle(root: Path, tiers=("draft", "qualifier", "target")) -> Path:
    from kibidango import write_bundle

    _needs(STORIES / "model.safetensors")
    (root / "X").mkdir(parents=True)
    spec = {t: {"hf": STORIES, "vocab_size": 512} for t in tiers}
    write_bundle(root / "X" / "bundle", spec, {"mode": "sd", "k": 4, "stop_ids": [2]}, preset="test")
    return root / "X"


def _config(**kw):
    base = {
        "backends": ["torch"],
        "prompts": 3,
        "max_new_tokens": 10,
        "grid": {"k": [2, 4], "lengths": [[2, 4]], "taus": [[0.3, 0.2]], "p_min": [0.5], "lookup_k": [3]},
    }
    return load_stage("1F").Config.model_validate({**base, **kw})


def test_stage_1f_tunes_and_ships_the_choice(stage0, tmp_path):
    from kibidango import Pipeline
    from kibidango.bundle import load_bundle

    x = _bundle(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    result = load_stage("1F").run(_config(), {"bundle": x, "data": stage0}, out)

    rows = [json.loads(line) for line in (out / "candidates.jsonl").read_text().splitlines()]
    # sd k=2,4, k=4 at p_min, adaptive with and without p_min; lookup fixed and adaptive, under sd's and
    # pyramid's draft; exact, at p_min, adaptive; fuzzy, assisted
    assert len(rows) == 2 + 1 + 2 + 2 + 2 + 3 + 2 == result.metrics["torch/candidates"]
    assert result.metrics["prompts"] == 3
    # identical tiers: every candidate, lossless or not, reproduces target-only decoding
    assert result.metrics["torch/lossless_mismatches"] == 0 and all(r["admissible"] for r in rows)
    assert {r["backend"] for r in rows} == {"torch"}
    tuning = json.loads((out / "tuning.json").read_text())
    chosen = tuning["tuned_defaults"]["torch"]
    assert chosen["mode"] in ("ar", "sd", "lookup", "pyramid")
    assert tuning["tuning"]["torch"]["chosen_speed_vs_ar"] == result.metrics["torch/chosen_speed_vs_ar"]

    tuned = load_bundle(out / "bundle")  # every hash checked: a valid bundle
    assert tuned.manifest.tuned_defaults == {"torch": chosen}
    assert tuned.manifest.runtime_defaults == {"mode": "sd", "k": 4, "stop_ids": [2]}  # the plain ones stay
    d = Pipeline.from_bundle(out / "bundle", adapter="none").defaults
    assert d.mode == chosen["mode"] and all(getattr(d, k) == v for k, v in chosen.items())
    assert Pipeline.from_bundle(x / "bundle", adapter="none").defaults.mode == "sd"  # X's bundle is untouched

    card = (out / "TUNING_CARD.md").read_text()
    assert "| torch |" in card and "candidates, each timed against ar right after it" in card
    assert (out / "speedup_vs_tau.png").stat().st_size > 1000
    assert set(result.files_to_log) <= {p.name for p in out.iterdir()}
    assert result.tables == {"candidates.json": "candidates.jsonl"}


def test_stage_1f_refuses_what_it_cannot_tune(stage0, tmp_path):
    module = load_stage("1F")
    two = _bundle(tmp_path / "two", tiers=("draft", "target"))
    with pytest.raises(
        KibidangoError, match=r"needs the draft, qualifier and target tiers \(missing \['qualifier'\]\)"
    ):
        module.run(_config(), {"bundle": two, "data": stage0}, tmp_path / "o1")
    three = _bundle(tmp_path / "three")
    with pytest.raises(KibidangoError, match="backend 'llamacpp' needs every tier's gguf weights"):
        module.run(_config(backends=["llamacpp"]), {"bundle": three, "data": stage0}, tmp_path / "o2")
    with pytest.raises(KibidangoError, match="input 'data' is not wired"):
        module.run(_config(), {"bundle": three}, tmp_path / "o3")
