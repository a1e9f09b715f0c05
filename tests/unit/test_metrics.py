"""Unit tests for ``gateway/metrics.py``: /metrics through prometheus_client, one registry per gateway."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import CATALOGUE, GatewayMetrics, Reported


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_a_scrape_parses_with_the_series_it_always_had() -> None:
    metrics = GatewayMetrics()
    metrics.ttft.observe(0.3)
    metrics.itl.observe(0.003)
    text = metrics.scrape([Reported("vlm_gateway", {"requests_total": 2.0, "requests_in_flight": 1.0})])
    found = families(text)
    histograms = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue")
    for name in [f"vlm_{h}_seconds" for h in histograms] + ["vlm_media_prepare_seconds", "vlm_media_wait_seconds"]:
        assert found[name].type == "histogram", name
    ttft = {(s.name, s.labels.get("le")): s.value for s in found["vlm_time_to_first_token_seconds"].samples}
    assert ttft["vlm_time_to_first_token_seconds_bucket", "0.25"] == 0
    assert ttft["vlm_time_to_first_token_seconds_bucket", "0.5"] == 1
    assert ttft["vlm_time_to_first_token_seconds_count", None] == 1
    assert b"_created" not in text
    assert found["vlm_gateway_requests"].type == "counter"
    assert found["vlm_gateway_requests"].documentation == CATALOGUE["vlm_gateway_requests"][1]
    assert b"\nvlm_gateway_requests_total 2.0\n" in text
    assert found["vlm_gateway_requests_in_flight"].type == "gauge"


def test_two_gateways_in_one_process_keep_their_own_series() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.e2e.observe(1.0)
    count = "vlm_e2e_request_latency_seconds_count"
    assert f"\n{count} 1.0\n".encode() in first.scrape([])
    assert f"\n{count} 0.0\n".encode() in second.scrape([])


def test_values_are_reported_for_one_scrape_only() -> None:
    metrics = GatewayMetrics()
    assert b"vlm_cache_hits_total" in metrics.scrape([Reported("vlm_cache", {"hits": 3.0})])
    assert b"vlm_cache_hits_total" not in metrics.scrape([])
