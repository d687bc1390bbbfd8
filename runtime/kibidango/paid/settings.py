"""One declaration of an OpenAI-compatible endpoint's settings: where it is, which model, the name
of the variable holding its key, what it costs, how long a call may take and how many HTTP requests
one call may make (``max_attempts``, retries included — the one retry vocabulary of the project).

The teacher tiers (stage 1D), the ``llm`` judge and the runtime cascade's cloud embed it (their
settings are subclasses: the same fields, checked the same way) and build their
:class:`kibidango.paid.client.Endpoint` with :meth:`EndpointSettings.endpoint`. Errors name the
source and the field (:func:`config_error`) and never echo a value: a key pasted where its
variable's name belongs stays out of every message.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kibidango.paid.client import Endpoint

__all__ = ["EndpointSettings", "config_error"]

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
_URL = re.compile(r"^https?://\S+$")


class EndpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(description="OpenAI-compatible endpoint (http(s)://…/v1).")
    model: str = Field(min_length=1, max_length=256, description="The model name sent to the endpoint.")
    api_key_env: str | None = Field(
        None,
        description="NAME of the environment variable holding the key (A-Z, 0-9, _); None: a local endpoint "
        "without one. The key itself never appears in a config.",
    )
    usd_per_1k_prompt: float = Field(0.0, ge=0, description="Dollars per 1,000 prompt tokens.")
    usd_per_1k_completion: float = Field(0.0, ge=0, description="Dollars per 1,000 completion tokens.")
    timeout_s: float = Field(60.0, gt=0, le=86_400, description="Seconds one HTTP request may take.")
    max_attempts: int = Field(4, ge=1, le=100, description="HTTP requests per call, retries included.")
    backoff_s: float = Field(0.5, ge=0, description="First backoff; doubles per retry, full jitter, capped at 30 s.")

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not _URL.match(v):
            raise ValueError("an http(s) URL")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _a_name(cls, v: str | None) -> str | None:
        if v is not None and not _ENV_NAME.match(v):
            raise ValueError("the NAME of an environment variable (A-Z, 0-9, _), not a key")
        return v

    def endpoint(self, name: str, base_url: str | None = None, model: str | None = None) -> Endpoint:
        """The paid client's endpoint for these settings; ``name`` is what errors and ledger notes
        call it; ``base_url`` / ``model`` stand in for settings that leave them open (a tier the
        stage serves itself)."""
        return Endpoint(
            base_url or self.base_url,
            model or self.model,
            self.api_key_env,
            self.usd_per_1k_prompt,
            self.usd_per_1k_completion,
            self.timeout_s,
            self.max_attempts,
            self.backoff_s,
            name=name,
        )


def config_error(e: ValidationError, where: str, section: str = "") -> str:
    """``e`` as lines ``<where>: <section>.<field path>: <why>``, without the values (a value may be
    a key)."""
    lines = []
    for err in e.errors(include_input=False, include_url=False):
        loc = ".".join([*([section] if section else []), *(str(p) for p in err["loc"])])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {loc}: {msg}" if loc else f"{where}: {msg}")
    return "\n".join(lines)
