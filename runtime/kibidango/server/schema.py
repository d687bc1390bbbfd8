"""Request bodies of the OpenAI-compatible endpoints, validated (types, bounds, text a tokenizer can
encode); a bad request is a 400 in OpenAI's error shape, never a crash."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from kibidango.decode.speculative import REQUEST_SETTINGS, SETTINGS


def _valid_text(value: str, field: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return value


def _request_fields() -> dict[str, Any]:
    """The decoding settings a request may set (the mode and :data:`REQUEST_SETTINGS`), generated
    from :class:`DecodeConfig`'s declaration: its doc, choices and request bounds; each optional
    (None: the server's default)."""
    out: dict[str, Any] = {}
    for name in ("mode", *REQUEST_SETTINGS):
        meta = SETTINGS[name].metadata
        if meta["choices"]:
            kind: Any = Literal[meta["choices"]]
        else:
            kind = type(SETTINGS[name].default)
        out[name] = (kind | None, Field(None, description=meta["doc"], **meta["bounds"]))
    return out


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    stream: bool = False
    stop: str | list[str] | None = None
    adapter: str | None = Field(None, max_length=64, description="auto, none or a domain; default: the server's")
    session_id: str | None = Field(None, max_length=128, description="chat: the session whose memory to use")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop: at most 4 non-empty strings")
        return [_valid_text(s, "stop") for s in stops] if stops is not None else None


Decoding = create_model("Decoding", __base__=_Request, **_request_fields())
"""A request's decoding fields: OpenAI's (max_tokens, n, stream, stop) and the runtime's settings,
generated from :class:`kibidango.decode.speculative.DecodeConfig` (one declaration)."""


class CompletionRequest(Decoding):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("prompt: exactly one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("prompt: must not be empty")
        return _valid_text(v, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    """A string, or OpenAI's list of content parts: text parts are joined (by newlines, as vLLM
    does); any other part (an image, audio) is refused — this server reads text."""

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("content: an empty list of parts")
            texts = []
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content[{i}]: a {kind!r} part; this server reads only text parts")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{i}].text: a string")
                texts.append(part["text"])
            v = "\n".join(texts)
        return _valid_text(v, "content")


class ChatRequest(Decoding):
    messages: list[ChatMessage] = Field(min_length=1)
