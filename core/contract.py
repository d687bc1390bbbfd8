"""The stage contract.

A stage is a module that defines

- its name, the module's own (``curate``), and its id (``"0"``, ``"2B"``) from the registry in
  :mod:`stages` (:func:`stages.stage_name`); the runner prefixes the stage's errors with both;
- ``Config``: a :class:`StageConfig` (pydantic, ``extra="forbid"``, every field documented);
- ``run(cfg, inputs, out_dir) -> StageResult``: a pure function of its config and input
  artifacts. It reads only ``inputs`` (and files its config names), writes only under
  ``out_dir`` and never talks to Prefect or MLflow;
- optionally ``external_inputs(cfg) -> dict[str, str]``: digests of files outside the artifact
  store that the stage reads (raw data sources), so that they enter the cache key;
- optionally ``LIBRARIES``: distributions whose version changes the stage's output;
- optionally ``RESUMABLE = True``: ``run`` then takes a fourth argument, ``work_dir``, a
  directory kept across failed attempts of the same cache key (training checkpoints) and removed
  once the artifact is published. ``out_dir`` is still the only place outputs are published from.

Long stages report progress through :mod:`core.progress` (log lines, and live metrics that the
runner sends to the stage's MLflow run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

__all__ = [
    "KibidangoError",
    "Stage",
    "StageConfig",
    "StageResult",
    "TABLE_ROWS",
    "code_version",
]

PROJECT_PACKAGES = ("stages", "methods", "kibidango")
"""Packages whose definitions can enter a stage's code version (the runtime's too: stage X writes
bundles with its writer)."""


class KibidangoError(Exception):
    """An error whose message is meant for the user as-is: it names the file, row or key at
    fault and, where there is one, the remedy. The CLI prints it without a traceback."""


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class StageResult:
    """What a stage returns besides the files it wrote under ``out_dir``."""

    metrics: dict[str, float]
    """Numbers logged as MLflow metrics and stored in the manifest."""
    files_to_log: list[str] = field(default_factory=list)
    """Small files (paths relative to ``out_dir``) logged as MLflow artifacts: cards, plots."""
    summary: str = ""
    """A few human lines printed by the flow after the stage."""
    tables: dict[str, str] = field(default_factory=dict)
    """MLflow tables: artifact name (``answers.json``) -> a JSONL file under ``out_dir`` whose
    first :data:`TABLE_ROWS` rows are logged with ``log_table`` (the whole file stays in the artifact)."""
    failure: str | None = None
    """Set when the stage's outputs are published but the flow must stop here (failed quality
    gates): the message the flow fails with, on this run and on every cache hit of the artifact."""


TABLE_ROWS = 1000


class Stage(Protocol):
    Config: type[StageConfig]

    def run(self, cfg: StageConfig, inputs: dict[str, Path], out_dir: Path) -> StageResult: ...


PLUMBING = ("core", "kibidango.paid")
"""Packages that are not part of any stage's code version: the project's plumbing (the store, the
contract, progress), and the runtime's paid floor (``kibidango/paid/``: the OpenAI-compatible
client, its budget ledger and their state; 1D's teachers and the ``llm`` judge call endpoints
through it). The client is transport: what a provider replies is not a function of our code, and
the stage that pays for a reply journals it before using it (1D; the judged stages keep every
verdict in their row logs), so a recompute never pays again; what a stage does with a reply — and
its own prices and budget, which are config — is hashed. The runtime's cascade and server are
reached by no stage (``tests/test_code_version.py``)."""


def code_version(stage: ModuleType, sources: dict[str, str] | None = None) -> str:
    """The stage's code version: see :mod:`core.codehash` (``sources`` replaces module sources,
    for tests)."""
    from core.codehash import code_version as _version

    return _version(stage, PROJECT_PACKAGES, PLUMBING, sources)


def config_to_dict(cfg: StageConfig) -> dict[str, Any]:
    """The canonical JSON-able form of a config (what enters the cache key)."""
    return cfg.model_dump(mode="json")
