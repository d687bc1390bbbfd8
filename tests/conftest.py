from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from eval.shared_data import SHARED, shared_available

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A private KIBIDANGO_HOME (store + MLflow sqlite) for one test."""
    home = tmp_path / "ws"
    monkeypatch.setenv("KIBIDANGO_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


def noisy_copy(src: Path, dest: Path, rel: float, seed: int = 0) -> Path:
    """A copy of the transformers checkpoint ``src`` (tokenizer files included) whose every weight
    has Gaussian noise of ``rel`` times that tensor's spread added."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dest)
    model = AutoModelForCausalLM.from_pretrained(str(src))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rel * p.std() * torch.randn_like(p))
    model.save_pretrained(str(dest))
    return dest


def needs_shared() -> None:
    if not shared_available():
        pytest.skip(f"needs the shared data at {SHARED}/data (absent on this machine)")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cli_env(home: Path) -> dict[str, str]:
    """Environment for running `python -m flows` in a subprocess against workspace ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(KIBIDANGO_HOME=str(home), PYTHONUNBUFFERED="1")
    return env


def start_flow(preset: Path, home: Path):
    """``python -m flows run --preset PRESET`` in a new session (so a test can kill it, or its whole
    group), as a user starts it."""
    import subprocess

    return subprocess.Popen(
        [sys.executable, "-m", "flows", "run", "--preset", str(preset)],
        cwd=REPO,
        env=cli_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


OPENAI_KEY_ENV = "KIBIDANGO_TEST_JUDGE_KEY"
"""The environment variable the loopback OpenAI-compatible server's key is read from in tests."""


@pytest.fixture(scope="session")
def openai_server():
    """A real OpenAI-compatible server on 127.0.0.1: llama-cpp-python's, serving the family's
    draft tier as a GGUF (stories260K) under the model name ``stories260K``, with an API key.
    Yields ``(base_url, key)``; stopped at the end of the session. Skips when llama-cpp-python's
    server extra or the GGUF is absent."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (make setup)")
    from methods.serving import llama_cpp_server

    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip(f"needs {gguf} (absent on this machine)")
    key = "kbd-test-" + os.urandom(8).hex()
    with llama_cpp_server({"stories260K": gguf}, api_key=key) as base:
        yield base, key
