"""The `kibidango` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from kibidango import write_bundle
from tests.conftest import STORIES, needs_stories


def _kb(*args, stdin: str | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kibidango", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_inspect_generate_and_tampering(tmp_path):
    needs_stories()
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "target")}
    bundle = write_bundle(tmp_path / "b", tiers, {"mode": "sd", "stop_ids": [1, 2]}, preset="cli")
    ok = _kb("inspect", str(bundle))
    assert ok.returncode == 0 and "every sha256 verified" in ok.stdout and "draft" in ok.stdout
    gen = _kb("generate", "--bundle", str(bundle), "--max-new-tokens", "12", "--stats", "-", stdin="Once upon a time\n")
    assert gen.returncode == 0 and gen.stdout.startswith(", there was a little girl")
    stats = json.loads(gen.stderr[gen.stderr.index("{") :])
    assert stats["mode"] == "sd" and stats["generated_tokens"] == 12
    streamed = _kb("generate", "--bundle", str(bundle), "--max-new-tokens", "12", "--stream", "Once upon a time")
    assert streamed.stdout == gen.stdout
    config = bundle / "tiers" / "draft" / "hf" / "config.json"
    config.write_text(config.read_text().replace("512", "513", 1))
    bad = _kb("inspect", str(bundle))
    assert bad.returncode == 2 and "tiers/draft/hf/config.json" in bad.stderr and "Traceback" not in bad.stderr
    refused = _kb("generate", "--bundle", str(bundle), "x")  # generate verifies hashes too
    assert refused.returncode == 2 and "tiers/draft/hf/config.json does not match its sha256" in refused.stderr


def test_generate_through_the_cascade(tmp_path):
    needs_stories()
    bundle = write_bundle(
        tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]}
    )
    state = tmp_path / "state"
    args = ("generate", "--bundle", str(bundle), "--max-new-tokens", "8", "--state-dir", str(state))
    local = _kb(*args, "--cascade", "local-only", "--stats", "Once upon a time")
    assert local.returncode == 0, local.stderr
    assert local.stdout == _kb(*args, "Once upon a time").stdout  # the local tier answered
    assert "(tier local, confidence -, cost $0.000000, budget left -) [uncalibrated]" in local.stderr
    assert json.loads(local.stderr[local.stderr.index('{\n  "tier"') :])["tier"] == "local"
    missing = _kb(*args, "--cascade", str(tmp_path / "nope.json"), "x")
    assert missing.returncode == 2 and "nope.json: cannot read the cascade config" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_bad_inputs_get_one_line_naming_the_file_never_a_traceback(tmp_path, capsys):
    """Each of these crashed the CLI with a traceback: a release verdict of the wrong shape, a
    cascade config that is a number, ``true``, 5,000 levels deep, binary, keyed by numbers, or
    whose cloud model is not a name; a tier whose weights are a pickle (never unpickled)."""
    import hashlib
    import pickle
    import shutil

    needs_stories()
    bundle = write_bundle(
        tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]}
    )

    released = tmp_path / "released"
    shutil.copytree(bundle, released)
    meta = json.loads((released / "bundle.json").read_text())
    meta["release"] = {"releasable": False, "gates": [], "failed": 5, "waived": []}
    raw = json.dumps(meta).encode()
    (released / "bundle.json").write_bytes(raw)
    (released / "bundle.json.sha256").write_text(hashlib.sha256(raw).hexdigest() + "  bundle.json\n")
    cases = [(("inspect", str(released)), "bundle.json: release.failed is not a list")]

    cloud = {
        "base_url": "http://127.0.0.1:9/v1",
        "api_key_env": "K",
        "usd_per_1k_prompt": 0,
        "usd_per_1k_completion": 0,
    }
    configs = {
        "cloud5.json": ('{"cloud": 5}', "cloud: Input should be a valid dictionary"),
        "cloudtrue.json": ('{"cloud": true}', "cloud: Input should be a valid dictionary"),
        "deep.json": ("[" * 5000 + "]" * 5000, "deep.json: nested too deeply"),
        "deep.yaml": ("a: " + "[" * 5000 + "]" * 5000, "deep.yaml: nested too deeply"),
        "keys.yaml": ("1: x\ndraft: {}\n", "keys.yaml: 1: Keys should be strings"),
        "model5.json": (json.dumps({"cloud": {**cloud, "model": 5}}), "cloud.model: Input should be a valid string"),
        "modellist.json": (
            json.dumps({"cloud": {**cloud, "model": ["a"]}}),
            "cloud.model: Input should be a valid string",
        ),
    }
    for name, (text, message) in configs.items():
        (tmp_path / name).write_text(text)
        cases.append((("generate", "hi", "--bundle", str(bundle), "--cascade", str(tmp_path / name)), message))
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00binary")
    cases.append(
        (
            ("generate", "hi", "--bundle", str(bundle), "--cascade", str(tmp_path / "binary.json")),
            "binary.json: not UTF-8",
        )
    )

    class Evil:
        def __reduce__(self):
            return (print, ("UNPICKLED",))

    weights = tmp_path / "pickled"
    shutil.copytree(STORIES, weights)
    (weights / "model.safetensors").unlink()
    (weights / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
    pickled = write_bundle(tmp_path / "p", {"target": {"hf": weights, "vocab_size": 512}}, {"mode": "ar"})
    cases.append((("generate", "hi", "--bundle", str(pickled)), "weights could not be loaded"))

    from kibidango.cli import main

    for argv, message in cases:  # in this process: an exception would fail the test here
        state = ("--state-dir", str(tmp_path / "state")) if argv[0] == "generate" else ()
        code = main([*argv, *state])
        out, err = capsys.readouterr()
        assert code == 2 and message in err and err.startswith("error: "), (argv, err[-600:])
        assert "UNPICKLED" not in out + err
