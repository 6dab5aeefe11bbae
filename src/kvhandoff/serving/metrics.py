"""The server's Prometheus metrics, in a registry of their own (one per engine, so several engines never share
counters). `GET /metrics` renders it in Prometheus' text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: buckets of the time-to-first-token histograms, in seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServingMetrics:
    """Counters, gauges and histograms of one engine.

    kvhandoff_handoffs_total{from,to,status}: switches of model (status applied | escalated | fallback, or reprefill:
    the request asked to re-prefill instead of mapping); kvhandoff_mapped_tokens_total{from,to}: cached positions mapped
    between models; kvhandoff_prefill_tokens_avoided_total{kind}: prompt tokens served from a cache instead of prefilled
    (kind own | mapped | offset: a run of the history reused at another offset);
    kvhandoff_time_to_first_token_seconds{status}: request arrival to the first token's distribution (status applied |
    escalated | fallback | reprefill | none); kvhandoff_live_sessions, kvhandoff_cache_bytes: gauges read at scrape
    time; kvhandoff_evictions_total{reason}: sessions dropped (memory | ttl | sessions);
    kvhandoff_guard_fallbacks_total{from,to}; kvhandoff_guard_escalations_total{from,to};
    kvhandoff_requests_total{endpoint,outcome}; kvhandoff_cancelled_total: generations cancelled by a client that went
    away; kvhandoff_healed_positions_total{model} and kvhandoff_heal_seconds_total{model}: approximate rows a model
    read again on its own in idle time (`healing`), and the seconds it took.

    The prefix cache (`track_prefix_cache`), per model, read at scrape time: kvhandoff_prefix_cache_bytes,
    kvhandoff_prefix_cache_nodes; kvhandoff_prefix_cache_hits_total{model,kind} (kind own | mapped: the model's
    own rows or mapped ones served the longest prefix); kvhandoff_prefix_cache_misses_total;
    kvhandoff_prefix_cache_handoff_candidates_total (another model held a longer exact prefix);
    kvhandoff_prefix_cache_evictions_total and kvhandoff_prefix_cache_evicted_bytes_total.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.handoffs = Counter("kvhandoff_handoffs", "Conversations switched between models",
                                ["from", "to", "status"], registry=r)
        self.mapped_tokens = Counter("kvhandoff_mapped_tokens", "Cached positions mapped between models",
                                     ["from", "to"], registry=r)
        self.prefill_avoided = Counter("kvhandoff_prefill_tokens_avoided",
                                       "Prompt tokens served from a cache instead of prefilled", ["kind"], registry=r)
        self.ttft = Histogram("kvhandoff_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token's distribution", ["status"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.live_sessions = Gauge("kvhandoff_live_sessions", "Sessions holding state", registry=r)
        self.cache_bytes = Gauge("kvhandoff_cache_bytes", "Bytes of KV cache held across sessions", registry=r)
        self.evictions = Counter("kvhandoff_evictions", "Sessions dropped", ["reason"], registry=r)
        self.guard_fallbacks = Counter("kvhandoff_guard_fallbacks",
                                       "Mapped caches the quality guard rejected (the model re-prefilled)",
                                       ["from", "to"], registry=r)
        self.guard_escalations = Counter("kvhandoff_guard_escalations",
                                         "Mapped caches the quality guard rejected (handed over again with a larger "
                                         "recompute budget)", ["from", "to"], registry=r)
        self.requests = Counter("kvhandoff_requests", "Requests answered", ["endpoint", "outcome"], registry=r)
        self.cancelled = Counter("kvhandoff_cancelled", "Generations cancelled by a client that went away",
                                 registry=r)
        self.healed = Counter("kvhandoff_healed_positions", "Approximate cached positions a model read again on its "
                              "own in idle time", ["model"], registry=r)
        self.heal_seconds = Counter("kvhandoff_heal_seconds", "Seconds models spent healing", ["model"], registry=r)

    def track(self, sessions, cache_bytes) -> None:
        """Read the live-session count and the cache bytes from these callables at every scrape."""
        self.live_sessions.set_function(sessions)
        self.cache_bytes.set_function(cache_bytes)

    def track_prefix_cache(self, stats) -> None:
        """Read the prefix cache's per-model figures from ``stats()`` (a `prefix_tree_stats.TreeStats`) at every
        scrape."""
        self.registry.register(_PrefixCacheCollector(stats))

    def record_first_token(self, report: dict, seconds: float) -> None:
        """Count one request's handoff report (`engine.TurnReport.to_dict()`) and its time to first token."""
        status = report["status"]
        source, target = report["from"] or "", report["to"]
        self.ttft.labels(status=status).observe(seconds)
        if status in ("applied", "escalated", "fallback", "reprefill"):
            self.handoffs.labels(source, target, status).inc()
        if status in ("applied", "escalated", "fallback"):
            self.mapped_tokens.labels(source, target).inc(report["mapped_tokens"])
        if status == "fallback":
            self.guard_fallbacks.labels(source, target).inc()
        if status == "escalated":
            self.guard_escalations.labels(source, target).inc()
        cached = report["cached_tokens"]
        if report.get("reuse") == "offset":  # the run reused, and the model's own rows of the beginning
            self.prefill_avoided.labels(kind="offset").inc(report["approximate_tokens"])
            if cached > report["approximate_tokens"]:
                self.prefill_avoided.labels(kind="own").inc(cached - report["approximate_tokens"])
            return
        mapped = report["mapped_tokens"] if status in ("applied", "escalated") else 0
        if mapped:
            self.prefill_avoided.labels(kind="mapped").inc(mapped)
        if cached - mapped > 0:
            self.prefill_avoided.labels(kind="own").inc(cached - mapped)

    def record_heal(self, model: str, positions: int, seconds: float) -> None:
        """``model`` healed ``positions`` in ``seconds``."""
        self.healed.labels(model=model).inc(positions)
        self.heal_seconds.labels(model=model).inc(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCacheCollector:
    """The prefix tree's per-model figures as Prometheus families, read when scraped."""

    def __init__(self, stats) -> None:
        self._stats = stats

    def describe(self):
        return []  # read at scrape time only (no figures at registration)

    def collect(self):
        models = self._stats().models
        gauges = {"bytes": "Bytes of K/V the prefix cache holds",
                  "nodes": "Prefix-cache nodes holding the model's rows"}
        counters = {"misses": "Prefix-cache lookups nothing served",
                    "handoff_candidates": "Prefix-cache lookups where another model held a longer exact prefix",
                    "evictions": "Prefix-cache payloads evicted", "evicted_bytes": "Prefix-cache bytes evicted"}
        for name, text in gauges.items():
            family = GaugeMetricFamily(f"kvhandoff_prefix_cache_{name}", text, labels=["model"])
            for model, figures in models.items():
                family.add_metric([model], getattr(figures, name))
            yield family
        hits = CounterMetricFamily("kvhandoff_prefix_cache_hits", "Prefix-cache lookups served from cached rows",
                                   labels=["model", "kind"])
        for model, figures in models.items():
            hits.add_metric([model, "own"], figures.hits_own)
            hits.add_metric([model, "mapped"], figures.hits_mapped)
        yield hits
        for name, text in counters.items():
            family = CounterMetricFamily(f"kvhandoff_prefix_cache_{name}", text, labels=["model"])
            for model, figures in models.items():
                family.add_metric([model], getattr(figures, name))
            yield family
