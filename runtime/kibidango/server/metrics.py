"""``/metrics``: Prometheus text for the server's requests, tokens, speculative-decoding acceptance,
queue and, with a cascade, its tiers, cloud latency and budget."""

from __future__ import annotations

import threading

from kibidango.cascade.pipeline import CascadePipeline, CascadeResult
from kibidango.decode.speculative import Metrics
from kibidango.server.scheduler import Scheduler


class Stats:
    """Counters for /metrics."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.totals = Metrics("all")
        self.domains: dict[str, int] = {}
        self.adapters: dict[str, int] = {}
        self.confidence_sum = 0.0
        self.confidence_count = 0
        self.tiers: dict[str, int] = {}
        self.flags: dict[str, int] = {}
        self.cloud_usd = 0.0
        self.cloud_seconds = [0] * len(_CLOUD_BUCKETS)
        self.cloud_seconds_sum = 0.0
        self.cloud_calls = 0
        self.lock = threading.Lock()

    def count(self, metrics: Metrics, result: CascadeResult | None = None) -> None:
        with self.lock:
            if result is not None:
                self.tiers[result.tier] = self.tiers.get(result.tier, 0) + 1
                for flag in result.flags:
                    self.flags[flag] = self.flags.get(flag, 0) + 1
                self.cloud_usd += result.usd
                if result.cloud is not None and result.cloud.attempts:
                    self.cloud_calls += 1
                    self.cloud_seconds_sum += result.cloud.seconds
                    for i, edge in enumerate(_CLOUD_BUCKETS):  # cumulative, as Prometheus reads `le`
                        if result.cloud.seconds <= edge:
                            self.cloud_seconds[i] += 1
            self.requests += 1
            self.totals.add(metrics)
            if metrics.domain is not None:
                self.domains[metrics.domain] = self.domains.get(metrics.domain, 0) + 1
            name = metrics.adapter or "none"
            self.adapters[name] = self.adapters.get(name, 0) + 1
            if metrics.confidence is not None:
                self.confidence_sum += metrics.confidence
                self.confidence_count += 1

    def count_error(self) -> None:
        with self.lock:
            self.errors += 1

    def prometheus(self, model: str, cancelled: int = 0, adapter_loads: int = 0) -> str:
        t = self.totals
        lines = [
            "# HELP kibidango_requests_total Generation requests served.",
            "# TYPE kibidango_requests_total counter",
            f'kibidango_requests_total{{model="{model}"}} {self.requests}',
            "# TYPE kibidango_request_errors_total counter",
            f'kibidango_request_errors_total{{model="{model}"}} {self.errors}',
            "# HELP kibidango_requests_cancelled_total Generations stopped because the client went away (or at "
            "shutdown).",
            "# TYPE kibidango_requests_cancelled_total counter",
            f'kibidango_requests_cancelled_total{{model="{model}"}} {cancelled}',
            "# TYPE kibidango_prompt_tokens_total counter",
            f'kibidango_prompt_tokens_total{{model="{model}"}} {t.prompt_tokens}',
            "# TYPE kibidango_generation_tokens_total counter",
            f'kibidango_generation_tokens_total{{model="{model}"}} {t.generated_tokens}',
            "# TYPE kibidango_target_forward_passes_total counter",
            f'kibidango_target_forward_passes_total{{model="{model}"}} {t.forward_calls.get("target", 0)}',
            "# TYPE kibidango_generation_seconds_total counter",
            f'kibidango_generation_seconds_total{{model="{model}"}} {t.seconds:.6f}',
            "# TYPE kibidango_spec_decode_num_draft_tokens_total counter",
            *(
                f'kibidango_spec_decode_num_draft_tokens_total{{model="{model}",stage="{s}"}} {n}'
                for s, n in t.num_draft_tokens.items()
            ),
            "# TYPE kibidango_spec_decode_num_accepted_tokens_total counter",
            *(
                f'kibidango_spec_decode_num_accepted_tokens_total{{model="{model}",stage="{s}"}} {n}'
                for s, n in t.num_accepted_tokens.items()
            ),
            "# HELP kibidango_requests_by_domain_total Requests by the domain the router chose.",
            "# TYPE kibidango_requests_by_domain_total counter",
            *(
                f'kibidango_requests_by_domain_total{{model="{model}",domain="{d}"}} {n}'
                for d, n in self.domains.items()
            ),
            "# HELP kibidango_requests_by_adapter_total Requests by the adapter the target ran with.",
            "# TYPE kibidango_requests_by_adapter_total counter",
            *(
                f'kibidango_requests_by_adapter_total{{model="{model}",adapter="{a}"}} {n}'
                for a, n in self.adapters.items()
            ),
            "# HELP kibidango_adapter_loads_total Domain adapters loaded (an evicted one asked for again loads again).",
            "# TYPE kibidango_adapter_loads_total counter",
            f'kibidango_adapter_loads_total{{model="{model}"}} {adapter_loads}',
            "# HELP kibidango_answer_confidence Calibrated answer confidence (2G) over the requests scored.",
            "# TYPE kibidango_answer_confidence summary",
            f'kibidango_answer_confidence_sum{{model="{model}"}} {self.confidence_sum:.6f}',
            f'kibidango_answer_confidence_count{{model="{model}"}} {self.confidence_count}',
        ]
        return "\n".join(lines) + "\n"

    def cascade_metrics(self, model: str, cascade: CascadePipeline) -> str:
        """The cascade's lines: answers by tier and flag, this process's cloud spend and call
        latency, calls and retries by outcome; the budget (the ledger's: every process's spend)."""
        m = f'model="{model}-cascade"'
        with self.lock:
            lines = [
                "# HELP kibidango_cascade_requests_total Cascade answers by the tier that gave them.",
                "# TYPE kibidango_cascade_requests_total counter",
                *(f'kibidango_cascade_requests_total{{{m},tier="{t}"}} {n}' for t, n in self.tiers.items()),
                "# HELP kibidango_cascade_flags_total Cascade answers by flag (degraded, budget_exhausted, no_key, "
                "...).",
                "# TYPE kibidango_cascade_flags_total counter",
                *(f'kibidango_cascade_flags_total{{{m},flag="{f}"}} {n}' for f, n in self.flags.items()),
                "# HELP kibidango_cloud_spend_usd_total Dollars this process charged to the budget.",
                "# TYPE kibidango_cloud_spend_usd_total counter",
                f"kibidango_cloud_spend_usd_total{{{m}}} {self.cloud_usd:.6f}",
                "# HELP kibidango_cloud_request_seconds Cloud calls, retries and backoff included.",
                "# TYPE kibidango_cloud_request_seconds histogram",
                *(
                    f'kibidango_cloud_request_seconds_bucket{{{m},le="{_le(edge)}"}} {self.cloud_seconds[i]}'
                    for i, edge in enumerate(_CLOUD_BUCKETS)
                ),
                f"kibidango_cloud_request_seconds_sum{{{m}}} {self.cloud_seconds_sum:.6f}",
                f"kibidango_cloud_request_seconds_count{{{m}}} {self.cloud_calls}",
            ]
        client = cascade.client
        if client is not None:
            counts = dict(client.counts)
            lines += [
                "# HELP kibidango_cloud_calls_total Cloud calls by outcome (ok, degraded, budget_exhausted, no_key, "
                "breaker_open).",
                "# TYPE kibidango_cloud_calls_total counter",
                *(
                    f'kibidango_cloud_calls_total{{{m},outcome="{k}"}} {n}'
                    for k, n in counts.items()
                    if not k.startswith("retry_")
                ),
                "# HELP kibidango_cloud_retries_total Cloud attempts retried, by cause.",
                "# TYPE kibidango_cloud_retries_total counter",
                *(
                    f'kibidango_cloud_retries_total{{{m},cause="{k.removeprefix("retry_")}"}} {n}'
                    for k, n in counts.items()
                    if k.startswith("retry_")
                ),
                "# TYPE kibidango_cloud_breaker_open gauge",
                f"kibidango_cloud_breaker_open{{{m}}} {int(client.opened_at is not None)}",
            ]
        if cascade.ledger is not None:
            state = cascade.ledger.state()
            lines += [
                "# HELP kibidango_cloud_budget_limit_usd The cloud budget of the period.",
                "# TYPE kibidango_cloud_budget_limit_usd gauge",
                f'kibidango_cloud_budget_limit_usd{{{m},period="{state.period}"}} {state.limit_usd:.6f}',
                "# HELP kibidango_cloud_budget_spent_usd Settled spend of the period, every process sharing the "
                "ledger.",
                "# TYPE kibidango_cloud_budget_spent_usd gauge",
                f'kibidango_cloud_budget_spent_usd{{{m},period="{state.period}"}} {state.settled_usd:.6f}',
                "# TYPE kibidango_cloud_budget_reserved_usd gauge",
                f'kibidango_cloud_budget_reserved_usd{{{m},period="{state.period}"}} {state.reserved_usd:.6f}',
                "# TYPE kibidango_cloud_budget_left_usd gauge",
                f'kibidango_cloud_budget_left_usd{{{m},period="{state.period}"}} {state.left_usd:.6f}',
            ]
        return "\n".join(lines) + "\n"


def _le(edge: float) -> str:
    """A histogram bucket's ``le`` label."""
    return "+Inf" if edge == float("inf") else f"{edge:g}"


_CLOUD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


def scheduler_metrics(model: str, scheduler: Scheduler) -> str:
    lines = [
        "# HELP kibidango_queue_depth Requests waiting for the models.",
        "# TYPE kibidango_queue_depth gauge",
        f'kibidango_queue_depth{{model="{model}"}} {scheduler.waiting}',
        "# TYPE kibidango_queue_limit gauge",
        f'kibidango_queue_limit{{model="{model}"}} {scheduler.max_queue}',
        "# HELP kibidango_requests_in_flight Requests taken in and not finished (queued, decoding or at the cloud).",
        "# TYPE kibidango_requests_in_flight gauge",
        f'kibidango_requests_in_flight{{model="{model}"}} {scheduler.in_flight}',
        "# HELP kibidango_requests_refused_total Requests refused with 429 (queue full) or 503 (shutting down).",
        "# TYPE kibidango_requests_refused_total counter",
        *(
            f'kibidango_requests_refused_total{{model="{model}",reason="{r}"}} {n}'
            for r, n in scheduler.refused.items()
        ),
        "# HELP kibidango_requests_timed_out_total Requests cancelled at the server's request timeout (504).",
        "# TYPE kibidango_requests_timed_out_total counter",
        f'kibidango_requests_timed_out_total{{model="{model}"}} {scheduler.timed_out}',
        "# HELP kibidango_parallel Requests decoded together at most (--parallel).",
        "# TYPE kibidango_parallel gauge",
        f'kibidango_parallel{{model="{model}"}} {scheduler.parallel}',
    ]
    if scheduler.batcher is not None:
        stats = scheduler.batcher.stats
        lines += [
            "# HELP kibidango_batch_forwards_total Batched forward rounds (all tiers).",
            "# TYPE kibidango_batch_forwards_total counter",
            f'kibidango_batch_forwards_total{{model="{model}"}} {stats.forwards}',
            "# HELP kibidango_batch_feeds_total Requests' forward passes they carried (over forwards: the mean batch).",
            "# TYPE kibidango_batch_feeds_total counter",
            f'kibidango_batch_feeds_total{{model="{model}"}} {stats.feeds}',
        ]
    return "\n".join(lines) + "\n"
