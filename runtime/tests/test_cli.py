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
