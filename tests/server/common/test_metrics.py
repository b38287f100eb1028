"""/metrics exposition: vLLM's metric names under the zhuzi: prefix, with the values recorded."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from zhuzi.outputs import EngineStats, KVTierStats, RequestMetrics, SpecDecodingStats, TenantLoad
from zhuzi.server.common.metrics import ServerMetrics
from zhuzi.server.common.quota import KeyUsage

MODEL = "SmolLM2-135M-Instruct"


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_metric_is_exposed_with_its_value() -> None:
    stats = EngineStats(num_running=2, num_waiting=1, num_pages=100, num_free_pages=75,
                        prefix_cache_queries=640, prefix_cache_hits=320)
    other = EngineStats(num_running=0, num_waiting=0, num_pages=100, num_free_pages=100,
                        prefix_cache_queries=16, prefix_cache_hits=0)
    metrics = ServerMetrics(lambda: {MODEL: {0: stats, 1: other}})
    timings = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                             last_token_time=12.0, finished_time=12.0, decode_step_times=[0.5, 0.5])
    metrics.observe_request(MODEL, timings, prompt_tokens=30, generation_tokens=3, finish_reasons=["stop"])
    metrics.observe_request(MODEL, None, prompt_tokens=7, generation_tokens=1, finish_reasons=["abort", "length"])
    got = samples(metrics)
    model = (("model_name", MODEL),)
    replica0, replica1 = (("model_name", MODEL), ("replica", "0")), (("model_name", MODEL), ("replica", "1"))
    assert got[("zhuzi:num_requests_running", replica0)] == 2
    assert got[("zhuzi:num_requests_waiting", replica0)] == 1
    assert got[("zhuzi:kv_cache_usage_perc", replica0)] == 0.25
    assert got[("zhuzi:prefix_cache_queries_total", replica0)] == 640
    assert got[("zhuzi:prefix_cache_hits_total", replica0)] == 320
    assert got[("zhuzi:num_requests_running", replica1)] == 0  # each replica's engine state under its label
    assert got[("zhuzi:prefix_cache_queries_total", replica1)] == 16
    assert got[("zhuzi:prompt_tokens_total", model)] == 37
    assert got[("zhuzi:generation_tokens_total", model)] == 4
    for reason in ("stop", "length", "abort"):
        assert got[("zhuzi:request_success_total", (("finished_reason", reason), ("model_name", MODEL)))] == 1
    expected_sums = {"time_to_first_token_seconds": 1.0, "e2e_request_latency_seconds": 2.0,
                     "request_queue_time_seconds": 0.5, "request_prefill_time_seconds": 0.5,
                     "request_decode_time_seconds": 1.0, "inter_token_latency_seconds": 1.0}
    for name, total in expected_sums.items():
        assert got[(f"zhuzi:{name}_sum", model)] == total, name
    assert got[("zhuzi:inter_token_latency_seconds_count", model)] == 2


def test_speculative_decoding_counters_have_vllms_names_and_meanings() -> None:
    spec = SpecDecodingStats()
    spec.observe(3, 2)  # a proposal of 3 tokens, the first 2 accepted
    spec.observe(3, 0)
    stats = EngineStats(1, 0, 10, 10, 0, 0, spec)
    got = samples(ServerMetrics(lambda: {MODEL: {0: stats}}))
    model = (("model_name", MODEL), ("replica", "0"))
    assert got[("zhuzi:spec_decode_num_drafts_total", model)] == 2
    assert got[("zhuzi:spec_decode_num_draft_tokens_total", model)] == 6
    assert got[("zhuzi:spec_decode_num_accepted_tokens_total", model)] == 2
    per_pos = {dict(labels)["position"]: v for (name, labels), v in got.items()
               if name == "zhuzi:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 1, "1": 1, "2": 0}
    without = samples(ServerMetrics(lambda: {MODEL: {0: EngineStats(1, 0, 10, 10, 0, 0)}}))
    assert not any(name.startswith("zhuzi:spec_decode") for name, _ in without)


def test_engine_gauges_are_absent_while_the_model_loads() -> None:
    names = {name for name, _ in samples(ServerMetrics(dict))}
    assert "zhuzi:num_requests_running" not in names
    assert "zhuzi:kv_cache_usage_perc" not in names


def test_each_keys_load_and_usage_are_labelled_by_its_masked_id() -> None:
    stats = EngineStats(3, 1, 10, 5, 0, 0, tenants=[TenantLoad("", 1, 0), TenantLoad("key-3fa9c01b2e4d", 2, 1)])
    usage = [KeyUsage("key-3fa9c01b2e4d", 1200, 5000), KeyUsage("key-77aa00ff11ee", 40, None)]
    got = samples(ServerMetrics(lambda: {MODEL: {0: stats}}, lambda: usage))
    labels = (("key", "key-3fa9c01b2e4d"), ("model_name", MODEL), ("replica", "0"))
    assert (got[("zhuzi:tenant_requests_running", labels)], got[("zhuzi:tenant_requests_waiting", labels)]) == (2, 1)
    assert not any(dict(key).get("key") == "" for _, key in got)  # a server without keys: the totals say it all
    assert got[("zhuzi:key_tokens_used_today", (("key", "key-3fa9c01b2e4d"),))] == 1200
    assert got[("zhuzi:key_quota_tokens_per_day", (("key", "key-3fa9c01b2e4d"),))] == 5000
    assert got[("zhuzi:key_tokens_used_today", (("key", "key-77aa00ff11ee"),))] == 40
    assert ("zhuzi:key_quota_tokens_per_day", (("key", "key-77aa00ff11ee"),)) not in got


def test_kv_tiers_pins_and_transfers_are_counted_per_replica_and_tier() -> None:
    stats = EngineStats(0, 0, 10, 6, 64, 16, kv_tiers={
        "host": KVTierStats(pages=3, bytes=3072, hit_tokens=48, stored=5, evicted=2),
        "disk": KVTierStats(pages=9, bytes=9300, hit_tokens=16, stored=9, refused=1)},
        num_pins=1, pinned_pages=4, pinned_bytes=4096, kv_transfers_sent=2, kv_transfer_pages_sent=12)
    decode = EngineStats(0, 0, 10, 10, 0, 0, kv_transfers_received=1, kv_transfers_failed=1,
                         kv_transfer_pages_received=12)
    got = samples(ServerMetrics(lambda: {MODEL: {0: stats, 1: decode}}))
    replica0, replica1 = (("model_name", MODEL), ("replica", "0")), (("model_name", MODEL), ("replica", "1"))
    host, disk = replica0 + (("tier", "host"),), replica0 + (("tier", "disk"),)
    assert got[("zhuzi:kv_offload_hits_total", host)] == 48 and got[("zhuzi:kv_offload_hits_total", disk)] == 16
    assert got[("zhuzi:kv_offload_blocks", host)] == 3 and got[("zhuzi:kv_offload_bytes", disk)] == 9300
    assert got[("zhuzi:kv_offload_evicted_total", host)] == 2 and got[("zhuzi:kv_offload_refused_total", disk)] == 1
    assert got[("zhuzi:kv_pins", replica0)] == 1 and got[("zhuzi:kv_pinned_bytes", replica0)] == 4096
    assert got[("zhuzi:kv_transfers_sent_total", replica0)] == 2
    assert got[("zhuzi:kv_transfers_received_total", replica1)] == 1
    assert got[("zhuzi:kv_transfers_failed_total", replica1)] == 1
    assert got[("zhuzi:kv_transfer_blocks_received_total", replica1)] == 12
    assert not any(name.startswith("zhuzi:kv_offload") and dict(labels)["replica"] == "1" for name, labels in got)
