"""The cascade's cloud tier: any OpenAI-compatible endpoint, called through the one paid client
(:class:`kibidango.paid.client.PaidClient`: bounded retries by cause, the budget ledger's worst
case reserved and settled, the key from the environment and never shown) behind a circuit
breaker, so that a request never fails because the cloud did.

One call (:meth:`CloudClient.chat`): the breaker is open (``breaker_failures`` calls in a row
failed, less than ``cooldown_s`` ago) -> no call, ``degraded``; no room in the budget ->
``budget_exhausted``; no key -> ``no_key``; every attempt failed, or the endpoint refused the
request -> ``degraded``. Counts by status and retry cause feed the server's ``/metrics``.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kibidango.cascade.config import CloudConfig
from kibidango.paid.client import PaidClient
from kibidango.paid.ledger import Ledger

__all__ = ["CloudClient", "CloudReply"]

log = logging.getLogger("kibidango.cascade.cloud")


@dataclass
class CloudReply:
    text: str | None
    usd: float = 0.0
    attempts: int = 0
    retries: Counter = field(default_factory=Counter)
    status: str = "ok"
    """``ok``, ``degraded`` (failed or breaker open), ``budget_exhausted``, ``no_key``."""
    error: str | None = None
    seconds: float = 0.0
    reserved: float = 0.0
    """The worst case reserved for one attempt."""
    usage_untrusted: bool = False
    over_reservation: bool = False
    """It reported more than its reservation: recorded as reported, and the ledger is on hold."""


class CloudClient:
    def __init__(self, cfg: CloudConfig, ledger: Ledger, cooldown_s: float = 30.0, sleep=time.sleep):
        self.cfg = cfg
        self.ledger = ledger
        self.cooldown_s = cooldown_s
        self.paid = PaidClient(cfg.endpoint(f"cloud {cfg.model}"), ledger, sleep)
        self._lock = threading.Lock()
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.counts: Counter = Counter()  # calls by status, retries by cause: for /metrics

    def breaker_open(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return False
            if time.monotonic() - self.opened_at >= self.cooldown_s:
                self.opened_at = None  # half-open: the next call tries
                self.consecutive_failures = self.cfg.breaker_failures - 1
                return False
            return True

    def _outcome(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.consecutive_failures = 0
                self.opened_at = None
            else:
                self.consecutive_failures += 1
                if self.consecutive_failures >= self.cfg.breaker_failures and self.opened_at is None:
                    self.opened_at = time.monotonic()
                    n, wait = self.consecutive_failures, self.cooldown_s
                    log.warning(f"cloud {self.cfg.model}: {n} failed calls in a row; answering locally for {wait:g}s")

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> CloudReply:
        reply = CloudReply(None)
        if self.breaker_open():
            reply.status, reply.error = "degraded", "circuit breaker open"
            self.counts["breaker_open"] += 1
            return reply
        if importlib.util.find_spec("openai") is None:
            reply.status = "degraded"
            reply.error = "the cloud tier needs the openai package (pip install 'kibidango[cloud]')"
            self.counts["no_client"] += 1
            return reply
        paid = self.paid.chat(messages, max_tokens or self.cfg.max_tokens)
        reply.text, reply.usd, reply.attempts, reply.retries = paid.text, paid.usd, paid.attempts, paid.retries
        reply.seconds, reply.reserved = paid.seconds, paid.reserved
        reply.usage_untrusted, reply.over_reservation = paid.usage_untrusted, paid.over_reservation
        if paid.status in ("ok", "budget_exhausted", "no_key"):
            reply.status = paid.status
        else:  # refused, rejected, failed: answered locally
            reply.status = "degraded"
            if paid.status == "refused":
                paid.error += f"; check base_url, model and ${self.cfg.api_key_env}"
        reply.error = paid.error or None
        if paid.status not in ("budget_exhausted", "no_key"):
            self._outcome(reply.text is not None)
        if paid.usage_untrusted:
            self.counts["usage_untrusted"] += 1
        if paid.over_reservation:
            self.counts["over_reservation"] += 1
        self.counts[reply.status] += 1
        for cause, n in reply.retries.items():
            self.counts[f"retry_{cause}"] += n
        return reply
