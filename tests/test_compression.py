"""Compression and export stages on the real stories260K (../shared) with a small stage-0-shaped
dataset: 2A's sparsity is measured in the saved tensors, 2B writes a compressed-tensors
checkpoint the runtime loads, 2D's gate passes a faithful GGUF and fails a damaged one with a
report, X + 2E make a bundle the runtime verifies, and library failures name stage and remedy."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from core.contract import KibidangoError
from core.hashing import file_sha256
from core.store import content_digest
from eval.shared_data import SHARED
from methods.compression.gguf import gguf_type
from tests.conftest import noisy_copy

STORIES = SHARED / "models" / "stories260K" / "hf"
LINES = (Path(__file__).resolve().parent.parent / "eval" / "prompts" / "stories.txt").read_text().splitlines()


def _needs_stories() -> None:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES} (absent on this machine)")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A stage-0 artifact: a DatasetDict with the stage-0 columns."""
    from datasets import Dataset, DatasetDict

    stories = [line for line in LINES if line.strip()]
    rows = [
        {
            "instruction": "",
            "input": "",
            "output": f"{s} They played all day and were happy. The end.",
            "domain": "general",
        }
        for s in stories * 6
    ]
    rows += [
        {"instruction": "Write a short story.", "input": "", "output": f"{s} The sun was warm.", "domain": "general"}
        for s in stories * 2
    ]
    root = tmp_path_factory.mktemp("stage0")
    cols = lambda rs: {k: [r[k] for r in rs] for k in rs[0]}  # noqa: E731
    DatasetDict(
        {"train": Dataset.from_dict(cols(rows)), "validation": Dataset.from_dict(cols(rows[:12]))}
    ).save_to_disk(str(root / "dataset"))
    return root


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    """An upstream artifact holding stories260K as every tier."""
    _needs_stories()
    root = tmp_path_factory.mktemp("family")
    for tier in ("draft", "qualifier", "target"):
        shutil.copytree(STORIES, root / tier)
    return root


def _listing(root: Path) -> list[dict]:
    """Every file under ``root`` with its sha256, as the artifact store digests an artifact."""
    return [
        {"path": p.relative_to(root).as_posix(), "sha256": file_sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]


def card_text(out: Path) -> str:
    return (out / "bundle" / "BUNDLE_CARD.md").read_text()


def _run(stage_id: str, inputs: dict[str, Path], out: Path, **config):
    from stages import load_stage

    module = load_stage(stage_id)
    out.mkdir(parents=True)
    return module.run(module.Config.model_validate(config), inputs, out)


@pytest.fixture(scope="module")
def pruned(family, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("2A") / "out"
    result = _run(
        "2A",
        {"model": family, "data": data},
        out,
        recipe="recipes/stage2A/sparsegpt-tiny.llmc.yaml",
        calibration_samples=8,
        calibration_max_len=64,
        eval_rows=8,
        min_sparsity=0.45,
    )
    assert result.metrics["val_perplexity_after"] > 0
    return out


def test_pruning_sparsity_is_counted_in_the_saved_tensors(pruned):
    from safetensors.torch import load_file

    from methods.measure.weights import weight_sparsity

    tensors = load_file(str(pruned / "target" / "model.safetensors"))
    measured = weight_sparsity(pruned / "target")
    assert 0.49 < measured["sparsity"] < 0.51 and measured["pruned_tensors"] == 35
    assert float((tensors["model.embed_tokens.weight"] == 0).float().mean()) < 0.01  # embeddings/head stay dense
    assert json.loads((pruned / "prune.json").read_text())["metrics"]["sparsity"] == measured["sparsity"]
    assert "SparseGPTModifier" in (pruned / "llmcompressor_recipe.yaml").read_text()


def test_recipe_blocks_llmcompressor_would_skip_are_refused(tmp_path):
    from methods.compression.llmc import read_recipe

    bad = tmp_path / "r.yaml"
    bad.write_text("sparsity_stage_1:\n  sparsity_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n")
    with pytest.raises(KibidangoError, match=r"sparsity_stage_1.*do not end in '_stage'"):
        read_recipe(bad, "2A")


def test_awq_writes_a_compressed_tensors_checkpoint_the_runtime_loads(family, data, tmp_path, monkeypatch):
    from kibidango.backends.torch_backend import TorchModel

    result = _run(
        "2B",
        {"model": family, "data": data},
        tmp_path / "2B",
        recipe="recipes/stage2B/awq-w4a16-channel.llmc.yaml",
        tiers=["draft"],
        calibration_samples=8,
        calibration_max_len=64,
        eval_rows=8,
    )
    out = tmp_path / "2B" / "draft"
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == "pack-quantized"
    assert result.metrics["draft_size_ratio"] < 0.5  # int4 decoder weights; the fp32 embedding table stays
    assert result.metrics["draft_val_perplexity_after"] < 2 * result.metrics["draft_val_perplexity_before"]
    model = TorchModel(out, name="draft")
    rows = model.new_session().feed([1, 403, 407])
    assert rows.shape == (3, 512)
    # decompressed once, then run as a plain model: no compressed-tensors wrapper left on any module's
    # forward (on a CPU they cost the tiny target a third of its tokens/s)
    assert not [name for name, m in model.hf.named_modules() if "forward" in m.__dict__]
    # 2F's dense copy reproduces the compressed model (a plain save/reload re-initialised its Linear weights)
    from methods.compression.llmc import decompress
    from methods.measure.lm import validation_loss

    dense = decompress(out, tmp_path / "dense")
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    a, b = (validation_loss(p, data / "dataset", 8, 64)["loss"] for p in (out, dense))
    assert abs(a - b) < 1e-4 * a
    np.testing.assert_allclose(TorchModel(dense, name="dense").new_session().feed([1, 403, 407]), rows, atol=1e-5)
    # 2F's task check answers with and without the adapter on the compressed model: an adapter that
    # changes nothing is fit to be the default weights, one that changes the answers is not (a judge
    # that passes exactly the bare weights' answers; the math judge is the stage's)
    _check_recovery_adapter(out, dense, tmp_path, monkeypatch)


def _check_recovery_adapter(compressed, dense, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import methods.judges.math
    from methods.training.adapter_manifest import write_adapter_manifest
    from stages.recovery_lora import TaskCheck, task_check

    bare_answers: dict[int, str] = {}
    reward_change = False  # the judge passes the bare pass's answers, or (True) only answers that differ from them

    class BareAnswersPass:
        def __call__(self, task, text):
            ok = (bare_answers.setdefault(id(task), text) == text) != reward_change
            outcome = "passed" if ok else "failed"
            return SimpleNamespace(outcome=outcome, passed=ok, score=float(ok), reason="", cost=0.0, details={})

    monkeypatch.setattr(methods.judges.math, "MathJudge", BareAnswersPass)
    check = TaskCheck(levels=[1, 2], per_level=2, max_new_tokens=8, parallel=2)
    # (adapter, judge rewards change, bare passed, adapter passed, default weights): a tie keeps the bare
    # weights (the adapter must earn its extra matmuls), fewer passes do, only more passes make it the default
    cases = [("identity", False, 4, 4, False), ("damaging", False, 4, 0, False), ("damaging", True, 0, 4, True)]
    for name, reward_change, bare_passed, adapter_passed, fit in cases:
        scale = 0.0 if name == "identity" else 5.0
        torch.manual_seed(0)
        lora = get_peft_model(AutoModelForCausalLM.from_pretrained(str(dense)), LoraConfig(r=2, lora_alpha=4))
        with torch.no_grad():
            for n, w in lora.named_parameters():
                if "lora_B" in n:
                    w.copy_(torch.randn_like(w) * scale)
        adapter = tmp_path / f"{name}-{reward_change}"
        lora.save_pretrained(str(adapter / "adapter"))
        files = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
        write_adapter_manifest(adapter, {"peft": files}, domain="recovery", base_tier="draft", metrics={})
        bare_answers.clear()
        result = task_check(check, compressed, adapter, adapter / "work")
        assert result["tasks"] == 4, result
        assert (result["bare_passed"], result["adapter_passed"]) == (bare_passed, adapter_passed), (name, result)
        assert result["default_weights"] == fit, (name, reward_change, result)


def test_an_adapter_that_costs_speed_is_the_default_only_beyond_noise_where_the_recipe_asks():
    from stages.recovery_lora import TaskCheck

    plain, strict = TaskCheck(), TaskCheck(max_p=0.05)
    assert plain.default_weights(17, 15, 0.625) and not plain.default_weights(15, 15, 1.0)
    assert not strict.default_weights(17, 15, 0.625)  # the small run's check: 3 vs 1 discordant
    assert strict.default_weights(20, 12, 0.039) and not strict.default_weights(12, 20, 0.039)


def test_a_group_size_the_widths_do_not_allow_names_the_stage(family, data, tmp_path):
    with pytest.raises(
        KibidangoError,
        match=r"(?s)AWQ \(draft\): llm-compressor refused recipe .*group_size.*remedy: a group_size that divides",
    ):
        _run(
            "2B",
            {"model": family, "data": data},
            tmp_path / "2B",
            recipe="recipes/stage2B/awq-w4a16-g128.llmc.yaml",
            tiers=["draft"],
            calibration_samples=4,
            calibration_max_len=32,
            eval_rows=4,
        )


def test_out_of_memory_names_the_stage_and_the_remedy(family, data, tmp_path, monkeypatch):
    import llmcompressor

    def oom(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(llmcompressor, "oneshot", oom)
    with pytest.raises(KibidangoError, match=r"SparseGPT: out of memory .* remedy: fewer calibration_samples"):
        _run(
            "2A",
            {"model": family, "data": data},
            tmp_path / "2A",
            recipe="recipes/stage2A/sparsegpt-tiny.llmc.yaml",
            calibration_samples=4,
            eval_rows=4,
        )


GATE = {"tiers": {"draft": {"input": "small", "quant": "Q8_0"}}, "prompts": 6, "new_tokens": 16, "eval_rows": 6}


def test_gguf_gate_passes_a_faithful_export(family, data, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    result = _run("2D", {"small": family, "data": data}, tmp_path / "2D", **GATE)
    assert result.metrics["draft_token_agreement"] >= 0.95
    assert (tmp_path / "2D" / "draft" / "draft-Q8_0.gguf").is_file() and not (
        tmp_path / "2D" / "draft" / "draft-F16.gguf"
    ).exists()
    assert result.metrics["draft_gguf_bytes"] < result.metrics["draft_f16_bytes"]
    assert "PASS" in (tmp_path / "2D" / "gguf_report.md").read_text()


def test_gguf_gate_fails_a_damaged_model_with_a_report(family, data, tmp_path, monkeypatch):
    """The converter is handed a damaged copy of the tier (weights with 30% noise), as a broken
    conversion would produce: the gate compares the GGUF with the real HF model and fails."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    import stages.gguf_export as s2d

    damaged = noisy_copy(STORIES, tmp_path / "damaged", 0.3)
    real = s2d.convert_hf_to_gguf
    monkeypatch.setattr(s2d, "convert_hf_to_gguf", lambda hf, out, outtype: real(damaged, out, outtype))
    with pytest.raises(KibidangoError) as err:
        _run("2D", {"small": family, "data": data}, tmp_path / "2D", **GATE)
    text = str(err.value)
    assert "GGUF token-agreement gate failed: draft (Q8_0): agreement" in text
    assert "where the GGUF first differs" in text and "| first difference at |" in text


def test_gguf_fidelity_table_chooses_the_smallest_type_within_the_rule(family, pruned, data, tmp_path):
    """A tier whose type is auto: every candidate is measured against the reference's F16 and the
    smallest within the rule ships, alone in ``<tier>/``; the table is in the report and gguf.json."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    fidelity = {
        "reference": "reference",
        "candidates": [
            {"quant": "Q8_0"},
            {"quant": "Q4_0", "imatrix": True},
            {"input": "reference", "quant": "Q8_0"},
            {"quant": "Q2_K"},
            {"quant": "Q4_0", "tensors": {"attn_v": "Q8_0"}},
        ],
        "max_ppl_ratio": 1.3,
        "max_ladder_drop": 0,
        "ladder_levels": [1],
        "ladder_code_levels": [1],  # code tasks beside the math ones, in the code judge's sandbox
        "ladder_per_level": 2,
        "ladder_new_tokens": 8,
        "imatrix_rows": 4,
        "speed_prompts": 2,
        "speed_tokens": 4,
        "speed_rounds": 1,
    }
    config = {**GATE, "tiers": {"target": {"input": "target", "quant": "auto", "fidelity": fidelity}}}
    out = tmp_path / "2D"
    result = _run("2D", {"target": pruned, "reference": family, "data": data}, out, **config)
    rows = json.loads((out / "gguf.json").read_text())["fidelity"]["target"]
    assert [r["name"] for r in rows] == [
        "reference F16",
        "target Q8_0",
        "target Q4_0 +imatrix",
        "reference Q8_0",
        "target Q2_K",
        "target Q4_0 attn_v Q8_0",
    ]
    ref = rows[0]
    assert rows[-1]["bytes"] > rows[2]["bytes"]  # the mix's attn_v at 8 bits
    assert all(len(r["ladder"]) == 4 for r in rows)  # the verdicts the paired ladder test reads: 2 math, 2 code
    assert ref["reference"] and ref["ppl_ratio"] == 1.0 and ref["kl"] == 0.0
    # every row's agreement (the reference F16's with its own model too) with its bootstrap interval
    assert all(lo <= r["agreement"] <= hi for r in rows for lo, hi in [r["agreement_interval"]])
    assert all(r["tokens"] == ref["tokens"] > 0 and r["ladder_tasks"] == 4 for r in rows)
    assert all(r["kl"] > 0 and r["bytes"] < ref["bytes"] for r in rows[1:])
    fits = [r for r in rows[1:] if not r["why_not"]]
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0] == min(fits, key=lambda r: (r["bytes"], r["ppl_ratio"]))
    shipped = list((out / "target").glob("*.gguf"))
    mixed = "-mix" if chosen[0]["name"] == "target Q4_0 attn_v Q8_0" else ""  # not named for its base type alone
    assert [p.name for p in shipped] == [f"target-{chosen[0]['quant']}{mixed}.gguf"]
    assert not (out / "_fidelity").exists()
    assert result.metrics["target_chosen_ppl_ratio"] == chosen[0]["ppl_ratio"]
    assert result.metrics["target_gguf_bytes"] == chosen[0]["bytes"]
    # the shipped file's gate figures are the table's own, measured once
    assert result.metrics["target_token_agreement"] == chosen[0]["agreement"]
    assert result.metrics["target_val_perplexity_gguf"] == chosen[0]["ppl"]
    report = (out / "gguf_report.md").read_text()
    assert "## target: fidelity table" in report and "**chosen**" in report
    assert "ladder: 4 tasks (math levels 1 and code levels 1, 2 mining-part tasks a level)" in report
    # every row's agreement is with the reference's transformers model (the target rows' too)
    assert "token agreement with the reference (reference) (HF)" in report


def test_gguf_fidelity_fallback_quantizes_the_tier_input_no_candidate_came_from(family, pruned, data, tmp_path):
    """Nothing fits the rule: the recipe's fallback ships, quantized from the tier's input even when
    every candidate came from the reference (its F16 is converted then, not before)."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    fidelity = {
        "reference": "reference",
        "candidates": [{"input": "reference", "quant": "Q2_K"}],
        "max_ppl_ratio": 1.0001,  # Q2_K of a 260K-parameter model is further than that
        "max_ladder_drop": 0,
        "ladder_levels": [1],
        "ladder_per_level": 1,
        "ladder_new_tokens": 4,
        "speed_prompts": 1,
        "speed_tokens": 2,
        "speed_rounds": 1,
        "fallback": "Q8_0",
    }
    config = {
        **GATE,
        "min_agreement": 0.0,
        "tiers": {"target": {"input": "target", "quant": "auto", "fidelity": fidelity}},
    }
    out = tmp_path / "2D"
    _run("2D", {"target": pruned, "reference": family, "data": data}, out, **config)
    rows = json.loads((out / "gguf.json").read_text())["fidelity"]["target"]
    assert [r["name"] for r in rows] == ["reference F16", "reference Q2_K"] and rows[1]["why_not"]
    assert [p.name for p in (out / "target").glob("*.gguf")] == ["target-Q8_0.gguf"]
    report = (out / "gguf_report.md").read_text()
    assert "no candidate fits: the fallback Q8_0 ships" in report
    assert "token agreement with target's" in report  # the fallback's own model: no table row measured it


def test_gguf_fidelity_config_names_what_is_missing(family, data, tmp_path):
    from pydantic import ValidationError

    import stages.gguf_export as s2d

    with pytest.raises(ValidationError, match="quant: auto and a fidelity block go together"):
        s2d.Config.model_validate({"tiers": {"target": {"input": "target", "quant": "auto"}}})
    fidelity = {"reference": "reference", "candidates": [{"quant": "Q8_0"}]}
    with pytest.raises(KibidangoError, match="tier target reads input 'reference', which the preset does not give"):
        _run(
            "2D",
            {"target": family, "data": data},
            tmp_path / "a",
            tiers={"target": {"input": "target", "quant": "auto", "fidelity": fidelity}},
        )
    for bad, why in (
        ({"quant": "Q9_9"}, "unknown quant 'Q9_9'"),
        ({"quant": "Q4_0", "embedding": "Q7"}, "unknown embedding type 'Q7'"),
        ({"quant": "Q4_0", "tensors": {"attn_v": "Q7"}}, "unknown tensor type 'Q7' for 'attn_v'"),
        ({"quant": "Q4_0", "tensors": {"ffn_(gate": "Q8_0"}}, "tensor pattern 'ffn_\\(gate' is not a regular"),
    ):
        tiers = {"target": {"input": "target", "quant": "auto", "fidelity": {**fidelity, "candidates": [bad]}}}
        with pytest.raises(ValidationError, match=why):  # at make dry-run, not when 2D runs
            s2d.Config.model_validate({"tiers": tiers})
    mix = s2d.Candidate(quant="Q4_0", imatrix=True, tensors={r"blk\.(0|1)\.ffn_(gate|up)": "Q8_0", "attn_v": "Q8_0"})
    assert mix.label("target") == "target Q4_0 +imatrix blk.(0,1).ffn_(gate,up) Q8_0 attn_v Q8_0"  # a markdown cell
    assert mix.file_type() == "Q4_0-mix" and s2d.Candidate(quant="Q4_0", embedding="Q5_0").file_type() == "Q4_0-mix"
    assert s2d.Candidate(quant="Q4_0", imatrix=True).file_type() == "Q4_0"  # the shipped file's name
    assert s2d.Candidate(quant="IQ4_XS", embedding="IQ4_XS").file_type() == "IQ4_XS-mix"  # tiny's 4.35 bits
    # what 2D's card, 2F and the bundle read back from that name
    assert [gguf_type(Path(f"target-{q}.gguf")) for q in ("Q5_0", "Q4_0-mix")] == ["Q5_0", "Q4_0-mix"]
    with pytest.raises(KibidangoError, match="named <tier>-<type>.gguf"):
        gguf_type(Path("target.gguf"))
    # the ladder leaves out the tasks 1B answered (1R trained on the corrected ones) and still holds as many
    f = s2d.Fidelity(
        reference="r", candidates=[{"quant": "Q8_0"}], ladder_levels=[2], ladder_code_levels=[4], ladder_per_level=3
    )
    every = s2d._ladder_tasks(f)
    assert [r["domain"] for r in every] == ["math"] * 3 + ["code"] * 3
    mined = tmp_path / "1B"
    mined.mkdir()
    (mined / "answered_tasks.json").write_text(json.dumps({"round": 1, "ids": [every[0]["id"], every[3]["id"]]}))
    answered = s2d._answered({"mined": mined})
    left = s2d._ladder_tasks(f, answered)
    assert len(left) == 6 and not {every[0]["id"], every[3]["id"]} & {r["id"] for r in left}
    assert s2d._answered({}) is None and s2d._ladder_said(f, answered).endswith("none that 1B answered")
    with pytest.raises(KibidangoError, match="no answered_tasks.json"):
        s2d._answered({"mined": tmp_path})
    with pytest.raises(ValidationError, match="unknown fallback 'Q9'"):
        s2d.Config.model_validate(
            {"tiers": {"target": {"input": "t", "quant": "auto", "fidelity": {**fidelity, "fallback": "Q9"}}}}
        )


def test_bundle_export_and_packing_make_a_bundle_the_runtime_verifies(family, data, pruned, tmp_path):
    """X assembles a bundle from stage-shaped artifacts (with manifests), 2E packs it, the runtime
    loads both forms and refuses a tampered file by name."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    from flows.__main__ import main as flows_main  # noqa: F401  (the CLI module imports cleanly)
    from kibidango import BundleError, Pipeline, load_bundle

    store = tmp_path / "store"
    arts = {}
    for stage, src in (("2B", family), ("2C", family), ("0", data), ("2A", pruned)):
        dest = store / stage / f"key{stage}"
        shutil.copytree(src, dest)
        metrics = json.loads((src / "prune.json").read_text())["metrics"] if stage == "2A" else {}
        (dest / "manifest.json").write_text(
            json.dumps(
                {
                    "key": f"key{stage}",
                    "mlflow_run_id": f"run{stage}",
                    "metrics": metrics,
                    "inputs": {"data": {"key": "key0"}} if stage != "0" else {},
                }
            )
        )
        arts[stage] = dest
    gguf = store / "2D" / "key2D"
    _run(
        "2D",
        {"small": family, "target": family, "data": data},
        gguf,
        tiers={"draft": {"input": "small", "quant": "Q8_0"}, "target": {"input": "target", "quant": "Q8_0"}},
        prompts=4,
        new_tokens=8,
        eval_rows=4,
    )
    (gguf / "manifest.json").write_text(
        json.dumps(
            {
                "key": "key2D",
                "mlflow_run_id": "run2D",
                "metrics": json.loads((gguf / "gguf.json").read_text())["metrics"],
                "inputs": {},
            }
        )
    )
    out = store / "X" / "keyX"
    result = _run(
        "X",
        {"target": arts["2B"], "small": arts["2C"], "gguf": gguf, "prune": arts["2A"]},
        out,
        preset="test",
        hf_tiers={"target": "target", "draft": "small"},
        runtime_defaults={"mode": "sd", "k": 3, "stop_ids": [2]},
    )
    bundle = load_bundle(out / "bundle")
    assert set(bundle.tiers) == {"draft", "target"} and bundle.manifest.stage_cache_keys["0"] == "key0"
    assert result.metrics["files"] == len(bundle.manifest.files)
    # Rebuilt from the same inputs (a rerun of X): the same bytes, so the stages after X stay cache hits.
    # Nothing in the bundle says when, by which git sha or under which MLflow run it was built.
    again = store / "X" / "keyX-rerun"
    time.sleep(1.1)  # a wall-clock time in any file would differ now
    _run(
        "X",
        {"target": arts["2B"], "small": arts["2C"], "gguf": gguf, "prune": arts["2A"]},
        again,
        preset="test",
        hf_tiers={"target": "target", "draft": "small"},
        runtime_defaults={"mode": "sd", "k": 3, "stop_ids": [2]},
    )
    assert content_digest(_listing(again)) == content_digest(_listing(out))
    manifest = (out / "bundle" / "bundle.json").read_text()
    assert "run2D" not in manifest and "run2D" not in card_text(out) and "git_sha" not in manifest
    card = (out / "bundle" / "BUNDLE_CARD.md").read_text()
    g = json.loads((gguf / "gguf.json").read_text())["metrics"]
    assert f"{g['draft_gguf_bytes'] / 1e6:.3f} MB" in card and f"{g['draft_token_agreement']:.1%}" in card
    assert "Pruning (2A): 50.0% of the target's decoder linear weights are zero" in card
    # The family's chat format travels with the tokenizer: the runtime's chat prompts as training did.
    from methods.training.chat import TEMPLATE

    pipe = Pipeline.from_bundle(out / "bundle")
    turns = [{"role": "user", "content": "Add 2 and 3."}]
    assert pipe.tokenizer.chat_template == TEMPLATE
    assert pipe.tokenizer.apply_chat_template(turns, tokenize=False).endswith("### Response:\n")
    for backend in ("torch", "llamacpp"):
        text = (
            Pipeline.from_bundle(out / "bundle", backend=backend).generate("Once upon a time", max_new_tokens=12).text
        )
        assert text.strip()

    packed = store / "2E" / "key2E"
    metrics = _run("2E", {"bundle": out}, packed, dict_size=8192, level=10).metrics
    assert metrics["ratio"] > 1 and metrics["files"] == len(bundle.manifest.files) + 2  # + bundle.json and its .sha256
    assert "byte for byte" in (packed / "pack_report.md").read_text()

    victim = out / "bundle" / "tiers" / "draft" / "gguf" / "draft-Q8_0.gguf"
    data_bytes = bytearray(victim.read_bytes())
    data_bytes[-100] ^= 0xFF
    victim.write_bytes(bytes(data_bytes))
    with pytest.raises(BundleError, match=r"tiers/draft/gguf/draft-Q8_0\.gguf does not match its sha256"):
        load_bundle(out / "bundle")


def test_recovery_lora_for_the_shipped_gguf_trains_on_its_weights_and_is_checked_on_llamacpp(data, tmp_path):
    """2F `base: gguf`: the shipped GGUF dequantized is the LoRA's base (it scores the validation
    rows as llama.cpp scores the GGUF, with the reference's tokenizer files; a damaged copy is
    refused), and a LoRA on it, converted by llama.cpp's converter, is checked on llama.cpp as rows
    of 2D's fidelity table: its bytes count the adapter's file, and a LoRA that moves the model
    away from the reference diverges from it more than the bare GGUF does."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    _needs_stories()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import stages.recovery_lora as s2f
    from methods.compression.gguf import quantize
    from methods.llama_cpp_tools import convert_hf_to_gguf, convert_lora_to_gguf
    from methods.measure.lm import validation_rows
    from methods.training.adapter_manifest import write_adapter_manifest
    from methods.training.models import dense_from_gguf, tokenizer_files

    shipped = tmp_path / "2D" / "target"
    shipped.mkdir(parents=True)
    gguf = quantize(convert_hf_to_gguf(STORIES, tmp_path / "f16.gguf", "f16"), shipped / "target-Q8_0.gguf", "Q8_0")
    assert s2f._shipped_gguf({"gguf": tmp_path / "2D"}, "target") == gguf
    base = dense_from_gguf(gguf, STORIES, tmp_path / "base")
    assert sorted(f.name for f in tokenizer_files(base)) == sorted(f.name for f in tokenizer_files(STORIES))
    assert all(file_sha256(f) == file_sha256(base / f.name) for f in tokenizer_files(STORIES))
    cfg = s2f.Config.model_validate(
        {
            "base": "gguf",
            "train": {"max_steps": 1, "adapter": "lora"},
            "eval_rows": 8,
            "eval_max_len": 64,
            "check": {"levels": [1], "per_level": 2, "max_new_tokens": 8, "speed_prompts": 2},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    scored = lambda model: validation_rows(model, data / "dataset", 8, 64)  # noqa: E731 - as 2F scores comp_rows
    s2f._check_base(cfg, base, None, gguf, data / "dataset", scored(base), tokenizer)
    damaged = noisy_copy(base, tmp_path / "damaged", 0.3)
    with pytest.raises(KibidangoError, match="does not reproduce"):
        s2f._check_base(cfg, damaged, None, gguf, data / "dataset", scored(damaged), tokenizer)

    torch.manual_seed(0)
    adapter = tmp_path / "2F"
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), lora).save_pretrained(str(adapter / "adapter"))
    convert_lora_to_gguf(adapter / "adapter", base, adapter / "adapter.gguf", "f16")  # as 2F converts it
    write_adapter_manifest(adapter, {"gguf": ["adapter.gguf"]}, domain="recovery", base_tier="target")
    verdict, table = s2f.gguf_check(cfg, STORIES, gguf, adapter, tokenizer, data / "dataset", tmp_path / "check")
    assert [r.name for r in table] == ["reference F16", "shipped Q8_0", "shipped Q8_0 + recovery LoRA"]
    ref, bare, adapted = table
    assert ref.reference and ref.ppl_ratio == 1.0 and ref.kl == 0.0
    assert (
        adapted.bytes
        == gguf.stat().st_size + (adapter / "adapter.gguf").stat().st_size
        == bare.bytes + (adapter / "adapter.gguf").stat().st_size
    )
    assert 0 < bare.kl < adapted.kl and bare.tokens == adapted.tokens > 0
    assert verdict["tasks"] == 2 and verdict["default_weights"] == (verdict["adapter_passed"] > verdict["bare_passed"])
    metrics = s2f._table_metrics(table)
    assert metrics["gguf_lora_kl"] == adapted.kl and metrics["gguf_bare_bytes"] == bare.bytes


def test_2g_takes_an_adapter_as_default_weights_only_if_its_check_allowed_it(tmp_path):
    from methods.training.adapter_manifest import write_adapter_manifest
    from stages.calibrate import _fit_as_default

    dirs = []
    for domain, fit in (("recovery", False), ("code", None)):
        d = tmp_path / domain
        d.mkdir()
        extra = {} if fit is None else {"default_weights": fit}
        write_adapter_manifest(d, {}, domain=domain, base_tier="target", **extra)
        dirs.append(d)
    assert not _fit_as_default(dirs, "recovery")  # 2F's check: fewer ladder tasks than the bare weights
    assert _fit_as_default(dirs, "code")  # no check made


def test_2g_runs_a_gguf_only_default_adapter_on_llamacpp_alone(tmp_path):
    """2F `base: gguf` ships its LoRA as a GGUF adapter only: 2G answers with the torch target's bare
    weights, fits llama.cpp's temperature with the adapter applied, and its card says which."""
    from methods.training.adapter_manifest import write_adapter_manifest
    from stages.calibrate import _default_said, _forms

    for domain, formats in (("recovery", ["gguf"]), ("code", ["peft", "gguf"])):
        d = tmp_path / domain
        d.mkdir()
        for f in formats:
            (d / f).write_text(f)
        write_adapter_manifest(d, {f: [f] for f in formats}, domain=domain, base_tier="target")
    dirs = [tmp_path / "recovery", tmp_path / "code"]
    assert _forms(dirs, "recovery") == {"gguf"} and _forms(dirs, "code") == {"peft", "gguf"}
    assert _forms(dirs, None) == set()
    said = _default_said({"default_adapter": "recovery", "default_adapter_forms": ["gguf"]})
    assert said.endswith("`recovery` on llama.cpp.")
    assert _default_said({"default_adapter": None}) == "The target's bare weights (no default adapter)."


def test_the_bundle_default_adapter_is_the_one_2g_calibrated_with_and_must_ship(tmp_path):
    from stages import load_stage

    x = load_stage("X")
    cfg = x.Config(preset="test", hf_tiers={"target": "target"}, calibration="calibration")
    inputs = {"calibration": tmp_path}
    recovery = [{"domain": "recovery"}, {"domain": "code"}]
    assert x._default_adapter(cfg, inputs, recovery) is None  # no report from 2G: the bare weights
    (tmp_path / "calibration_eval.json").write_text(json.dumps({"default_adapter": None}))
    assert x._default_adapter(cfg, inputs, recovery) is None
    (tmp_path / "calibration_eval.json").write_text(json.dumps({"default_adapter": "recovery"}))
    assert x._default_adapter(cfg, inputs, recovery) == "recovery"
    assert x._default_adapter(cfg.model_copy(update={"calibration": None}), inputs, recovery) is None
    with pytest.raises(KibidangoError, match="calibrated with adapter 'recovery', which this bundle does not ship"):
        x._default_adapter(cfg, inputs, [{"domain": "code"}])


def test_a_missing_llama_cpp_names_the_stage_and_the_remedy(tmp_path, monkeypatch):
    import sys

    from methods.compression.gguf import quantize

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the llamacpp extra were not installed
    with pytest.raises(KibidangoError, match=r"stage 2D needs llama-cpp-python .* remedy: make setup"):
        quantize(tmp_path / "m-F16.gguf", tmp_path / "m-Q8_0.gguf", "Q8_0")


def test_awq_exported_to_gguf_keeps_the_grid_awq_chose(data, tmp_path):
    """A fidelity row with an AWQ recipe quantizes its source after AWQ (2D's ``awq``): the
    dequantized checkpoint sits on AWQ's asymmetric 4-bit grid in groups of 32, and Q4_1 (blocks of
    32, a minimum and a step each) stores that grid: the GGUF's weights are AWQ's to within Q4_1's
    16-bit rounding of its step, where Q4_1 of the same weights before AWQ moves them by whole steps."""
    _needs_stories()
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM

    from methods.compression.gguf import quantize
    from methods.llama_cpp_tools import convert_hf_to_gguf
    from methods.training.models import copy_tokenizer
    from stages.gguf_export import Candidate, Fidelity, _awq_source

    config = AutoConfig.from_pretrained(STORIES)
    config.intermediate_size = 128  # every Linear's input width a multiple of 32 (stories260K's MLP: 172)
    torch.manual_seed(0)
    src = tmp_path / "src"
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    copy_tokenizer(STORIES, src)
    row = Candidate(quant="Q4_1", awq="recipes/stage2B/awq-w4a16-asym-g32.llmc.yaml")
    table = Fidelity(reference="reference", candidates=[row], imatrix_rows=8, imatrix_max_len=64)
    dense = _awq_source(row, src, {"data": data}, table, tmp_path / "work")
    assert row.label("target") == "target AWQ awq-w4a16-asym-g32 Q4_1"

    def q4_1(model_dir: Path, name: str) -> dict[str, np.ndarray]:
        f16 = convert_hf_to_gguf(model_dir, tmp_path / f"{name}-F16.gguf", "f16")
        reader = GGUFReader(str(quantize(f16, tmp_path / f"{name}-Q4_1.gguf", "Q4_1")))
        return {t.name: dequantize(t.data, t.tensor_type).reshape(-1) for t in reader.tensors}

    from safetensors.torch import load_file

    def steps_moved(stored: np.ndarray, w: np.ndarray) -> np.ndarray:
        """How far each weight moved, in its group of 32's step of a 16-level grid spanning the group."""
        step = np.repeat(np.ptp(w.reshape(-1, 32), axis=1) / 15, 32)
        return np.abs(stored - w) / np.maximum(step, 1e-12)

    awq_weights, before = load_file(str(dense / "model.safetensors")), load_file(str(src / "model.safetensors"))
    awq_gguf, before_gguf = q4_1(dense, "awq"), q4_1(src, "before")
    for layer in range(config.num_hidden_layers):
        for ours, theirs in (("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up"), ("self_attn.v_proj", "attn_v")):
            key, name = f"model.layers.{layer}.{ours}.weight", f"blk.{layer}.{theirs}.weight"
            moved = steps_moved(awq_gguf[name], awq_weights[key].float().numpy().reshape(-1))
            assert np.median(moved) < 0.005 and np.quantile(moved, 0.99) < 0.02, (name, np.quantile(moved, 0.99))
            # plain Q4_1 of the weights before AWQ rounds most of them by a sizeable share of a step
            assert np.median(steps_moved(before_gguf[name], before[key].float().numpy().reshape(-1))) > 0.15
