"""Training plumbing without running axolotl: rendered configs and hardware switches, progress
parsing, live metrics reaching MLflow, the KD alignment check, and the LM measurements."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from core.contract import KibidangoError
from core.progress import report_metrics
from flows.plan import describe_plan
from flows.preset import load_preset
from flows.runner import RunContext, execute_stage
from methods.training import axolotl
from methods.training.chat import TEMPLATE, messages
from methods.training.kd import check_alignment
from methods.training.recipe import TrainRecipe

LORA = TrainRecipe(max_steps=10, adapter="lora", axolotl={"flash_attention": True, "sample_packing": True})


def test_cpu_switches_override_the_recipe_and_gpu_keeps_it():
    cpu = axolotl.render(LORA, "base", [{"path": "d.jsonl"}], "/w", cuda=False)
    assert cpu["bf16"] is False and cpu["fp16"] is False and cpu["tf32"] is False
    assert cpu["flash_attention"] is False and cpu["sample_packing"] is False
    assert cpu["lora_mlp_kernel"] is cpu["lora_qkv_kernel"] is cpu["lora_o_kernel"] is False
    gpu = axolotl.render(LORA, "base", [{"path": "d.jsonl"}], "/w", cuda=True)
    assert gpu["bf16"] == "auto" and gpu["flash_attention"] is True and gpu["sample_packing"] is True
    assert gpu["lora_mlp_kernel"] is True
    # Everything but the hardware switches is the same YAML on both.
    hw = set(axolotl.hardware_switches(False, "lora")) | set(axolotl.hardware_switches(True, "lora"))
    assert {k: v for k, v in cpu.items() if k not in hw} == {k: v for k, v in gpu.items() if k not in hw}
    assert cpu["chat_template_jinja"] == TEMPLATE and cpu["auto_resume_from_checkpoints"] is True
    assert cpu["output_dir"] == "/w/out" and cpu["adapter"] == "lora" and cpu["lora_target_linear"] is True


def test_gpu_preset_dry_run_shows_the_axolotl_yamls():
    text = describe_plan(load_preset("llama31-8b"))
    for run in ("sft", "draft", "qualifier", "lora-code", "lora-math", "lora-general"):
        assert f"axolotl run '{run}' (GPU; " in text
    assert "base_model: meta-llama/Llama-3.1-8B-Instruct" in text
    assert "base_model: meta-llama/Llama-3.2-1B-Instruct" in text
    assert "type: axolotl.integrations.kd.chat_template" in text and "kd_trainer: true" in text
    assert "bf16: auto" in text and "bf16: false" not in text


def test_missing_axolotl_names_the_remedy(monkeypatch, tmp_path):
    monkeypatch.setenv("KIBIDANGO_AXOLOTL_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(KibidangoError, match="axolotl is not installed.*make setup"):
        axolotl.train({"max_steps": 1}, tmp_path / "run", "x")


def test_a_checkpoint_cut_off_while_being_saved_is_removed_and_the_whole_one_before_it_kept(tmp_path, caplog):
    out = tmp_path / "out"

    def checkpoint(step: int, state: str | None) -> Path:
        path = out / f"checkpoint-{step}"
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"weights")
        if state is not None:
            (path / "trainer_state.json").write_text(state)
        return path

    whole_25, whole_100 = checkpoint(25, '{"global_step": 25}'), checkpoint(100, '{"global_step": 100}')
    cut_105 = checkpoint(105, None)  # killed before the Trainer wrote its state (written last)
    torn_110 = checkpoint(110, '{"global_st')  # killed in the middle of writing it
    (out / "checkpoint-notes").mkdir()  # not a step: neither kept nor removed
    with caplog.at_level("WARNING", logger="kibidango.axolotl"):
        kept = axolotl.complete_checkpoints(out, "P/target")
    assert kept == [whole_25, whole_100]  # by step: 100 after 25, whatever the names sort to
    assert not cut_105.exists() and not torn_110.exists() and (out / "checkpoint-notes").is_dir()
    assert "checkpoint-105 was cut off" in caplog.text and "checkpoint-110 was cut off" in caplog.text
    assert axolotl.complete_checkpoints(tmp_path / "absent", "P/target") == []


def test_trainer_log_lines_are_parsed_and_named_for_mlflow():
    line = "{'loss': '5.713', 'grad_norm': '1.284', 'memory/max_active (GiB)': '0', 'epoch': '0.01'}"
    assert axolotl._parse_logs(line) == {
        "loss": 5.713,
        "grad_norm": 1.284,
        "memory/max_active (GiB)": 0.0,
        "epoch": 0.01,
    }
    assert axolotl._parse_logs("no dict here") is None
    assert axolotl._metric_name("P/target/memory/max_active (GiB)") == "P/target/memory/max_active_GiB"


def test_a_stage_reports_live_metrics_into_its_mlflow_run(workspace, monkeypatch):
    import stages
    import stages.curate as s0

    def fake_run(cfg, inputs, out_dir):
        for step in (10, 20):
            report_metrics({"fake/loss": 1.0 / step}, step)
        (out_dir / "x.txt").write_text("x")
        return s0.StageResult({"done": 1.0})

    monkeypatch.setattr(s0, "run", fake_run)
    cfg = load_preset("tiny").configs["0"]
    execute_stage("0", cfg, {}, RunContext("t", "kibidango-livetest", str(workspace / "store")))
    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["kibidango-livetest"], output_format="list")[0]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "fake/loss")
    assert [(m.step, m.value) for m in history] == [(10, 0.1), (20, 0.05)]
    assert stages.STAGES["0"] == "stages.curate"


def test_kd_alignment_check_catches_shifted_teacher_positions(tmp_path):
    from datasets import Dataset

    rows = {
        "input_ids": [[1, 5, 6], [1, 7]],
        "target_logprobs": [[[0.0]] * 3, [[0.0]] * 2],
        "target_token_ids": [[[5]] * 3, [[7]] * 2],
    }
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ok" / "h"))
    check_alignment(tmp_path / "ok", [[1, 7], [1, 5, 6]], "t")  # order does not matter
    with pytest.raises(KibidangoError, match="tokenized 1 of 2 distillation rows differently"):
        check_alignment(tmp_path / "ok", [[1, 7], [1, 5, 9]], "t")
    longer = dict(rows, target_logprobs=[[[0.0]] * 5, [[0.0]] * 2])
    Dataset.from_dict(longer).save_to_disk(str(tmp_path / "bad" / "h"))
    with pytest.raises(KibidangoError, match="prepared row 0 has 3 tokens but 5 teacher positions"):
        check_alignment(tmp_path / "bad", [[1, 5, 6], [1, 7]], "t")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def test_the_teachers_own_answers_are_generated_once_and_read_back(tmp_path):
    """Sequence-level KD rows: the teacher's greedy answer to each instruction (plain texts
    skipped), from the end of the split; a resumed run reads the file instead of generating."""
    from transformers import AutoTokenizer

    from stages.distill import OwnOutputs, own_outputs

    hf = BENCH.parent / "stories260K" / "hf"
    if not (hf / "tokenizer.model").is_file():
        pytest.skip(f"needs stories260K's tokenizer under {hf}")
    tokenizer = AutoTokenizer.from_pretrained(hf)
    rows = [
        {"id": f"r{i}", "instruction": f"Say {i}." if i % 2 else "", "input": "", "output": "x", "domain": "general"}
        for i in range(6)
    ]
    spec = OwnOutputs(rows=2, max_new_tokens=5)
    path = tmp_path / "own.jsonl"
    teacher = _tiny_llama(0)
    got = own_outputs(teacher, tokenizer, rows, spec, path)
    assert [r["id"] for r in got] == ["r5", "r3"] and all(r["output"] and r["output"] != "x" for r in got)
    assert own_outputs(None, tokenizer, rows, spec, path) == got  # read back: no teacher needed

    # Generated together (left-padded prompts of different lengths): the same answers (float64).
    teacher = teacher.double()
    rows = [
        {**r, "instruction": r["instruction"] + " Please" * i if r["instruction"] else ""} for i, r in enumerate(rows)
    ]
    alone = own_outputs(teacher, tokenizer, rows, OwnOutputs(rows=3, max_new_tokens=6), tmp_path / "alone.jsonl")
    together = own_outputs(
        teacher, tokenizer, rows, OwnOutputs(rows=3, max_new_tokens=6, batch=3), tmp_path / "b.jsonl"
    )
    assert [r["id"] for r in alone] == ["r5", "r3", "r1"] and together == alone


def test_agreement_and_expected_acceptance(tmp_path):
    from methods.measure import lm

    a, b = _tiny_llama(0), _tiny_llama(1)
    paths = lm.target_paths(a, [lm.Prompt([1, 10, 20]), lm.Prompt([1, 30])], new_tokens=6)
    assert [len(ids) - start for ids, start in paths] == [6, 6]
    same = lm.agreement(a, a, paths)
    assert same["agreement"] == 1.0 and math.isclose(same["expected_acceptance"], 1.0, rel_tol=1e-5)
    other = lm.agreement(a, b, paths)
    assert 0.0 <= other["expected_acceptance"] < 1.0 and other["positions"] == 12
    runtime = lm.runtime_acceptance({"draft": a, "qualifier": a, "target": a}, [lm.Prompt([1, 10, 20])], 8)
    assert runtime["sd_acceptance_rate"] == 1.0 and runtime["pyramid_qualifier_acceptance_rate"] == 1.0


def test_chat_messages_and_response_loss():
    pytest.importorskip("sentencepiece")
    from eval.shared_data import SHARED

    tok_dir = SHARED / "models" / "stories260K" / "hf"
    if not tok_dir.is_dir():
        pytest.skip(f"needs {tok_dir} (../shared)")
    from transformers import AutoTokenizer

    from methods.measure import lm

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    story = {"instruction": "", "input": "", "output": "Once upon a time there was a cat."}
    task = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    assert messages(story) == [{"role": "assistant", "content": story["output"]}]
    assert messages(task)[0] == {"role": "user", "content": "Add the numbers.\n\n2 and 3"}
    text = tok.apply_chat_template(messages(task), chat_template=TEMPLATE, tokenize=False)
    assert text == "<s>### Instruction:\nAdd the numbers.\n\n2 and 3\n\n### Response:\n5</s>"
    res = lm.response_loss(_tiny_llama(0), tok, [story, task], 64)
    assert res["tokens"] > 5 and math.isclose(res["perplexity"], math.exp(res["loss"]))
    assert json.dumps(res)
    assert yaml.safe_load(yaml.safe_dump({"t": TEMPLATE}))["t"] == TEMPLATE


def test_row_losses_in_length_sorted_batches_equal_one_row_at_a_time():
    """The batched measurement (rows sorted by length, the head and the cross-entropy on response
    positions only) gives each row the loss of a plain forward of that row alone."""
    pytest.importorskip("sentencepiece")
    from eval.shared_data import SHARED

    tok_dir = SHARED / "models" / "stories260K" / "hf"
    if not tok_dir.is_dir():
        pytest.skip(f"needs {tok_dir} (../shared)")
    from transformers import AutoTokenizer

    from methods.measure import lm
    from methods.training.chat import encode

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rows = [
        {"instruction": "Add the numbers." * k, "input": f"{k} and 3", "output": "The sum is 5, a small number. " * k}
        for k in (1, 4, 2, 6, 3)
    ] + [{"instruction": "", "input": "", "output": "Once upon a time there was a cat who sat."}]
    rows.append({"instruction": "Long " * 80, "input": "", "output": "cut off"})  # no response token within 64
    model = _tiny_llama(3)
    batched = lm.row_losses(model, tok, rows, 64, batch=3)
    for row, got in zip(rows, batched):
        ids, start = encode(tok, messages(row), 64)
        if len(ids) <= start:
            assert math.isnan(got)
            continue
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1]
        want = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[start:])))
        assert math.isclose(got, want, rel_tol=1e-4), (row, got, want)


BENCH = Path(__file__).resolve().parents[2] / "shared" / "models" / "bench-family"


def test_a_tier_starts_from_random_weights_or_from_a_pretrained_models_layers():
    from stages.pretrain import Config, TierPlan

    train = {"max_steps": 1}
    with pytest.raises(ValueError, match="starts from `arch`"):
        TierPlan(init_from="m", train=train)  # init_from without keep_layers
    with pytest.raises(ValueError, match="starts from `arch`"):
        TierPlan(
            arch={
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "intermediate_size": 8,
            },
            init_from="m",
            keep_layers=[0],
            train=train,
        )
    with pytest.raises(ValueError, match="both `pretrained` and trained"):
        Config(
            tokenizer="t", pretrained={"q": "m"}, tiers={"q": {"init_from": "m", "keep_layers": [0], "train": train}}
        )
    with pytest.raises(ValueError, match="at least one tier"):
        Config(tokenizer="t")


def test_a_student_starts_from_one_place():
    from stages.distill import Student

    with pytest.raises(ValueError, match="`init` or `keep_layers`, not both"):
        Student(init="m", keep_layers=[0, 29], train={"max_steps": 1})
    assert Student(keep_layers=[0, 29], train={"max_steps": 1}).keep_layers == [0, 29]


@pytest.mark.skipif(not (BENCH / "qualifier" / "config.json").is_file(), reason=f"{BENCH} (../shared) is absent")
def test_layer_dropping_keeps_the_chosen_layers_and_a_working_kv_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    from methods.training.models import truncate_llama

    tok = BENCH.parent / "stories260K" / "hf"
    with pytest.raises(KibidangoError, match="distinct layer indices"):
        truncate_llama(BENCH / "qualifier", [0, 9], tok, tmp_path / "bad")
    out = truncate_llama(BENCH / "qualifier", [0, 1, 5], tok, tmp_path / "q")
    small = AutoModelForCausalLM.from_pretrained(str(out))
    big = AutoModelForCausalLM.from_pretrained(str(BENCH / "qualifier"), dtype=torch.float32)
    assert small.config.num_hidden_layers == 3 and small.dtype == torch.float32
    assert torch.equal(small.model.layers[2].mlp.up_proj.weight, big.model.layers[5].mlp.up_proj.weight)
    assert torch.equal(small.lm_head.weight, big.lm_head.weight) and (out / "tokenizer.model").is_file()
    ids = torch.tensor([[1, 403, 261, 70, 45]])
    cached = small.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
    uncached = small.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)  # the cache is indexed by the renumbered layers
