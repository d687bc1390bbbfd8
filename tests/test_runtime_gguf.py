"""The runtime's llamacpp backend on GGUFs made by llama.cpp's pinned converter: lossless modes
reproduce `ar` exactly with really different tiers, and the two backends agree on the same
weights within float tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from eval.shared_data import SHARED
from methods.llama_cpp_tools import convert_hf_to_gguf
from tests.conftest import noisy_copy, smollm2_gguf

STORIES = SHARED / "models" / "stories260K" / "hf"
PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park",
    "The cat was sad because",
    "One day, a big dog",
    "Tom had a red ball.",
]
# ggml's and torch's float32 kernels round differently: over 8 prompts x 64 tokens of stories260K
# the largest logit difference between the backends was 0.028 (`python -m eval.backend_agreement`);
# about twice that is the tolerance.
LOGIT_TOLERANCE = 0.06


@pytest.fixture(scope="module")
def gguf_bundle(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    from kibidango import write_bundle

    root = tmp_path_factory.mktemp("gguf")
    target = noisy_copy(STORIES, root / "target_hf", 0.03)
    draft_gguf = convert_hf_to_gguf(STORIES, root / "draft.gguf", "f32")
    target_gguf = convert_hf_to_gguf(target, root / "target.gguf", "f32")
    tiers = {
        "draft": {"hf": STORIES, "gguf": draft_gguf},
        "qualifier": {"hf": STORIES, "gguf": draft_gguf},
        "target": {"hf": target, "gguf": target_gguf},
    }
    return write_bundle(root / "bundle", tiers, {"mode": "pyramid", "stop_ids": [1, 2]}, preset="gguf-test")


def test_llamacpp_lossless_modes_equal_ar(gguf_bundle):
    from kibidango import Pipeline

    ar = Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar")
    sd = Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="sd", k=4)
    pyr = Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="pyramid", variant="exact", l_D=2, l_Q=6)
    rejected = 0
    for prompt in PROMPTS:
        ref = ar.generate(prompt, max_new_tokens=48)
        s = sd.generate(prompt, max_new_tokens=48)
        assert s.token_ids == ref.token_ids, prompt
        assert pyr.generate(prompt, max_new_tokens=48).token_ids == ref.token_ids, prompt
        m = s.metrics
        rejected += m.num_draft_tokens["draft"] - m.num_accepted_tokens["draft"]
        # KV rollback: the target is fed each position once, plus the rejected drafts once
        assert m.tokens_fed["target"] == m.prompt_tokens - 1 + m.generated_tokens + (
            m.num_draft_tokens["draft"] - m.num_accepted_tokens["draft"]
        )
    assert rejected > 0  # the tiers disagree: exactness is not trivial here


def test_backends_agree_on_the_same_weights(gguf_bundle):
    from kibidango import Pipeline

    torch_pipe = Pipeline.from_bundle(gguf_bundle, backend="torch", mode="ar")
    llama_pipe = Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar")
    identical = 0
    for prompt in PROMPTS:
        ids = torch_pipe.encode(prompt)
        out = torch_pipe.generate(prompt, max_new_tokens=48).token_ids
        identical += out == llama_pipe.generate(prompt, max_new_tokens=48).token_ids
        seq = ids + out
        lt = torch_pipe.models["target"].new_session().feed(seq)
        ll = llama_pipe.models["target"].new_session().feed(seq)
        assert np.abs(lt - ll).max() < LOGIT_TOLERANCE, prompt
        top2 = np.sort(lt, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * LOGIT_TOLERANCE  # positions that are not near-ties
        assert (lt.argmax(1) == ll.argmax(1))[clear].all(), prompt
    assert identical >= len(PROMPTS) - 1


def test_gguf_lora_adapters_switch_on_llamacpp_and_agree_with_peft(tmp_path):
    """One random LoRA in both forms (peft, and llama.cpp's converter's GGUF): switched on and off
    by the runtime's LRU on each backend, the two backends agree with it applied, and switching it
    off restores the base logits exactly."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    peft = pytest.importorskip("peft")
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    import torch
    from transformers import AutoModelForCausalLM

    from kibidango.addons.adapters import AdapterSet, LoadedAdapters
    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.backends.torch_backend import TorchModel
    from methods.llama_cpp_tools import convert_lora_to_gguf
    from methods.training.adapter_manifest import write_adapter_manifest

    torch.manual_seed(0)
    dest = tmp_path / "adapters" / "code"
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(STORIES)), lora).save_pretrained(str(dest / "adapter"))
    convert_lora_to_gguf(dest / "adapter", STORIES, dest / "adapter.gguf")
    formats = {"peft": ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"], "gguf": ["adapter.gguf"]}
    write_adapter_manifest(dest, formats, domain="code", base_tier="target")

    adapters = AdapterSet(tmp_path / "adapters")
    llama = LlamaCppModel(convert_hf_to_gguf(STORIES, tmp_path / "target.gguf", "f32"), name="target")
    torch_model = TorchModel(STORIES, name="target")
    on_llama, on_torch = LoadedAdapters(llama, adapters, 1), LoadedAdapters(torch_model, adapters, 1)
    ids = [1, 403, 407, 261, 378, 65, 265, 260, 300]  # token ids of the 512-token vocabulary
    base = llama.new_session().feed(ids)
    on_llama.use("code")
    on_torch.use("code")
    with_lora = llama.new_session().feed(ids)
    assert np.abs(with_lora - base).max() > 10 * LOGIT_TOLERANCE  # the adapter changes the model
    assert np.abs(with_lora - torch_model.new_session().feed(ids)).max() < LOGIT_TOLERANCE
    on_llama.use(None)
    assert np.array_equal(llama.new_session().feed(ids), base)
    on_llama.use("code")
    assert on_llama.loads == 1  # switched back on, not loaded again


def test_threads_are_the_same_for_steps_and_batches_unless_asked(gguf_bundle, monkeypatch):
    """llama-cpp-python's defaults give a batch (a verification) all the CPUs and a step half of
    them; the runtime gives both the same count: asked, from $KIBIDANGO_THREADS, or half the CPUs,
    unless the batches' count is asked apart."""
    import os

    from kibidango import Pipeline
    from kibidango.backends.llamacpp_backend import thread_counts

    def counts(pipe):
        params = pipe.models["target"].llm.context_params
        return params.n_threads, params.n_threads_batch

    assert counts(Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar", threads=1)) == (1, 1)
    monkeypatch.setenv("KIBIDANGO_THREADS", "2")
    assert counts(Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar")) == (2, 2)
    monkeypatch.delenv("KIBIDANGO_THREADS")
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert thread_counts() == (half, half)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        thread_counts(0)
    # batches apart, asked or from $KIBIDANGO_THREADS_BATCH (a machine idle but for the decoding)
    assert thread_counts(1, 2) == (1, 2)
    monkeypatch.setenv("KIBIDANGO_THREADS_BATCH", "2")
    assert counts(Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar", threads=1)) == (1, 2)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        thread_counts(1, 0)


def test_each_benchmarked_mode_decodes_at_its_own_thread_counts(gguf_bundle, monkeypatch):
    """``kibidango bench --modes ar+t2,sd+t1+tb2``: ar at its best count beside sd with one step thread
    and two batch threads, in one run — the context's counts are set before each mode decodes."""
    import llama_cpp

    from kibidango.backends.llamacpp_backend import LlamaCppModel
    from kibidango.tools.bench import run_bench

    seen: list[tuple[str, int, int]] = []
    real = LlamaCppModel.set_threads

    def spy(self, threads, threads_batch):
        real(self, threads, threads_batch)
        ctx = self.llm._ctx.ctx
        seen.append((self.name, llama_cpp.llama_n_threads(ctx), llama_cpp.llama_n_threads_batch(ctx)))

    monkeypatch.setattr(LlamaCppModel, "set_threads", spy)
    modes = ["ar", "ar+t2", "sd+t1+tb2"]
    result = run_bench(
        gguf_bundle, ["Once upon a time"], modes, max_new_tokens=6, peers=(), backend="llamacpp", threads=1
    )
    assert [r["mode"] for r in result.rows] == modes and all(r["tokens"] == 6 for r in result.rows)
    counts = {(n, t, tb) for n, t, tb in seen if n == "target"}
    assert counts == {("target", 1, 1), ("target", 2, 2), ("target", 1, 2)}  # the models' own, ar+t2, sd+t1+tb2
    with pytest.raises(ValueError, match="at least 1 thread"):
        run_bench(gguf_bundle, ["A"], ["ar+t0"], max_new_tokens=2, peers=(), backend="llamacpp")
    with pytest.raises(ValueError, match="tb<n> .* is llama.cpp's"):
        run_bench(gguf_bundle, ["A"], ["ar+tb2"], max_new_tokens=2, peers=(), backend="torch")


def test_bench_decodes_ar_over_other_ggufs_of_the_target_in_the_same_rounds(gguf_bundle, tmp_path):
    """``kibidango bench --ar-gguf <F16 GGUF>`` on an F32 bundle: the target's other weight type
    decodes ar in every round beside the modes, with its ratio to ar and each mode's best against it;
    a GGUF of another vocabulary, a missing file, the torch backend or no ar among the modes are refused."""
    from kibidango.tools.bench import format_table, run_bench

    f16 = convert_hf_to_gguf(gguf_bundle / "tiers" / "target" / "hf", tmp_path / "target-f16.gguf", "f16")
    result = run_bench(
        gguf_bundle,
        PROMPTS[:2],
        ["ar", "sd"],
        max_new_tokens=6,
        repeats=2,
        peers=(),
        backend="llamacpp",
        threads=1,
        ar_ggufs=(f16,),
    )
    row = result.rows[-1]
    assert row["mode"] == "ar on target-f16.gguf" and row["tokens"] == 2 * 2 * 6
    lo, hi = row["speed_interval"]
    assert 0 < lo <= row["speed_vs_ar"] <= hi and "tokens/s" in row["note"]
    assert any(n.startswith("best mode (sd) / ar on target-f16.gguf: ") for n in result.notes)
    assert "ar on target-f16.gguf" in format_table(result)
    with pytest.raises(FileNotFoundError, match="--ar-gguf .*missing.gguf: no such file"):
        run_bench(
            gguf_bundle,
            ["A"],
            ["ar"],
            max_new_tokens=2,
            peers=(),
            backend="llamacpp",
            ar_ggufs=(tmp_path / "missing.gguf",),
        )
    with pytest.raises(ValueError, match="--ar-gguf is llama.cpp's"):
        run_bench(gguf_bundle, ["A"], ["ar"], max_new_tokens=2, peers=(), backend="torch", ar_ggufs=(f16,))
    with pytest.raises(ValueError, match="put ar among --modes"):
        run_bench(gguf_bundle, ["A"], ["sd"], max_new_tokens=2, peers=(), backend="llamacpp", ar_ggufs=(f16,))
    other = smollm2_gguf()
    if other is not None:  # SmolLM2's 49,152-token vocabulary
        with pytest.raises(ValueError, match="not another GGUF of the same model"):
            run_bench(
                gguf_bundle, ["A"], ["ar"], max_new_tokens=2, peers=(), backend="llamacpp", threads=1, ar_ggufs=(other,)
            )


@pytest.fixture(scope="module")
def head32_bundle(tmp_path_factory):
    """A random 2-layer Llama with 32-wide attention heads (stories260K's are 8 wide, narrower than
    a quantized cache block) and stories260K's tokenizer, as an F32 GGUF bundle."""
    pytest.importorskip("llama_cpp", reason="needs the runtime's llamacpp extra (llama-cpp-python)")
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kibidango import write_bundle

    root = tmp_path_factory.mktemp("head32")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = root / "hf"
    LlamaForCausalLM(config).save_pretrained(hf)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy2(STORIES / name, hf / name)
    gguf = convert_hf_to_gguf(hf, root / "target.gguf", "f32")
    return write_bundle(root / "bundle", {"target": {"hf": hf, "gguf": gguf}}, {"mode": "ar"}, preset="head32")


def test_the_kv_cache_option_changes_the_cache_type(head32_bundle, gguf_bundle, tmp_path):
    """1H: ``kv_cache`` sets llama.cpp's K and V cache types (and flash attention, which a
    quantized V cache needs); a bundle's ``kv_cache`` runtime default is what a plain load uses;
    a model whose heads are too narrow for a quantized block, or the torch backend, refuse it
    with a clear error rather than ignore it."""
    from pathlib import Path

    import llama_cpp

    from kibidango import Pipeline, write_bundle

    def cache(pipe):
        p = pipe.models["target"].llm.context_params
        return p.type_k, p.type_v

    assert cache(Pipeline.from_bundle(head32_bundle, backend="llamacpp")) == (llama_cpp.GGML_TYPE_F16,) * 2
    q8 = Pipeline.from_bundle(head32_bundle, backend="llamacpp", kv_cache="q8_0")
    assert cache(q8) == (llama_cpp.GGML_TYPE_Q8_0,) * 2
    assert len(q8.generate("Once upon a time", max_new_tokens=16).token_ids) == 16  # it decodes

    tiers = Path(head32_bundle) / "tiers" / "target"
    gguf = next((tiers / "gguf").glob("*.gguf"))
    q4 = write_bundle(
        tmp_path / "q4", {"target": {"hf": tiers / "hf", "gguf": gguf}}, {"mode": "ar", "kv_cache": "q4_0"}
    )
    assert cache(Pipeline.from_bundle(q4, backend="llamacpp")) == (llama_cpp.GGML_TYPE_Q4_0,) * 2
    assert cache(Pipeline.from_bundle(q4, backend="llamacpp", kv_cache="f16"))[0] == llama_cpp.GGML_TYPE_F16

    with pytest.raises(ValueError, match="multiple of 32"):  # stories260K's heads are 8 wide
        Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar", kv_cache="q8_0")
    with pytest.raises(ValueError, match="llama.cpp option"):
        Pipeline.from_bundle(gguf_bundle, backend="torch", mode="ar", kv_cache="q8_0")
    with pytest.raises(ValueError, match="kv_cache 'q2'"):
        Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar", kv_cache="q2")


def test_the_kv_cache_is_chosen_by_measurement_and_shipped_per_backend(head32_bundle, gguf_bundle, tmp_path):
    """1F's K/V cache choice (plan row 1H): every type decodes the same prompts beside the bundle's
    own; the one with the fewest bytes per token within the perplexity and speed bounds is chosen
    (none within them: the bundle's own); written as llama.cpp's ``kv_cache`` in tuned_defaults it is
    what a plain llama.cpp load uses, while torch stays f16."""
    from kibidango import Pipeline, load_bundle
    from kibidango.tools.tune import format_kv_cache, tune_kv_cache, write_tuned
    from stages.tune_decoding import Config, _card, _kv_cache

    reference = Pipeline.from_bundle(head32_bundle, backend="llamacpp")
    types = ["f16", "q8_0", "q4_0"]
    prompts = [reference.encode("Once upon a time"), reference.encode("The little dog")]
    loose = tune_kv_cache(
        reference, head32_bundle, types, prompts, {"mode": "ar"}, 12, max_ppl_increase=10.0, max_slowdown=0.99
    )
    # 2 layers x (K + V) x 2 KV heads x 32 wide, at 2 bytes (f16) and ggml's 34 / 18 bytes per 32 values
    assert [(r["kv_cache"], r["bytes_per_token"]) for r in loose.rows] == [("f16", 512), ("q8_0", 272), ("q4_0", 144)]
    assert loose.rows[0]["context_mb"] == pytest.approx(512 * 256 / 1e6)
    assert loose.reference == "f16" and loose.chosen == "q4_0"
    assert all(r["admissible"] and r["speed_vs_reference"] > 0 for r in loose.rows)
    assert "q4_0 (chosen)" in format_kv_cache(loose)
    strict = tune_kv_cache(
        reference, head32_bundle, types, prompts, {"mode": "ar"}, 12, max_ppl_increase=-1.0, max_slowdown=0.99
    )
    assert strict.chosen == "f16"  # nothing else keeps the bound: the bundle's own cache stays
    assert not any(r["admissible"] for r in strict.rows[1:])
    # held-out texts are scored beside the reference's own sequences (a one-token text has nothing to score)
    text = reference.encode("The cat sat on the mat and looked at the little dog in the garden all day long")
    texts = tune_kv_cache(
        reference, head32_bundle, ["q4_0"], prompts, {"mode": "ar"}, 12, max_slowdown=0.99, texts=[text, text[:1]]
    )
    assert texts.rows[1]["ppl_increase"] != pytest.approx(loose.rows[2]["ppl_increase"], abs=1e-9)

    # the stage's own step: the recipe's types, the reference left out, the chosen one in the card
    cfg = Config(kv_caches=["f16", "q8_0"], kv_max_slowdown=0.99, max_ppl_increase=10.0, max_new_tokens=8)
    staged = _kv_cache(cfg, head32_bundle, reference, prompts, [text], {"mode": "ar"})
    assert [r["kv_cache"] for r in staged.rows] == ["f16", "q8_0"] and staged.chosen == "q8_0"
    assert "**q8_0**" in _card({}, {}, len(prompts), cfg, staged)
    assert _kv_cache(Config(kv_caches=[]), head32_bundle, reference, prompts, [], {"mode": "ar"}) is None
    # stories260K's 8-wide heads: llama.cpp makes no quantized cache; the type is refused, not measured
    narrow = Pipeline.from_bundle(gguf_bundle, backend="llamacpp", mode="ar")
    kept = _kv_cache(Config(kv_caches=["q8_0"]), gguf_bundle, narrow, [narrow.encode("Once")], [], {"mode": "ar"})
    assert kept.chosen == "f16" and [r["kv_cache"] for r in kept.rows] == ["f16"]
    assert "multiple of 32" in kept.refused["q8_0"] and "refused by llama.cpp" in format_kv_cache(kept)

    tuned = write_tuned(head32_bundle, tmp_path / "tuned", "llamacpp", {"mode": "ar", "kv_cache": "q8_0"}, {})
    bundle = load_bundle(tuned)
    assert (bundle.kv_cache("llamacpp"), bundle.kv_cache("torch")) == ("q8_0", "f16")
    assert Pipeline.from_bundle(tuned, backend="llamacpp").models["target"].kv_cache == "q8_0"
    assert Pipeline.from_bundle(tuned, backend="llamacpp", kv_cache="f16").models["target"].kv_cache == "f16"
    assert Pipeline.from_bundle(tuned, backend="torch").config().mode == "ar"  # torch reads no cache type


def test_kibidango_tune_tries_a_kv_cache_and_writes_the_chosen_one(head32_bundle, tmp_path, capsys):
    """``kibidango tune --try-kv-cache``: after the mode search, the type is timed in the chosen mode
    and, within the bounds, written with it as llama.cpp's ``kv_cache``."""
    import json
    from pathlib import Path

    from kibidango import load_bundle, write_bundle
    from kibidango.cli import main

    target = Path(head32_bundle) / "tiers" / "target"
    forms = {"hf": target / "hf", "gguf": next((target / "gguf").glob("*.gguf"))}
    three = write_bundle(tmp_path / "three", {t: forms for t in ("draft", "qualifier", "target")}, {"mode": "ar"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe little dog\n")
    argv = ["tune", "--bundle", str(three), "--prompts", str(prompts), "--backend", "llamacpp"]
    argv += ["--max-new-tokens", "6", "--max-ppl-increase", "10", "--try-kv-cache", "q8_0"]
    assert main([*argv, "--write", str(tmp_path / "tuned")]) == 0
    assert "q8_0 (chosen)" in capsys.readouterr().out
    written = json.loads((tmp_path / "tuned" / "bundle.json").read_text())["tuned_defaults"]["llamacpp"]
    assert written["kv_cache"] == "q8_0" and load_bundle(tmp_path / "tuned").kv_cache("llamacpp") == "q8_0"
    with pytest.raises(SystemExit, match="llama.cpp option"):
        main(
            ["tune", "--bundle", str(three), "--prompts", str(prompts), "--backend", "torch", "--try-kv-cache", "q8_0"]
        )


def test_selection_prompts_are_held_out_openings_the_bench_does_not_use():
    """Settings are chosen on the held-out story openings that the bench family's prompts.txt leaves
    out: none of them is a benchmark prompt, and the split is the family's own."""
    family = SHARED / "models" / "bench-family"
    if not (family / "train_family.py").is_file():
        pytest.skip(f"needs the bench family at {family}")
    from eval.bench_family import selection_prompts

    chosen = selection_prompts()
    bench = (family / "prompts.txt").read_text(encoding="utf-8").splitlines()
    assert len(chosen) == 22 and not set(chosen) & set(bench)
    assert all(len(p.split()) <= 8 for p in chosen) and len(set(chosen)) == len(chosen)


def test_the_bench_familys_ngram_table_counts_training_openings_only():
    """The bench bundle's n-gram table continues training-story openings: none is a benchmark or a
    selection prompt (nor any held-out story's opening), so the bench judges it on unseen text."""
    family = SHARED / "models" / "bench-family"
    if not (family / "target" / "model.safetensors").is_file():
        pytest.skip(f"needs the bench family at {family}")
    from eval.bench_family import ngram_table, selection_prompts, training_openings

    openings = training_openings()
    bench = (family / "prompts.txt").read_text(encoding="utf-8").splitlines()
    assert len(openings) > 600 and not set(openings) & (set(bench) | set(selection_prompts()))
    table = ngram_table(family, prompts=2, batch=2)
    assert table.vocab_size == 512 and len(table) > 50  # 2 continuations of 64 tokens, counted
