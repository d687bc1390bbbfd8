"""The server's refusals and failures, in OpenAI's error shape: what status, message, parameter,
type and code each case answers with. Built by the completions service and the app's exception
handlers; turned into a response by the app. Never a client-facing exception text or traceback:
the server log has those."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CLIENT_CLOSED", "ApiError", "failure", "http_error", "invalid_request", "refusal", "unexpected"]


@dataclass(frozen=True)
class ApiError:
    status: int
    message: str
    param: str | None = None
    kind: str = "invalid_request_error"
    code: str | None = None
    headers: dict[str, str] | None = None
    counted: bool = True
    """Counted in ``kibidango_request_errors_total`` (refusals for load and cancellations are not)."""
    short: bool = False
    """The body holds message and type only (a cancelled request: nobody reads it)."""

    def body(self) -> dict[str, Any]:
        if self.short:
            return {"error": {"message": self.message, "type": self.kind}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid_request(errors: list[dict]) -> ApiError:
    """A body that fails validation (pydantic's error list): the first error, its location named."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        at = first["loc"][-1] if first.get("loc") else "?"
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON (at character {at}): {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = f"{'.'.join(loc) + ': ' if loc else ''}{first.get('msg', 'invalid request')}"
    return ApiError(400, message, ".".join(loc) or None)


def http_error(status: int, detail: Any) -> ApiError:
    """FastAPI's own refusals (a body it cannot parse, e.g. JSON nested past Python's recursion
    limit; unknown paths; wrong methods)."""
    return ApiError(status, "the request body could not be parsed as JSON" if status == 400 else str(detail))


def unexpected(reference: str) -> ApiError:
    return ApiError(500, f"internal error (reference {reference}; the server log has the details)", kind="server_error")


def refusal(why: str, retry_after: int, max_queue: int) -> ApiError:
    """A request the server cannot take now: 429 (queue full) or 503 (shutting down), both with
    Retry-After; counted in kibidango_requests_refused_total, not as errors."""
    headers = {"Retry-After": str(retry_after)}
    if why == "queue_full":
        message = f"the server is at its limit of {max_queue} queued requests; retry after {retry_after} s"
        return ApiError(429, message, kind="server_overloaded", code="queue_full", headers=headers, counted=False)
    return ApiError(
        503,
        "the server is shutting down; retry on another replica",
        kind="server_unavailable",
        code="shutting_down",
        headers=headers,
        counted=False,
    )


def failure(kind: str, exc: Any, timeout_s: float, retry_after: int, max_queue: int) -> ApiError:
    """How a generation that did not end normally is answered (``kind`` from the scheduler)."""
    if kind == "error":
        return ApiError(400, str(exc))
    if kind == "timeout":
        return ApiError(
            504,
            f"the request did not finish within this server's {timeout_s:g} s",
            kind="timeout",
            code="request_timeout",
        )
    if kind in ("shutting_down", "queue_full"):
        return refusal(kind, retry_after, max_queue)
    if kind == "cancelled":
        return ApiError(499, "cancelled", kind="cancelled", counted=False, short=True)
    return ApiError(500, "internal error during generation (the server log has the details)", kind="server_error")


CLIENT_CLOSED = ApiError(499, "client closed the request", kind="cancelled", counted=False, short=True)
"""A non-streamed request whose client went away: nobody to answer (499 is what proxies log)."""
