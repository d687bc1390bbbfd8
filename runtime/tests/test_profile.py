"""Bundle profiles (:func:`kibidango.bundle.with_profile`): the default profile ships what the
decoding defaults use on its backends and nothing else, says what it left out, and the runtime
refuses a mode or backend whose parts it lacks, naming the profile; ``full`` keeps everything."""

from __future__ import annotations

import hashlib
import json

import pytest

from kibidango import BundleError, Pipeline, load_bundle, write_bundle
from kibidango.bundle import resolve_backend, with_meta, with_profile
from kibidango.cli import main as cli
from tests.conftest import SHARED, STORIES, needs_stories

GGUF = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"


def _adapter(tmp, domain: str, forms: tuple[str, ...]) -> dict:
    """An adapter directory (files stand in for the weights: the test never applies them)."""
    root = tmp / "adapters" / domain
    formats = {}
    for form in forms:
        path = root / ("adapter/adapter_model.safetensors" if form == "peft" else "adapter.gguf")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{domain} {form}".encode())
        rel = path.relative_to(root).as_posix()
        formats[form] = [
            {"path": rel, "size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        ]
    (root / "adapter.json").write_text(
        json.dumps({"schema": 1, "domain": domain, "base_tier": "target", "formats": formats})
    )
    return {"domain": domain, "path": f"adapters/{domain}", "formats": sorted(forms)}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """stories260K as all three tiers in both weight forms, a math adapter in both forms and a code
    adapter with a peft form only; runtime default pyramid, tuned: lookup on llama.cpp, sd on torch."""
    needs_stories()
    if not GGUF.is_file():
        pytest.skip(f"needs {GGUF} (absent on this machine)")
    root = tmp_path_factory.mktemp("profile")
    tiers = {
        t: {"hf": STORIES, "gguf": GGUF, "vocab_size": 512, "quantization": {"hf": "f32", "gguf": "f32"}}
        for t in ("draft", "qualifier", "target")
    }

    def extras(tmp):
        return {
            "adapters": [_adapter(tmp, "math", ("peft", "gguf")), _adapter(tmp, "code", ("peft",))],
            "default_adapter": "code",
        }

    built = write_bundle(root / "built", tiers, {"mode": "pyramid", "stop_ids": [2]}, preset="test", finalize=extras)
    return with_meta(built, root / "full", tuned_defaults={"llamacpp": {"mode": "lookup"}, "torch": {"mode": "sd"}})


def _paths(bundle) -> set[str]:
    return {f.path for f in load_bundle(bundle).manifest.files}


def test_default_profile_for_llamacpp_ships_the_target_gguf_and_what_it_uses(full, tmp_path):
    slim = with_profile(full, tmp_path / "slim", "default", ("llamacpp",))
    bundle = load_bundle(slim)  # every kept file hashed and listed
    paths = _paths(slim)
    assert set(bundle.tiers) == {"target"}
    assert "tiers/target/gguf/stories260K.gguf" in paths
    assert "tiers/target/hf/tokenizer.model" in paths and "tiers/target/hf/model.safetensors" not in paths
    assert not any(p.startswith(("tiers/draft/", "tiers/qualifier/", "adapters/code/")) for p in paths)
    assert "adapters/math/adapter.gguf" in paths and "adapters/math/adapter/adapter_model.safetensors" not in paths
    assert json.loads((slim / "adapters/math/adapter.json").read_text())["formats"].keys() == {"gguf"}
    meta = bundle.manifest
    assert (meta.profile.name, meta.profile.backends) == ("default", ["llamacpp"])
    assert [a.domain for a in meta.adapters] == ["math"] and meta.default_adapter is None  # code had no gguf form
    assert set(meta.tuned_defaults) == {"llamacpp"} and meta.tiers["target"].quantization == {"gguf": "f32"}
    left = "; ".join(meta.profile.left_out)
    for what in ("draft tier", "qualifier tier", "transformers weights", "code adapter", "math adapter's peft form"):
        assert what in left
    assert sum(f.size for f in meta.files) < sum(f.size for f in load_bundle(full).manifest.files)
    assert resolve_backend(bundle, "auto") == "llamacpp"

    pipe = Pipeline.from_bundle(slim, adapter="none", threads=1)  # auto: the profile's backend, its tuned mode
    assert (pipe.backend, pipe.defaults.mode) == ("llamacpp", "lookup")
    assert pipe.generate("Once upon a time", max_new_tokens=8).text
    with pytest.raises(BundleError, match="no 'draft' tier.*'default' profile for llamacpp.*draft tier"):
        Pipeline.from_bundle(slim, backend="llamacpp", mode="sd", adapter="none", threads=1)
    with pytest.raises(BundleError, match="no HF weights.*'default' profile.*full"):
        Pipeline.from_bundle(slim, backend="torch", mode="ar", adapter="none")


def test_default_profile_for_torch_keeps_the_draft_its_sd_needs(full, tmp_path):
    slim = with_profile(full, tmp_path / "slim", "default", ("torch",))
    bundle = load_bundle(slim)
    assert set(bundle.tiers) == {"draft", "target"}  # torch's tuned mode is sd
    assert not any(p.endswith(".gguf") for p in _paths(slim))
    assert bundle.manifest.default_adapter == "code"  # it has the peft form torch applies
    pipe = Pipeline.from_bundle(slim, adapter="none")
    assert (pipe.backend, pipe.defaults.mode) == ("torch", "sd")
    assert pipe.generate("Once upon a time", max_new_tokens=8).text
    with pytest.raises(BundleError, match=r"no 'qualifier' tier.*the qualifier tier \(sd on torch does not run it\)"):
        Pipeline.from_bundle(slim, mode="pyramid", adapter="none")


def test_full_profile_keeps_every_file_and_the_cli_writes_either(full, tmp_path, capsys):
    whole = with_profile(full, tmp_path / "whole", "full", ("llamacpp", "torch"))
    assert _paths(whole) == _paths(full) and load_bundle(whole).manifest.profile.name == "full"
    assert cli(["profile", "--bundle", str(full), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "default profile for llamacpp" in out and "left out: the draft tier" in out
    assert cli(["inspect", str(tmp_path / "cli")]) == 0
    assert "profile: default (backends: llamacpp)" in capsys.readouterr().out
    with pytest.raises(BundleError, match="profile backends"):
        with_profile(full, tmp_path / "bad", "default", ("vllm",))
