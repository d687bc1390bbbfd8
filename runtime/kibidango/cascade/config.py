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
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kibidango.integrity import BundleError

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

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
_TOP = {
    "draft",
    "qualifier",
    "router",
    "escalation",
    "cloud",
    "schema",
    "source",
    "objective",
    "expected",
    "held_out_queries",
}
_CLOUD = {
    "base_url",
    "model",
    "api_key_env",
    "usd_per_1k_prompt",
    "usd_per_1k_completion",
    "fallback_threshold",
    "budget_limit",
    "budget_period",
    "timeout_s",
    "max_retries",
    "breaker_failures",
    "max_tokens",
    "validation_max_tokens",
}


@dataclass(frozen=True)
class CloudConfig:
    base_url: str
    model: str
    api_key_env: str
    usd_per_1k_prompt: float
    usd_per_1k_completion: float
    fallback_threshold: float = 0.7
    budget_limit: float = 10.0
    budget_period: str = "month"
    timeout_s: float = 30.0
    max_retries: int = 3
    breaker_failures: int = 5
    max_tokens: int = 512
    validation_max_tokens: int = 64


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


def _number(doc: dict, key: str, where: str, lo: float, hi: float | None = None) -> float:
    """A finite number in [lo, hi] (JSON's NaN and Infinity are refused), or an error naming the
    config's sources and the field."""
    v = doc[key]
    ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
    if not ok or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CascadeConfigError(f"{where}.{key}: {v!r} is not a finite number {bound}")
    return float(v)


def _integer(doc: dict, key: str, where: str, lo: int, hi: int) -> int:
    v = _number(doc, key, where, lo, hi)
    if v != int(v):
        raise CascadeConfigError(f"{where}.{key}: {doc[key]!r} is not a whole number")
    return int(v)


def parse_cascade(doc: dict, where: str) -> CascadeConfig:
    """A :class:`CascadeConfig` from a merged document; ``where`` names its sources in errors."""
    _names(doc, where)
    unknown = set(doc) - _TOP
    if unknown:
        raise CascadeConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_TOP)}")
    for section in ("draft", "qualifier", "router", "escalation", "cloud"):
        if section in doc and not isinstance(doc[section], dict):
            raise CascadeConfigError(f"{where}: {section}: an object, not {type(doc[section]).__name__}")
        if section in doc:
            _names(doc[section], f"{where}: {section}")
    draft, qual = doc.get("draft", {}), doc.get("qualifier", {})
    router, esc = doc.get("router", {}), doc.get("escalation", {})
    kw: dict[str, Any] = {"source": where}
    if "max_tokens" in draft:
        kw["draft_max_tokens"] = _integer(draft, "max_tokens", f"{where}: draft", 1, _MAX_TOKENS)
    if "threshold" in qual:
        kw["qualifier_threshold"] = _number(qual, "threshold", f"{where}: qualifier", 0, 1.0 + 1e-6)
    if "threshold" in router:
        kw["router_threshold"] = _number(router, "threshold", f"{where}: router", 0)
    if "use_detector" in esc:
        if not isinstance(esc["use_detector"], bool):
            raise CascadeConfigError(f"{where}: escalation.use_detector: true or false")
        kw["use_detector"] = esc["use_detector"]
    cloud = doc.get("cloud")
    if cloud is not None and "base_url" in cloud:  # 6C's cloud section carries prices only
        kw["cloud"] = _cloud(cloud, f"{where}: cloud")
        if kw["cloud"].fallback_threshold > kw.get("qualifier_threshold", CascadeConfig.qualifier_threshold):
            raise CascadeConfigError(f"{where}: cloud.fallback_threshold is above qualifier.threshold")
    return CascadeConfig(**kw)


_MAX_TOKENS = 1_000_000  # a bound on any token count a config names (a typo'd 1e12 is an error, not an overflow)


def _names(doc: dict, where: str) -> None:
    """Every key of ``doc`` is a field name (a string): YAML allows numbers and lists as keys."""
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        raise CascadeConfigError(f"{where}: {bad[0]!r} is not a field name (a {type(bad[0]).__name__}, not a string)")


def _cloud(c: Any, where: str) -> CloudConfig:
    if not isinstance(c, dict):
        raise CascadeConfigError(f"{where}: an object")
    unknown = set(c) - _CLOUD
    if unknown:
        raise CascadeConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = [
        k for k in ("base_url", "model", "api_key_env", "usd_per_1k_prompt", "usd_per_1k_completion") if k not in c
    ]
    if missing:
        raise CascadeConfigError(f"{where}: missing {', '.join(missing)}")
    if not isinstance(c["base_url"], str) or not re.match(r"^https?://[^\s]+$", c["base_url"]):
        raise CascadeConfigError(f"{where}.base_url: an http(s) URL")
    if not isinstance(c["api_key_env"], str) or not _ENV_NAME.match(c["api_key_env"]):
        # never echo the value: it may be a key pasted where its variable's name belongs
        raise CascadeConfigError(f"{where}.api_key_env: the NAME of an environment variable (A-Z, 0-9, _), not a key")
    if not isinstance(c["model"], str) or not c["model"].strip() or len(c["model"]) > 256:
        raise CascadeConfigError(
            f"{where}.model: the model's name, a non-empty string (not {type(c['model']).__name__})"
        )
    kw: dict[str, Any] = {k: c[k] for k in ("base_url", "model", "api_key_env")}
    for key, lo, hi in (
        ("usd_per_1k_prompt", 0, None),
        ("usd_per_1k_completion", 0, None),
        ("fallback_threshold", 0, 1.0 + 1e-6),
        ("budget_limit", 0, None),
        ("timeout_s", 0.001, 86_400),
    ):
        if key in c:
            kw[key] = _number(c, key, where, lo, hi)
    for key, lo, hi in (
        ("max_retries", 0, 100),
        ("breaker_failures", 1, 1_000_000),
        ("max_tokens", 1, _MAX_TOKENS),
        ("validation_max_tokens", 1, _MAX_TOKENS),
    ):
        if key in c:
            kw[key] = _integer(c, key, where, lo, hi)
    if "budget_period" in c:
        if c["budget_period"] not in ("month", "day", "total"):
            raise CascadeConfigError(f"{where}.budget_period: month, day or total")
        kw["budget_period"] = c["budget_period"]
    return CloudConfig(**kw)


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
