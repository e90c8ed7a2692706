"""Prometheus metrics named like vLLM's (`chatserve:` instead of `vllm:`), so dashboards fit.

Each app owns its registry (no module globals), so two apps in one process do not collide.
Gauges and the prefix-cache counters are read from the engine's stats at scrape time; latency
histograms and token counters are observed by the routes as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chatserve.engine.async_engine import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# lease_expired: a detached run (streams/runs.py) that nobody read for its lease
ABORT_REASONS = ("client_disconnect", "cancel_endpoint", "engine", "lease_expired")


class _EngineCollector(Collector):
    """Reads the engine's snapshot (taken at the last step boundary) on every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"chatserve:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"chatserve:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        total = max(int(s.get("num_total_blocks", 0)), 1)
        held = total - int(s.get("num_free_blocks", total)) - int(s.get("num_cached_blocks", 0))
        yield gauge("num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (including not yet added).",
                    max(s.get("num_waiting", 0), s.get("num_live_requests", 0) - s.get("num_running", 0)))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (evictable cache excluded).",
                    max(held, 0) / total)
        yield gauge("kv_cache_cached_blocks", "KV blocks held only by the prefix cache (evictable).",
                    s.get("num_cached_blocks", 0))
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", s.get("num_total_blocks", 0))
        yield gauge("engine_healthy", "1 while the engine loop is alive.", 1.0 if s.get("is_healthy", True) else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries_tokens", 0))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.get("prefix_cache_hits_tokens", 0))
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", s.get("num_preemptions", 0))
        yield counter("prefill_tokens_computed", "Prompt tokens actually computed (cache hits excluded).",
                      s.get("num_prefill_tokens_computed", 0))
        spec = s.get("spec_decode")
        if spec is not None:  # speculative decoding on: vLLM's spec_decode_* counters
            yield counter("spec_decode_num_drafts", "Verifications that had draft tokens.", spec["num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", spec["num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec["num_accepted_tokens"])
            per_pos = CounterMetricFamily("chatserve:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted at each draft position.", labels=labels + ["position"])
            for pos, count in enumerate(spec["accepted_per_position"]):
                per_pos.add_metric(values + [str(pos)], count)
            yield per_pos
        misses = CounterMetricFamily("chatserve:prefix_cache_miss_reason",
                                     "Requests by why the prefix cache stopped where it did (none = full hit).",
                                     labels=labels + ["reason"])
        for reason, count in sorted((s.get("prefix_cache_miss_reasons") or {}).items()):
            misses.add_metric(values + [reason], count)
        yield misses
        yield gauge("batch_invariant",
                    "1 when every op of the forward pass is batch- and thread-invariant (greedy output the same alone, "
                    "batched, cached and with speculative drafts); 0 when a fallback breaks it (each logged at start).",
                    1.0 if s.get("batch_invariant") else 0.0)
        yield gauge("kv_cache_leased_blocks",
                    "Cached KV blocks on a branch a live lease protects (a session's or a prompt prefix's).",
                    s.get("num_leased_blocks", 0))
        yield counter("prefix_cache_lease_hits", "Requests whose cache hit ended on a leased branch.",
                      s.get("prefix_cache_lease_hits", 0))
        yield counter("prefix_cache_lease_hit_tokens", "Prompt tokens served by hits that ended on a leased branch.",
                      s.get("prefix_cache_lease_hit_tokens", 0))
        yield counter("prefix_cache_leased_evicted_blocks",
                      "Leased blocks evicted because nothing unleased was left (leases are soft).",
                      s.get("prefix_cache_leased_evicted_blocks", 0))
        yield gauge("kv_cache_prefix_leased_blocks",
                    "Cached KV blocks prompt-prefix leases protect (cache_control, prompt_cache_key); capped.",
                    s.get("num_prefix_leased_blocks", 0))
        yield gauge("kv_cache_prefix_leases", "Live prompt-prefix leases.", s.get("num_prefix_leases", 0))
        yield gauge("kv_cache_max_prefix_leased_blocks", "The cap on blocks prompt-prefix leases protect.",
                    s.get("max_prefix_leased_blocks", 0))
        yield counter("prefix_cache_prefix_leases_set", "Prompt-prefix leases set (or extended) by finished requests.",
                      s.get("prefix_cache_prefix_leases_set", 0))
        yield counter("prefix_cache_prefix_lease_renewals", "Prompt-prefix leases renewed by a cache hit on them.",
                      s.get("prefix_cache_prefix_lease_renewals", 0))
        yield counter("prefix_cache_prefix_leases_dropped",
                      "Prompt-prefix leases dropped, least recently renewed first, to stay within the cap.",
                      s.get("prefix_cache_prefix_leases_dropped", 0))
        yield counter("prefix_cache_prefix_leased_dropped_blocks",
                      "Blocks that stopped being leased when prompt-prefix leases were dropped for the cap.",
                      s.get("prefix_cache_prefix_leased_dropped_blocks", 0))
        offload = s.get("kv_offload")
        if offload:
            yield from _offload_metrics(offload, labels, values)


def _offload_metrics(offload: dict[str, Any], labels: list[str], values: list[str]) -> Iterator[Any]:
    """The KV tiers below the tree (engine/kv_tiering.py), one ``medium`` label value per tier."""
    tiers: dict[str, dict[str, Any]] = offload["tiers"]

    def per_tier(name: str, doc: str, key: str) -> CounterMetricFamily:
        c = CounterMetricFamily(f"chatserve:kv_offload_{name}", doc, labels=labels + ["medium"])
        for medium, t in sorted(tiers.items()):
            c.add_metric(values + [medium], t[key])
        return c

    yield per_tier("hit_blocks", "KV blocks loaded from the tier into the tree.", "hit_blocks")
    yield per_tier("miss_blocks", "Tier lookups that found no (valid) entry for the next block.", "miss_blocks")
    yield per_tier("read_bytes", "Bytes read from the tier (valid entries).", "read_bytes")
    yield per_tier("written_blocks", "KV blocks written to the tier.", "written_blocks")
    yield per_tier("written_bytes", "Bytes written to the tier.", "written_bytes")
    yield per_tier("read_seconds", "Seconds spent reading from the tier (the loader thread).", "read_seconds")
    yield per_tier("reads", "Read calls to the tier (read_seconds / reads is the mean latency).", "num_reads")
    yield per_tier("write_seconds", "Seconds spent writing to the tier (the writer thread).", "write_seconds")
    yield per_tier("write_errors", "Writes the tier refused or failed (full disk, Redis down).", "write_errors")
    yield per_tier("read_errors", "Reads the tier failed (counted as misses).", "read_errors")
    invalid = CounterMetricFamily("chatserve:kv_offload_invalid_entries",
                                  "Entries refused on read (truncated, foreign, corrupt, mismatch): counted misses.",
                                  labels=labels + ["medium", "reason"])
    for medium, t in sorted(tiers.items()):
        for reason, n in sorted(t["invalid_entries"].items()):
            invalid.add_metric(values + [medium, reason], n)
    yield invalid
    dropped = CounterMetricFamily("chatserve:kv_offload_dropped_blocks",
                                  "Block writes dropped because the write queue was full (back-pressure).", labels=labels)
    dropped.add_metric(values, offload["dropped_blocks"])
    yield dropped
    q = GaugeMetricFamily("chatserve:kv_offload_queue_bytes", "Bytes waiting in the tiers' write queue.", labels=labels)
    q.add_metric(values, offload["queued_bytes"])
    yield q
    up = GaugeMetricFamily("chatserve:kv_offload_tier_available", "1 while the tier answers (0: down, skipped).",
                           labels=labels + ["medium"])
    for medium, t in sorted(tiers.items()):
        up.add_metric(values + [medium], 1.0 if t["available"] else 0.0)
    yield up
    loads = CounterMetricFamily("chatserve:kv_offload_load_seconds",
                                "Seconds requests waited for tier lookups (loader thread, all tiers).", labels=labels)
    loads.add_metric(values, offload["load_seconds"])
    yield loads


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("chatserve:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("chatserve:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("chatserve:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("chatserve:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("chatserve:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter("chatserve:generation_tokens", "Generated tokens.", labels, registry=r)
        self.requests = Counter("chatserve:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.aborts = Counter("chatserve:request_aborts", "Aborted requests by cause.", labels + ["reason"], registry=r)
        for reason in ABORT_REASONS:
            self.aborts.labels(model_name, reason)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(model_name, reason)
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens):
            metric.labels(model_name)  # exported from the start, at zero
        self.http_errors = Counter("chatserve:http_errors", "Error responses by status.", labels + ["status"], registry=r)
        r.register(_EngineCollector(stats, model_name))

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        """A delta of num_tokens arrived seconds after the previous one: one ITL sample per token."""
        if num_tokens <= 0:
            return
        per = seconds / num_tokens
        h = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            h.observe(per)

    def observe_finished(self, m: RequestMetrics, finish_reason: str | None, abort_reason: str | None) -> None:
        name = self.model_name
        if m.time_to_first_token is not None:
            self.ttft.labels(name).observe(m.time_to_first_token)
        if m.latency is not None:
            self.e2e.labels(name).observe(m.latency)
        if m.queue_time is not None:
            self.queue_time.labels(name).observe(m.queue_time)
        self.prompt_tokens.labels(name).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(m.num_generated_tokens)
        self.requests.labels(name, finish_reason or "abort").inc()
        if finish_reason == "abort":
            self.aborts.labels(name, abort_reason or "engine").inc()

    def observe_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
