"""Secrets never become config values, and nothing that looks like one reaches a sink.

A secret (an API key, a hub token) lives in an environment variable; a config names the variable
(a key ending in ``_env``, e.g. ``api_key_env: OPENAI_API_KEY``) and the code that uses it reads it
with :func:`secret_from_env`. :func:`find_secrets` lists the entries of a config that look like
secrets, by key (``api_key``, ``token``, ``hub_token``, ``password``, ``Authorization``, ...) or by
value (the formats of common keys: ``sk-...``, ``hf_...``, ``ghp_...``, AWS, Slack, Google, JWTs,
``Bearer ...``): presets refuse them. :func:`redact` and :func:`redact_text` guard every sink
anyway (MLflow params and tags, manifests, rendered YAMLs, log records, error messages)."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

__all__ = [
    "REDACTED",
    "find_secrets",
    "install_log_redaction",
    "is_secret_key",
    "redact",
    "redact_text",
    "secret_from_env",
]

REDACTED = "***"

_KEY = re.compile(
    r"(api[_-]?key|apikey|secret|passw(or)?d|passphrase|credential|authorization|cookie|private[_-]?key|bearer"
    r"|^token$|^tokens$|(access|auth|hub|hf|refresh|session|oauth|github|gh|gitlab|wandb|slack|bot|api|personal|id|client)[_-]?tokens?$)",
    re.IGNORECASE,
)
"""Keys whose value is a secret. Tokenizer settings (``pad_token``, ``max_tokens``, ...) are not."""

_VALUE = re.compile(
    r"(?<![A-Za-z0-9])("
    r"sk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{16,}"  # OpenAI, Anthropic, Stripe-style
    r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|glpat-[A-Za-z0-9_-]{20,}"  # GitHub, GitLab
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}"  # AWS access key ids
    r"|AIza[0-9A-Za-z_-]{35}"  # Google
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # JWT
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{12,}"
    r")"
)


def is_secret_key(key: Any) -> bool:
    """True for a key that holds a secret (``api_key``); False for one that names where it is
    (``api_key_env``)."""
    k = str(key)
    return not k.lower().endswith("_env") and bool(_KEY.search(k))


_USERINFO = re.compile(r"(?<=://)[^\s/?#@]+(?=@)")
"""A URL's credentials: ``http://user:pass@host``, ``postgresql://user:pass@host/db`` (the
``MLFLOW_TRACKING_URI`` of a tracking server or database)."""
_QUERY_SECRET = re.compile(
    r"(?i)(?<=[?&;])((?:password|passwd|pwd|token|access_token|api_key|apikey|key|secret|sig|signature)=)[^&;#\s]+"
)
"""A secret in a URL's query string (``?password=...``, a presigned URL's ``Signature=``)."""


def redact_text(text: str) -> str:
    """``text`` with every value that looks like a key, and every URL's credentials, replaced by
    ``***``."""
    if not isinstance(text, str):
        return text
    text = _USERINFO.sub(REDACTED, text)
    text = _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)
    return _VALUE.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, strings) with secret keys' values and secret-looking
    strings replaced by ``***``."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if is_secret_key(k) and v not in (None, "", [], {}) else redact(v)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    return value


def find_secrets(value: Any, path: str = "") -> list[str]:
    """Dotted paths of the entries of ``value`` that are secrets: a secret key with a value, or a
    string that looks like a key. The values themselves are never returned."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}{k}"
            if is_secret_key(k) and v not in (None, "", [], {}):
                found.append(where)
            else:
                found += find_secrets(v, where + ".")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found += find_secrets(v, f"{path}{i}.")
    elif isinstance(value, str) and _VALUE.search(value):
        found.append(path.rstrip("."))
    return found


def secret_from_env(variable: str, what: str) -> str:
    """The value of environment variable ``variable`` (named by a config's ``*_env`` key) for
    ``what`` (e.g. "stage 1D teacher gpt"); the error names the variable, never a value."""
    value = os.environ.get(variable, "")
    if not value:
        from core.contract import KibidangoError

        raise KibidangoError(
            f"{what}: environment variable {variable} is not set (it holds the secret; configs only name it)"
        )
    return value


_installed = False


def install_log_redaction() -> None:
    """Redact every log record of the process, whichever logger or handler (Prefect's included)
    it goes to: the record's message is formatted and passed through :func:`redact_text`."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to logging's own error path
            return record
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
