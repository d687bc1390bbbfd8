"""Where a run keeps its state: ``$KIBIDANGO_HOME`` (default ``./.kibidango``) holds the artifact
store, the MLflow sqlite database and its artifacts, and Prefect's home."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from core import paths
from core.paths import tracking_uri
from core.remote import RemoteStore
from core.store import ArtifactStore

__all__ = ["home", "store", "tracking_uri", "configure_environment", "reap_orphan_prefect_servers"]


def home() -> Path:
    return paths.home()


def store() -> ArtifactStore:
    """The workspace's store, backed by the shared store at ``KIBIDANGO_STORE_URL`` when set."""
    return ArtifactStore(home() / "store", RemoteStore.from_env())


def default_artifact_location() -> str | None:
    """Artifact root for a new experiment: ``$KIBIDANGO_HOME/mlartifacts`` for any tracking URI
    that is not a server (a sqlite file, a database), where MLflow would otherwise write
    ``./mlruns`` in whatever directory the command runs from; a tracking server (http[s]) decides
    its own (``mlflow server --artifacts-destination``)."""
    uri = tracking_uri()
    return None if uri.startswith(("http://", "https://", "databricks")) else (home() / "mlartifacts").as_uri()


def configure_environment() -> None:
    """Defaults that must be in place before Prefect is imported."""
    home().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home() / "prefect"))
    # Stage modules log to `kibidango.*` with plain logging; Prefect forwards those to its UI.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "kibidango")
    # The ephemeral server's telemetry write races its own start-up on sqlite ("database is
    # locked"); nothing here needs it.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for its temporary server; on 2 busy cores a fresh workspace's start-up
    # (database migrations) took longer: 1 of 3 flow runs failed with "Timed out while
    # attempting to connect to ephemeral Prefect API server" right after a `make test` run.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # The runtime unpacks packed bundles (stage 2E) into this cache: keep it in the workspace.
    os.environ.setdefault("KIBIDANGO_CACHE", str(home() / "cache"))


def _environ(pid: int | str) -> dict[bytes, bytes]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def reap_orphan_prefect_servers() -> list[int]:
    """Stop Prefect's temporary servers of this workspace that outlived their flow: a flow killed
    with ``kill -9`` leaves its server running (about 230 MB and a port). A server is this
    workspace's when its environment has our PREFECT_HOME and Prefect's ephemeral flag, and an
    orphan when its parent process is not one of ours (init or a subreaper adopted it). Linux
    (/proc); elsewhere it does nothing. Returns the pids stopped."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    ours = os.environ.get("PREFECT_HOME", str(home() / "prefect")).encode()
    stopped = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if b"prefect.server.api.server:create_app" not in (entry / "cmdline").read_bytes():
                continue
            env = _environ(entry.name)
            if env.get(b"PREFECT__SERVER_EPHEMERAL") != b"1" or env.get(b"PREFECT_HOME") != ours:
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid > 1 and _parent_env(ppid).get(b"PREFECT_HOME") == ours:
                continue  # its flow is alive
            os.kill(int(entry.name), signal.SIGTERM)
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        stopped.append(int(entry.name))
    deadline = time.monotonic() + 10
    for pid in stopped:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            os.kill(pid, signal.SIGKILL)
    return stopped


def _parent_env(pid: int) -> dict[bytes, bytes]:
    try:
        return _environ(pid)
    except OSError:  # not readable: not one of our flows
        return {}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
