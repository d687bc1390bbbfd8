"""Bundles: hashes verified before use, clear errors for tampering, missing tiers, mismatched
tokenizers and over-long prompts; exactness on the real stories260K."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kibidango import BundleError, Pipeline, load_bundle, write_bundle
from kibidango.backends.base import ContextLengthError
from tests.conftest import STORIES, needs_stories


@pytest.fixture(scope="module")
def stories_family(tmp_path_factory):
    """stories260K as draft and qualifier; the target is stories260K with 3% weight noise, so
    the tiers really disagree while sharing the 512-token tokenizer."""
    needs_stories()
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("family")
    target_dir = root / "target"
    shutil.copytree(STORIES, target_dir)
    model = AutoModelForCausalLM.from_pretrained(str(STORIES))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * p.std() * torch.randn_like(p))
    model.save_pretrained(str(target_dir))
    tiers = {
        "draft": {"hf": STORIES, "vocab_size": 512},
        "qualifier": {"hf": STORIES, "vocab_size": 512},
        "target": {"hf": target_dir, "vocab_size": 512},
    }
    return write_bundle(
        root / "bundle", tiers, {"mode": "pyramid", "variant": "fuzzy", "stop_ids": [1, 2]}, preset="test"
    )


PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park",
    "The cat was sad because",
    "One day, a big dog",
    "Tom had a red ball.",
]


def test_stories260k_greedy_modes_agree_token_for_token(stories_family):
    ar = Pipeline.from_bundle(stories_family, mode="ar")
    sd = Pipeline.from_bundle(stories_family, mode="sd", k=4)
    pyr = Pipeline.from_bundle(stories_family, mode="pyramid", variant="exact", l_D=2, l_Q=6)
    accepted = drafted = 0
    for prompt in PROMPTS:
        ref = ar.generate(prompt, max_new_tokens=48)
        assert ref.text and ref.token_ids
        s = sd.generate(prompt, max_new_tokens=48)
        assert s.token_ids == ref.token_ids
        assert pyr.generate(prompt, max_new_tokens=48).token_ids == ref.token_ids
        drafted += s.metrics.num_draft_tokens["draft"]
        accepted += s.metrics.num_accepted_tokens["draft"]
    assert 0 < accepted < drafted  # the tiers disagree sometimes: the comparison means something


def test_streaming_yields_the_same_text(stories_family):
    p = Pipeline.from_bundle(stories_family, mode="sd")
    chunks = list(p.stream("Once upon a time", max_new_tokens=30))
    assert len(chunks) > 1 and "".join(chunks) == p.generate("Once upon a time", max_new_tokens=30).text
    stopped = p.generate("Once upon a time", max_new_tokens=60, stop=["Lily"])
    assert "Lily" not in stopped.text and stopped.metrics.finish_reason == "stop"


def test_tampered_or_truncated_file_is_refused_by_name(stories_family, tmp_path):
    copy = shutil.copytree(stories_family, tmp_path / "b")
    weights = copy / "tiers" / "target" / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"file tiers/target/hf/model\.safetensors does not match its sha256"):
        load_bundle(copy)
    weights.write_bytes(bytes(data[:-10]))
    with pytest.raises(BundleError, match=r"tiers/target/hf/model\.safetensors has \d+ bytes, bundle.json says"):
        load_bundle(copy)
    weights.unlink()
    with pytest.raises(BundleError, match=r"file tiers/target/hf/model\.safetensors is missing"):
        Pipeline.from_bundle(copy)


def test_missing_tier_and_mismatched_tokenizer(stories_family, tmp_path):
    only_target = write_bundle(tmp_path / "t", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"})
    assert Pipeline.from_bundle(only_target).generate("Once", max_new_tokens=3).text
    with pytest.raises(BundleError, match="bundle has no 'draft' tier"):
        Pipeline.from_bundle(only_target, mode="sd")
    other_tok = shutil.copytree(STORIES, tmp_path / "other")
    config = json.loads((other_tok / "tokenizer_config.json").read_text())
    (other_tok / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    mixed = write_bundle(tmp_path / "m", {"draft": {"hf": other_tok}, "target": {"hf": STORIES}})
    with pytest.raises(BundleError, match="tiers do not share one tokenizer"):
        load_bundle(mixed)
    with pytest.raises(BundleError, match="no tiers"):
        load_bundle(write_bundle(tmp_path / "e", {}))
    with pytest.raises(BundleError, match="not a bundle"):
        load_bundle(tmp_path)


def test_prompt_longer_than_the_context_is_a_clear_error(stories_family):
    p = Pipeline.from_bundle(stories_family, mode="sd")
    with pytest.raises(ContextLengthError, match=r"the prompt has \d+ tokens; the context holds 512"):
        p.generate("Once upon a time " * 200, max_new_tokens=5)
    near = p.generate("Once upon a time " * 100, max_new_tokens=400)  # clamped to the context
    assert near.metrics.prompt_tokens + near.metrics.generated_tokens <= 512


@pytest.mark.parametrize(
    ("defaults", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"k": 2.5}, "k"),
        ({"top_p": float("nan")}, "top_p"),
        ({"stop_ids": ["x"]}, "stop_ids"),
    ],
)
def test_bad_runtime_defaults_name_the_file_and_the_field(tmp_path, defaults, field):
    from kibidango import Pipeline

    needs_stories()
    bundle = write_bundle(tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", **defaults})
    with pytest.raises(BundleError, match=rf"bundle\.json: runtime_defaults: {field}: .* not"):
        Pipeline.from_bundle(bundle)


@pytest.mark.parametrize(
    ("defaults", "tuned", "message"),
    [
        (
            {"tmperature": 0.5},
            {},
            r"bundle\.json: runtime_defaults: 'tmperature' is not a decoding setting \(did you mean 'temperature'\?\)",
        ),
        (
            {},
            {"torch": {"lookup_kk": 3}},
            r"bundle\.json: tuned_defaults\.torch: 'lookup_kk' is not a decoding setting \(did you mean 'lookup_k'\?\)",
        ),
        ({"kv_cache": "q2"}, {}, r"runtime_defaults: kv_cache 'q2': use one of f16, q8_0, q4_0"),
    ],
)
def test_a_misspelt_runtime_default_is_refused_not_dropped(tmp_path, defaults, tuned, message):
    """A bundle's decoding settings are read by one reader (DecodeConfig.from_mapping): a key that is
    no setting was once dropped without a word; now it fails naming the file, the field and the
    setting it is nearest to."""
    from kibidango import Pipeline
    from kibidango.decode.speculative import DecodeConfig

    needs_stories()
    extra = {"tuned_defaults": tuned} if tuned else {}
    bundle = write_bundle(
        tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", **defaults}, **extra
    )
    with pytest.raises(BundleError, match=message):
        Pipeline.from_bundle(bundle)
    cfg = DecodeConfig.from_mapping({"k": 6, "stop_ids": [2], "kv_cache": "q8_0"}, "x", DecodeConfig(mode="sd", k=3))
    assert (cfg.mode, cfg.k, cfg.stop_ids) == ("sd", 6, (2,))
