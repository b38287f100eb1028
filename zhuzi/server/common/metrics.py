"""The last step of a request's life: its timings and counts in Prometheus form at /metrics, named as vLLM's
(zhuzi: for vllm:). Per-request histograms are recorded as requests end; the engine's state is read from each
replica's stats at scrape time; per API key (masked): its running and waiting sequences and today's tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from zhuzi.outputs import EngineStats, RequestMetrics
from zhuzi.server.common.quota import KeyUsage

PREFIX = "zhuzi:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LABELS = ["model_name"]
ENGINE_LABELS = ["model_name", "replica"]

disable_created_metrics()  # the *_created series only double the scrape size


class EngineCollector(Collector):
    """Gauges and cumulative counters that the engine itself keeps."""

    def __init__(self, engine_state: Callable[[], dict[str, dict[int, EngineStats]]]) -> None:
        self.engine_state = engine_state  # each loaded model's replicas' stats

    def collect(self) -> Iterator[Metric]:
        replicas = [(model, replica, stats) for model, states in self.engine_state().items()
                    for replica, stats in sorted(states.items())]
        families = [
            (GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", "num_running"),
            (GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).",
             "kv_cache_usage"),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            (GaugeMetricFamily, "kv_pins", "Pinned prefixes.", "num_pins"),
            (GaugeMetricFamily, "kv_pinned_blocks", "KV pool pages held by pinned prefixes.", "pinned_pages"),
            (GaugeMetricFamily, "kv_pinned_bytes", "KV pool bytes held by pinned prefixes.", "pinned_bytes"),
            (CounterMetricFamily, "kv_transfers_sent", "Prefill/decode hand-offs: requests whose KV pages this "
             "replica sent.", "kv_transfers_sent"),
            (CounterMetricFamily, "kv_transfers_received", "Prefill/decode hand-offs received.",
             "kv_transfers_received"),
            (CounterMetricFamily, "kv_transfers_failed", "Hand-offs that never arrived: the decode replica "
             "computed the prompt itself.", "kv_transfers_failed"),
            (CounterMetricFamily, "kv_transfer_blocks_sent", "KV pages sent to decode replicas.",
             "kv_transfer_pages_sent"),
            (CounterMetricFamily, "kv_transfer_blocks_received", "KV pages received from prefill replicas.",
             "kv_transfer_pages_received"),
        ]
        yield from families_of(families, ENGINE_LABELS,
                               [([model, str(replica)], stats) for model, replica, stats in replicas])
        yield from self._tenants(replicas)
        yield from self._spec_decoding(replicas)
        # Each KV tier (host, disk) of each replica, labelled tier="host" or "disk" (and "host_states": a hybrid
        # model's cached states in host memory).
        yield from families_of([
            (CounterMetricFamily, "kv_offload_hits", "Prompt tokens loaded from a KV tier instead of computed.",
             "hit_tokens"),
            (GaugeMetricFamily, "kv_offload_blocks", "KV pages held in a tier.", "pages"),
            (GaugeMetricFamily, "kv_offload_bytes", "Bytes of KV pages held in a tier.", "bytes"),
            (CounterMetricFamily, "kv_offload_stored", "KV pages put into a tier.", "stored"),
            (CounterMetricFamily, "kv_offload_evicted", "KV pages a tier let go to make room.", "evicted"),
            (CounterMetricFamily, "kv_offload_refused", "Page files skipped: corrupt, foreign or unreadable.",
             "refused"),
            (CounterMetricFamily, "kv_offload_dropped", "Pages not stored: no room (all pinned) or the disk "
             "writer behind.", "dropped"),
        ], ENGINE_LABELS + ["tier"], [([model, str(replica), name], tier) for model, replica, stats in replicas
                                      for name, tier in sorted(stats.kv_tiers.items())])

    @staticmethod
    def _tenants(replicas: list[tuple[str, int, EngineStats]]) -> Iterator[Metric]:
        """Each API key's sequences (a server without keys has one anonymous tenant: the totals say it all)."""
        yield from families_of([
            (GaugeMetricFamily, "tenant_requests_running", "Sequences running, per API key.", "running"),
            (GaugeMetricFamily, "tenant_requests_waiting", "Sequences waiting, per API key.", "waiting"),
        ], ENGINE_LABELS + ["key"], [([model, str(replica), load.tenant], load)
                                     for model, replica, stats in replicas for load in stats.tenants
                                     if load.tenant])

    @staticmethod
    def _spec_decoding(replicas: list[tuple[str, int, EngineStats]]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, for the replicas that speculate."""
        specs = {(model, replica): stats.spec_decoding for model, replica, stats in replicas
                 if stats.spec_decoding is not None}
        yield from families_of([
            (CounterMetricFamily, "spec_decode_num_drafts", "Speculative proposals verified (one per sequence and "
             "step).", "num_drafts"),
            (CounterMetricFamily, "spec_decode_num_draft_tokens", "Tokens proposed.", "num_draft_tokens"),
            (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
             "num_accepted_tokens"),
        ], ENGINE_LABELS, [([model, str(replica)], spec) for (model, replica), spec in specs.items()])
        if not specs:
            return
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Proposals whose token at this position was accepted.",
                                      labels=ENGINE_LABELS + ["position"])
        for (model, replica), spec in specs.items():
            for position, value in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([model, str(replica), str(position)], value)
        yield per_pos


class QuotaCollector(Collector):
    """Each key's tokens used today and its daily quota."""

    def __init__(self, usage: Callable[[], list[KeyUsage]]) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(PREFIX + "key_tokens_used_today", "Prompt + generated tokens used today (UTC), "
                                 "per API key.", labels=["key"])
        limit = GaugeMetricFamily(PREFIX + "key_quota_tokens_per_day", "Daily token quota, per API key.",
                                  labels=["key"])
        for row in self.usage():
            used.add_metric([row.key_id], row.used)
            if row.limit is not None:
                limit.add_metric([row.key_id], row.limit)
        yield used
        yield limit
def families_of(specs: list[tuple[type, str, str, str]], labels: list[str],
                rows: list[tuple[list[str], object]]) -> Iterator[Metric]:
    """A metric per (family, name, doc, attribute) spec, with a sample per row (label values, the object whose
    attribute it reads); none while there are no rows."""
    if not rows:
        return
    for family, name, doc, attribute in specs:
        metric = family(PREFIX + name, doc, labels=labels)
        for values, source in rows:
            metric.add_metric(values, getattr(source, attribute))
        yield metric


class ServerMetrics:
    def __init__(self, engine_state: Callable[[], dict[str, dict[int, EngineStats]]],
                 usage: Callable[[], list[KeyUsage]] = list) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counter(name: str, doc: str, labels: list[str] = LABELS) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       LABELS + ["finished_reason"])
        self.registry.register(EngineCollector(engine_state))
        self.registry.register(QuotaCollector(usage))

    def observe_request(self, model: str, metrics: RequestMetrics | None, prompt_tokens: int,
                        generation_tokens: int, finish_reasons: list[str]) -> None:
        """Record one ended request (finished or aborted)."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(model, reason).inc()
        if metrics is None:
            return
        timings = [(self.time_to_first_token, metrics.time_to_first_token), (self.e2e_latency, metrics.e2e_latency),
                   (self.queue_time, metrics.queue_time), (self.prefill_time, metrics.prefill_time),
                   (self.decode_time, metrics.decode_time)]
        for histogram, seconds in timings:
            if seconds is not None:
                histogram.labels(model).observe(seconds)
        for seconds in metrics.decode_step_times:
            self.inter_token_latency.labels(model).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
