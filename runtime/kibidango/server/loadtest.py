"""A bounded load test of a running server (``kibidango loadtest``): ``requests`` chat requests
from ``concurrency`` clients, each client sending its next request when the last one ended.

Every request ends in one of: answered (200), refused with a clear status (429 or 503, which must
carry Retry-After), another HTTP status, or **lost** — no HTTP answer at all (a reset connection,
or no reply within the client's timeout). A correct server under any load loses none.
``retry_refused``: a refused request is sent again after its Retry-After (at most ``max_retries``
times), as a well-behaved client does, to the next server when there are several; so is a request
whose connection was refused (the server is down: nothing was sent); the latency then counts from
the first send.

Reports p50/p99 latency of the answered requests and throughput (answered per second of wall
time), beside the counts by outcome. Standard library only (threads and urllib), so it runs
wherever the runtime does."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LoadResult", "format_load", "percentile", "run_load"]


@dataclass
class LoadResult:
    requests: int
    concurrency: int
    seconds: float
    outcomes: Counter = field(default_factory=Counter)
    """``200``, ``429``, ``503``, other statuses as strings, ``refused_connection`` (no server
    listening: nothing was sent) and ``lost``."""
    latencies: list[float] = field(default_factory=list)
    """Seconds, answered requests only."""
    retried: int = 0
    refused_without_retry_after: int = 0
    bodies: list[dict] = field(default_factory=list)
    """The answered requests' response bodies (kept when asked)."""

    @property
    def lost(self) -> int:
        return self.outcomes["lost"]

    @property
    def answered(self) -> int:
        return self.outcomes["200"]

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "concurrency": self.concurrency,
            "seconds": round(self.seconds, 3),
            "outcomes": dict(sorted(self.outcomes.items())),
            "retried": self.retried,
            "refused_without_retry_after": self.refused_without_retry_after,
            "p50_s": round(percentile(self.latencies, 50), 4) if self.latencies else None,
            "p99_s": round(percentile(self.latencies, 99), 4) if self.latencies else None,
            "answered_per_s": round(self.answered / self.seconds, 3) if self.seconds else None,
        }


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile by linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of nothing")
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def run_load(
    base_url: str,
    body: dict | list[dict],
    requests: int,
    concurrency: int,
    timeout_s: float = 120.0,
    retry_refused: bool = False,
    max_retries: int = 5,
    headers: dict[str, str] | None = None,
    keep_bodies: bool = False,
    endpoint: str = "/v1/chat/completions",
    progress: Callable[[int], None] | None = None,
    failover: bool = True,
) -> LoadResult:
    """``body``: the request (or a list, used round-robin); ``base_url``: the server's root
    (``http://127.0.0.1:8000``), or a list of them used round-robin. ``progress(n)`` is called as
    the ``n``-th request ends. ``failover``: a retried request goes to the next server (else to
    the same one: a client pinned to its server). Returns when every request has ended."""
    if requests < 1 or concurrency < 1:
        raise ValueError("requests and concurrency are positive")
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    bodies = body if isinstance(body, list) else [body]
    result = LoadResult(requests, concurrency, 0.0)
    lock = threading.Lock()
    next_index = iter(range(requests))

    ended = 0

    def send(i: int) -> None:
        nonlocal ended
        data = json.dumps(bodies[i % len(bodies)]).encode()
        started = time.monotonic()
        tries = 0
        while True:
            url = urls[(i + (tries if failover else 0)) % len(urls)].rstrip("/") + endpoint
            req = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    reply = json.loads(resp.read())
                    outcome, wait = str(resp.status), None
            except urllib.error.HTTPError as e:
                e.read()
                outcome, wait = str(e.code), e.headers.get("Retry-After")
                if e.code in (429, 503) and not wait:
                    with lock:
                        result.refused_without_retry_after += 1
            except urllib.error.URLError as e:
                refused = isinstance(e.reason, ConnectionRefusedError)  # nothing was sent
                outcome, wait = ("refused_connection" if refused else "lost"), None
            except (OSError, ValueError):  # reset, timed out, or a cut body: no answer
                outcome, wait = "lost", None
            if outcome in ("429", "503", "refused_connection") and retry_refused and tries < max_retries:
                tries += 1
                with lock:
                    result.retried += 1
                time.sleep(_seconds(wait, 0.1 if failover and len(urls) > 1 else 0.5))
                continue
            break
        with lock:
            result.outcomes[outcome] += 1
            if outcome == "200":
                result.latencies.append(time.monotonic() - started)
                if keep_bodies:
                    result.bodies.append(reply)
            ended += 1
            n = ended
        if progress is not None:
            progress(n)

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            send(i)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - t0
    return result


def _seconds(retry_after: str | None, default: float) -> float:
    """A Retry-After of delta seconds (capped at 60); an HTTP date or nothing: ``default``."""
    try:
        return min(60.0, max(0.0, float(retry_after))) if retry_after else default
    except ValueError:
        return default


def format_load(result: LoadResult) -> str:
    s = result.summary()
    outcomes = ", ".join(f"{k}: {v}" for k, v in s["outcomes"].items())
    lat = "-" if s["p50_s"] is None else f"p50 {s['p50_s'] * 1000:.0f} ms, p99 {s['p99_s'] * 1000:.0f} ms"
    return (
        f"{s['requests']} requests, {s['concurrency']} concurrent, {s['seconds']:.1f} s: {outcomes}"
        f" (lost: {result.lost}; retried after a refusal: {s['retried']})\n"
        f"latency of answered requests: {lat}; throughput {s['answered_per_s']} answered/s"
    )
