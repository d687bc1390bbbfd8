"""A real OpenAI-compatible server on 127.0.0.1: llama-cpp-python's, serving local GGUF files.

Local teacher tiers (stage 1D's tiny preset) and the tests of everything that talks to an
OpenAI-compatible API use it: the code under test speaks HTTP to a real server, never to a mock of
the client. ``llama_cpp_server({"alias": gguf_path, ...})`` is a context manager yielding the base
URL (``http://127.0.0.1:PORT/v1``); each GGUF is served under its alias as the ``model`` name (a
dict value adds llama-cpp-python's per-model settings: ``{"model": path, "chat_format": "alpaca"}``). The
server's settings (with the API key, when one is asked for) are written to a private temporary file
(mode 0600) removed when the server stops, so the key is never on a command line.

``redis_server()`` starts a real ``redis-server`` on 127.0.0.1 (no persistence, in a temporary
directory) for stage 0's distributed dedup and its tests; it yields the ``redis://`` URL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.contract import KibidangoError

__all__ = ["chat_settings", "free_port", "llama_cpp_server", "redis_server", "stop_process", "wait_ready"]


def chat_settings(form: str, model: Path, config: Path) -> dict:
    """llama-cpp-python's model settings that serve ``model`` in the chat format ``form``:

    - ``family``: the family's own training format (:data:`methods.training.chat.SERVING_TEMPLATE`,
      through llama-cpp-python's ``hf-tokenizer-config`` handler, with the model's BOS and EOS; the
      handler's config is written to ``config``); ``model`` is the family's HF directory;
    - ``gguf``: the chat template inside the GGUF file (llama-cpp-python reads it when given no
      format: an instruct model's own, e.g. SmolLM2's ChatML);
    - any other: one of llama-cpp-python's named formats (``alpaca``, ...)."""
    if form == "gguf":
        if Path(model).is_dir():
            raise KibidangoError(f"chat_format gguf needs a GGUF file, not the directory {model}")
        return {}
    if form != "family":
        return {"chat_format": form}
    from transformers import AutoTokenizer

    from methods.training.chat import SERVING_TEMPLATE

    if not Path(model).is_dir():
        raise KibidangoError(f"the family chat format needs the model's HF directory, not {model}")
    tok = AutoTokenizer.from_pretrained(str(model))
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        json.dumps({"chat_template": SERVING_TEMPLATE, "bos_token": tok.bos_token, "eos_token": tok.eos_token})
    )
    return {"chat_format": "hf-tokenizer-config", "hf_tokenizer_config_path": str(config)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_cpp_server(
    models: dict[str, Path | str | dict],
    api_key: str | None = None,
    n_ctx: int = 512,
    start_timeout_s: float = 120.0,
    log_path: Path | None = None,
) -> Iterator[str]:
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        raise KibidangoError(
            f"llama-cpp-python's server cannot be imported ({e}); install the runtime's llamacpp extra "
            "and sse-starlette, starlette-context (make setup)"
        ) from None
    served = []
    for alias, spec in models.items():
        spec = dict(spec) if isinstance(spec, dict) else {"model": str(spec)}
        if not Path(spec["model"]).is_file():
            raise KibidangoError(f"model {alias!r}: GGUF file not found: {spec['model']}")
        served.append({"n_ctx": n_ctx, "verbose": False, **spec, "model": str(spec["model"]), "model_alias": alias})
    port = free_port()
    settings = {"host": "127.0.0.1", "port": port, "models": served}
    if api_key:
        settings["api_key"] = api_key
    with tempfile.TemporaryDirectory(prefix="kbd-llama-server-") as tmp:
        config = Path(tmp) / "server.json"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(settings, f)
        log = open(log_path or os.devnull, "ab")  # noqa: SIM115 - the server's lifetime
        proc = subprocess.Popen(
            [sys.executable, "-m", "methods.llama_server_main", "--config_file", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}/v1"
        try:
            _wait_ready(base, api_key, proc, start_timeout_s)
            yield base
        finally:
            stop_process(proc)
            log.close()


def _wait_ready(base: str, api_key: str | None, proc: subprocess.Popen, timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    wait_ready(base + "/models", proc, timeout_s, "llama-cpp-python's server", headers)


def wait_ready(
    url: str, proc: subprocess.Popen, timeout_s: float, what: str, headers: dict[str, str] | None = None
) -> None:
    """Poll ``url`` until it answers (any 2xx) while the server process ``proc`` starts; a
    :class:`KibidangoError` naming ``what`` when the process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2).read()
            return
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None:
                raise KibidangoError(f"{what} exited with code {proc.returncode} while starting") from None
            if time.monotonic() > deadline:
                base = url.rsplit("/", 1)[0]
                raise KibidangoError(f"{what} did not answer on {base} within {timeout_s:.0f}s") from None
            time.sleep(0.3)


@contextmanager
def redis_server(start_timeout_s: float = 30.0) -> Iterator[str]:
    """A ``redis-server`` on a free loopback port, no snapshots, stopped (and its directory
    removed) on exit; yields ``redis://127.0.0.1:PORT/0``."""
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        raise KibidangoError("redis-server is not on PATH (make setup installs it: apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kibidango-redis-") as tmp:
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                        sock.sendall(b"PING\r\n")
                        if sock.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace")[-500:] if proc.poll() is not None else ""
                    raise KibidangoError(f"redis-server did not start on 127.0.0.1:{port}: {err or 'timed out'}")
                time.sleep(0.1)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
