"""A training stage killed with kill -9 mid-run publishes nothing, and the rerun resumes from the
last axolotl checkpoint (real axolotl, a 30K-parameter model, ~2 minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from core.paths import REPO_ROOT
from core.store import ArtifactStore
from eval.shared_data import SHARED
from tests.conftest import start_flow
from tests.test_flow import _cli

STORIES = SHARED / "models" / "stories260K" / "hf"
TEXT = SHARED / "data" / "tinystories_sample" / "tiny_stories.txt"


def _needs_axolotl_and_shared() -> None:
    python = Path(os.environ.get("KIBIDANGO_AXOLOTL_PYTHON", REPO_ROOT / ".venv-axolotl" / "bin" / "python"))
    if not python.is_file():
        pytest.skip(f"needs axolotl's environment ({python}; `make setup` builds it)")
    if not STORIES.is_dir() or not TEXT.is_file():
        pytest.skip(f"needs {STORIES} and {TEXT} (../shared)")


def _preset(tmp_path: Path) -> Path:
    stage0 = {
        "sources": [
            {
                "name": "stories",
                "path": str(TEXT),
                "format": "text",
                "text_split": "single_newline",
                "domain": "general",
                "license": "CDLA-Sharing-1.0",
                "limit": 400,
            }
        ],
        "language": {"keep": ["en"], "min_confidence": 0.0},
    }
    train = {
        "max_steps": 40,
        "micro_batch_size": 2,
        "sequence_len": 64,
        "learning_rate": 0.003,
        "warmup_steps": 2,
        "logging_steps": 1,
        "save_steps": 5,
    }
    arch = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    }
    stage_p = {
        "tokenizer": str(STORIES),
        "tiers": {"target": {"arch": arch, "train": train}},
        "eval_rows": 10,
        "eval_max_len": 64,
    }
    path = tmp_path / "preset.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "resumetest",
                "experiment": "kibidango-resumetest",
                "stages": {"0": {"config": stage0}, "P": {"needs": {"data": "0"}, "config": stage_p}},
            }
        )
    )
    return path


def test_kill_9_during_training_then_rerun_resumes_from_the_checkpoint(tmp_path):
    _needs_axolotl_and_shared()
    preset, home = _preset(tmp_path), tmp_path / "home"
    proc = start_flow(preset, home)
    deadline = time.monotonic() + 400
    checkpoint = None
    while time.monotonic() < deadline and proc.poll() is None:
        # a whole checkpoint: the Trainer writes trainer_state.json after everything else
        found = sorted((home / "store" / "P").glob(".work-*/target/out/checkpoint-*/trainer_state.json"))
        if found:
            checkpoint = found[-1].parent
            break
        time.sleep(0.2)
    assert checkpoint is not None, "no checkpoint appeared before the flow ended"
    os.kill(proc.pid, signal.SIGKILL)  # the flow only: axolotl must die with it (PR_SET_PDEATHSIG)
    proc.wait()
    for _ in range(60):  # its data-loader workers notice their parent's death within seconds
        leftover = subprocess.run(
            ["pgrep", "-f", f"axolotl.cli.train {home}"], capture_output=True, text=True
        ).stdout.split()
        if not leftover:
            break
        time.sleep(0.5)
    assert not leftover, f"axolotl outlived the killed flow: pids {leftover}"
    try:  # Prefect's temporary API server, started by the flow, is not ours to test: stop it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert not list(ArtifactStore(home / "store").artifacts("P")), "a half-trained model was published"

    # the kill may also land while the Trainer is saving: a later checkpoint with weights but no
    # trainer state yet (written last) must be dropped, not resumed from
    cut_off = checkpoint.parent / "checkpoint-1000"
    cut_off.mkdir()
    (cut_off / "model.safetensors").write_bytes(b"half-written")
    rerun = _cli(home, "run", "--preset", str(preset), timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "checkpoint-1000 was cut off while being saved" in rerun.stderr
    assert "P/target: resuming from checkpoint-" in rerun.stderr
    assert "resuming from checkpoint-1000" not in rerun.stderr
    (artifact,) = ArtifactStore(home / "store").artifacts("P")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert {"target/model.safetensors", "target/tokenizer.model", "axolotl/target.yaml", "family.json"} <= {
        f["path"] for f in manifest["files"]
    }
    assert manifest["metrics"]["target_val_perplexity"] < 512  # better than uniform over 512 tokens
    log = (artifact / "logs" / "target.log").read_text()
    assert "Resuming" in log or "resume" in log.lower()
    assert not list((home / "store" / "P").glob(".work-*")), "the work dir outlived the published artifact"
