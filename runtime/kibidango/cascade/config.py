"""The local/cloud cascade's configuration: the plan's shape, read from a bundle (stage 6C's chosen
thresholds), a named config shipped here, or a user's JSON/YAML file, validated with errors that
name the file and the field.

    {"draft": {"max_tokens": 256},
     "qualifier": {"threshold": 0.85},          # accept the local answer at or above this confidence
     "router": {"threshold": 0.5},              # use the routed domain adapter at or above this
     "escalation": {"use_detector": false},     # 6B's flag also sends an accepted answer to validation
     "cloud": {"base_url": "https://openrouter.ai/api/v1", "model": "...",
               "api_key_env": "OPENROUTER_API_KEY",   # the variable's NAME; the key never appears here
               "usd_per_1k_prompt": 0.003, "usd_per_1k_completion": 0.015,
               "fallback_threshold": 0.7,              # below: the cloud answers; between: it validates
               "budget_limit": 10.0, "budget_period": "month"}}

:func:`load_cascade` layers, later over earlier: the defaults, the bundle's ``cascade/cascade.json``
(6C), then the named config or file the user gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kibidango.integrity import BundleError
from kibidango.paid.settings import EndpointSettings, config_error

__all__ = ["NAMED", "CascadeConfig", "CloudConfig", "CascadeConfigError", "load_cascade"]


class CascadeConfigError(ValueError):
    """A cascade config that cannot be used; the message names the source and the field."""


NAMED: dict[str, dict[str, Any]] = {
    # The plan's example (../shared/docs/PLAN.md, "runtime side"): draft max 256 tokens, qualifier
    # threshold 0.85, cloud fallback threshold 0.7, budget 10.00 dollars a month.
    "plan-example": {
        "draft": {"max_tokens": 256},
        "qualifier": {"threshold": 0.85},
        "cloud": {
            "base_url": "https://openrouter.ai/api/v1",
            "model": "anthropic/claude-sonnet-4",
            "api_key_env": "OPENROUTER_API_KEY",
            "usd_per_1k_prompt": 0.003,
            "usd_per_1k_completion": 0.015,
            "fallback_threshold": 0.7,
            "budget_limit": 10.0,
            "budget_period": "month",
        },
    },
    # Everything local: no cloud, the router and qualifier still decide and report.
    "local-only": {"qualifier": {"threshold": 0.0}},
}

_MAX_TOKENS = 1_000_000  # a bound on any token count a config names (a typo'd 1e12 is an error, not an overflow)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class CloudConfig(EndpointSettings):
    """The cloud tier: an endpoint (:class:`kibidango.paid.settings.EndpointSettings`: URL, model,
    key variable, prices, timeout, attempts) and what the cascade does with it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    api_key_env: str = Field(description="NAME of the environment variable holding the cloud's key.")
    usd_per_1k_prompt: float = Field(ge=0, description="Dollars per 1,000 prompt tokens (the ledger's prices).")
    usd_per_1k_completion: float = Field(ge=0, description="Dollars per 1,000 completion tokens.")
    timeout_s: float = Field(30.0, gt=0, le=86_400, description="Seconds one request may take (a user is waiting).")
    fallback_threshold: float = Field(
        0.7, ge=0, le=1.0 + 1e-6, description="Below this confidence the cloud answers; at or above, it validates."
    )
    budget_limit: float = Field(10.0, ge=0, description="Dollars the ledger lets the cascade spend per period.")
    budget_period: Literal["month", "day", "total"] = "month"
    breaker_failures: int = Field(5, ge=1, le=1_000_000, description="Failures in a row that open the breaker.")
    max_tokens: int = Field(512, ge=1, le=_MAX_TOKENS, description="Most tokens of a cloud answer.")
    validation_max_tokens: int = Field(64, ge=1, le=_MAX_TOKENS, description="Most tokens of a validation verdict.")


class _Draft(_Section):
    max_tokens: int = Field(256, ge=1, le=_MAX_TOKENS, description="Most tokens of the local answer.")


class _Qualifier(_Section):
    threshold: float = Field(
        0.85, ge=0, le=1.0 + 1e-6, description="Accept the local answer at or above this calibrated confidence."
    )


class _Router(_Section):
    threshold: float = Field(0.0, ge=0, description="Use the routed domain adapter at or above this router score.")


class _Escalation(_Section):
    use_detector: bool = Field(False, description="6B's flag also sends an accepted answer to validation.")


class _Document(_Section):
    """A cascade config file's shape (6C's ``cascade.json`` adds what it measured)."""

    draft: _Draft = _Draft()
    qualifier: _Qualifier = _Qualifier()
    router: _Router = _Router()
    escalation: _Escalation = _Escalation()
    cloud: dict[str, Any] | None = Field(
        None, description="The cloud tier (CloudConfig); a section without base_url (6C's: prices only) is no tier."
    )
    schema_: Any = Field(None, alias="schema", description="6C's cascade.json version.")
    source: Any = None
    objective: Any = Field(None, description="6C: what it optimised (recorded, not used).")
    expected: Any = Field(None, description="6C: the quality and share it predicted (recorded, not used).")
    held_out_queries: Any = Field(None, description="6C: how many queries it measured on (recorded, not used).")


@dataclass(frozen=True)
class CascadeConfig:
    draft_max_tokens: int = 256
    qualifier_threshold: float = 0.85
    router_threshold: float = 0.0
    use_detector: bool = False
    cloud: CloudConfig | None = None
    source: str = "defaults"


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CascadeConfigError(f"{path}: cannot read the cascade config ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise CascadeConfigError(f"{path}: not UTF-8 text (byte {e.start}): a cascade config is JSON or YAML") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise CascadeConfigError(f"{path}: YAML configs need pyyaml (or write JSON)") from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise CascadeConfigError(f"{path}: not valid YAML: {e}") from None
        except RecursionError:
            raise CascadeConfigError(f"{path}: nested too deeply to read") from None
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise CascadeConfigError(f"{path}: not valid JSON: line {e.lineno}: {e.msg}") from None
        except RecursionError:
            raise CascadeConfigError(f"{path}: nested too deeply to read") from None
    if not isinstance(doc, dict):
        raise CascadeConfigError(f"{path}: a cascade config is an object, not {type(doc).__name__}")
    return doc


def parse_cascade(doc: dict, where: str) -> CascadeConfig:
    """A :class:`CascadeConfig` from a merged document; ``where`` names its sources in errors."""
    try:
        d = _Document.model_validate(doc)
    except ValidationError as e:
        raise CascadeConfigError(config_error(e, where)) from None
    cloud = None
    if d.cloud is not None and "base_url" in d.cloud:  # 6C's cloud section carries prices only
        try:
            cloud = CloudConfig.model_validate(d.cloud)
        except ValidationError as e:
            raise CascadeConfigError(config_error(e, where, "cloud")) from None
        if cloud.fallback_threshold > d.qualifier.threshold:
            raise CascadeConfigError(f"{where}: cloud.fallback_threshold is above qualifier.threshold")
    return CascadeConfig(
        d.draft.max_tokens, d.qualifier.threshold, d.router.threshold, d.escalation.use_detector, cloud, where
    )


def load_cascade(name_or_path: str | Path | None = None, bundle=None) -> CascadeConfig:
    """Defaults, then the bundle's 6C thresholds (``bundle``: a :class:`kibidango.bundle.Bundle`),
    then ``name_or_path`` (a name in :data:`NAMED` or a JSON/YAML file)."""
    doc: dict = {}
    sources = ["defaults"]
    if bundle is not None:
        try:
            chosen = bundle.cascade()
        except BundleError as e:
            raise CascadeConfigError(str(e)) from None
        if chosen:
            doc = _merge(doc, chosen)
            sources.append(f"{bundle.root}/cascade/cascade.json")
    if name_or_path is not None:
        if str(name_or_path) in NAMED:
            doc = _merge(doc, NAMED[str(name_or_path)])
        else:
            doc = _merge(doc, _read(Path(name_or_path)))
        sources.append(str(name_or_path))
    return parse_cascade(doc, " + ".join(sources))
