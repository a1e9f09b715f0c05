"""The gateway's /metrics through ``prometheus_client``: request latencies as histograms, and the counters and
gauges that the processes report (the gateway's own, the cache daemon's, each encoder's, fetcher's and decoder
replica's) through a collector that types and describes them by ``CATALOGUE``. Each gateway has its own registry,
so that two in one process never share a series."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The series stay those this endpoint has always served: no ``*_created`` beside each histogram.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")

# What each value a process reports means, by its family name (without ``_total``): counter or gauge, and the
# HELP line. A value reported under a name not listed here renders as a gauge ("_total": a counter) with a
# HELP that says it is undocumented; tests/integration/test_errors.py checks that none is.
CATALOGUE: dict[str, tuple[str, str]] = {
    # the gateway
    "vlm_gateway_requests": ("counter", "Completion requests that passed validation (one per HTTP request)."),
    "vlm_gateway_requests_failed": ("counter", "Of those, requests answered with an error."),
    "vlm_gateway_requests_disconnected": ("counter", "Requests whose client went away before the answer ended."),
    "vlm_gateway_requests_refused_busy": (
        "counter",
        "Requests refused at once (503) past the in-flight limits or the queue wait (max_queue_wait_s).",
    ),
    "vlm_gateway_tokens_generated": ("counter", "Tokens sent to clients."),
    "vlm_gateway_requests_in_flight": ("gauge", "Prompts and choices in the pipeline (fetcher or decoder)."),
    "vlm_gateway_requests_reissued": (
        "counter",
        "Requests sent again after their decoder replica was lost before their first token.",
    ),
    "vlm_gateway_requests_restarted": (
        "counter",
        "Of the requests sent again, non-streamed ones whose tokens had begun to come (dropped, never sent).",
    ),
    "vlm_gateway_requests_held": ("gauge", "Requests lost with their replica, waiting for a live one."),
    "vlm_gateway_requests_waiting_first_answer": (
        "gauge",
        "Admitted requests with no first answer yet: the line that load shedding (max_queue_wait_s) judges.",
    ),
    "vlm_gateway_first_answers_per_s_best": (
        "gauge",
        "The best first-answer rate of any 5 busy seconds of the last minute (0 before 10 busy seconds): what load "
        "shedding rates the stack at.",
    ),
    "vlm_gateway_replicas_lost": (
        "counter",
        "Times a decoder replica was taken for lost: silent for [liveness] dead_after_s, or back as a new process.",
    ),
    "vlm_gateway_replica_requests_in_flight": ("gauge", "Requests the gateway has at this decoder replica."),
    "vlm_gateway_replica_requests_routed": ("counter", "Requests the gateway sent to this decoder replica."),
    "vlm_gateway_replica_fallback_requests": (
        "counter",
        "Requests this replica took while every replica of their kind (text, media) was down.",
    ),
    "vlm_gateway_replica_reissued_requests": ("counter", "Requests sent again after this replica was lost."),
    # the embedding cache daemon
    "vlm_cache_hits": ("counter", "Lookups that found the embeddings computed."),
    "vlm_cache_pending_hits": ("counter", "Lookups that found the embeddings being computed for another request."),
    "vlm_cache_misses": ("counter", "Lookups that reserved a slot for an encoder to fill."),
    "vlm_cache_commits": ("counter", "Slots an encoder filled."),
    "vlm_cache_writes": ("counter", "Embeddings sent by value by encoders on tcp:// endpoints, written here."),
    "vlm_cache_written_bytes": ("counter", "Bytes of the embeddings sent by value, written here."),
    "vlm_cache_evictions": ("counter", "Entries evicted (least recently used first) to make room."),
    "vlm_cache_spills": ("counter", "Entries moved from the GPU pool to the host spill tier."),
    "vlm_cache_failed": ("counter", "Reserved slots whose encode failed or expired."),
    "vlm_cache_full": ("counter", "Reservations refused after waiting [cache] reserve_wait_s for room."),
    "vlm_cache_waited": ("counter", "Requests whose reservation found no room at first and waited for it."),
    "vlm_cache_reservations_waiting": ("gauge", "Requests waiting for room in the embedding pool now."),
    "vlm_cache_entries": ("gauge", "Embeddings held, computed or pending."),
    "vlm_cache_pending_entries": ("gauge", "Reserved slots waiting for an encoder."),
    "vlm_cache_spilled_entries": ("gauge", "Entries in the host spill tier."),
    "vlm_cache_bytes_used": ("gauge", "Bytes of the embedding pool in use."),
    "vlm_cache_bytes_capacity": ("gauge", "Bytes of the embedding pool."),
    "vlm_cache_spill_bytes_used": ("gauge", "Bytes of the host spill tier in use."),
    "vlm_cache_spill_bytes_capacity": ("gauge", "Bytes of the host spill tier (0: none)."),
    "vlm_cache_leased_requests": ("gauge", "Requests holding leases on embeddings."),
    # each vision encoder
    "vlm_encoder_images_encoded": ("counter", "Images and video chunks encoded."),
    "vlm_encoder_patches_encoded": ("counter", "Vision patches encoded."),
    "vlm_encoder_batches": ("counter", "Forwards of the vision tower (each packs jobs of several requests)."),
    "vlm_encoder_failures": ("counter", "Encode jobs that failed."),
    "vlm_encoder_busy_seconds": ("counter", "Wall time spent encoding batches."),
    "vlm_encoder_queue_wait_seconds": ("counter", "Time jobs waited at the encoder before their batch began, summed."),
    "vlm_encoder_jobs_queued": ("gauge", "Jobs waiting at the encoder for a batch."),
    # each media fetcher
    "vlm_fetcher_items_loaded": ("counter", "Images and videos downloaded (or read from data URLs) and preprocessed."),
    "vlm_fetcher_items_shared": ("counter", "Items asked for again while loading, loaded once for all."),
    "vlm_fetcher_items_remembered": (
        "counter",
        "Images known by their bytes from an earlier request (the same processing): not decoded or resized again.",
    ),
    "vlm_fetcher_items_decoded_again": (
        "counter",
        "Remembered images decoded again because the embedding cache no longer held them.",
    ),
    "vlm_fetcher_load_seconds": ("counter", "Time spent loading and preprocessing items, summed over threads."),
    "vlm_fetcher_thread_wait_seconds": ("counter", "Time items waited for a fetch thread, summed."),
    "vlm_fetcher_encode_jobs": ("counter", "Encode jobs sent to the vision encoders."),
    "vlm_fetcher_requests_failed": ("counter", "Requests failed at the fetcher (bad or unreachable media)."),
    "vlm_fetcher_requests_in_flight": ("gauge", "Requests whose media the fetcher is preparing."),
    "vlm_fetcher_encode_jobs_queued": ("gauge", "Encode jobs waiting for a live encoder with a free credit."),
    "vlm_fetcher_encode_jobs_at_encoders": ("gauge", "Encode jobs sent to an encoder and not yet answered."),
    "vlm_fetcher_encoders_live": ("gauge", "Vision encoders this fetcher sees live."),
    # each decoder replica
    "vlm_decoder_prompt_tokens": ("counter", "Prompt tokens scheduled for prefill (a preempted prompt counts again)."),
    "vlm_decoder_generated_tokens": ("counter", "Tokens sampled."),
    "vlm_decoder_requests_finished": ("counter", "Sequences finished."),
    "vlm_decoder_preemptions": ("counter", "Sequences preempted (their KV blocks freed, recomputed later)."),
    "vlm_decoder_steps": ("counter", "Engine steps."),
    "vlm_decoder_graph_steps": ("counter", "Steps replayed from a CUDA graph."),
    "vlm_decoder_overlapped_steps": ("counter", "Steps staged while the previous one ran."),
    "vlm_decoder_overlapped_mixed_steps": ("counter", "Overlapped steps with prefill chunks or arrivals."),
    "vlm_decoder_decode_graph_steps": ("counter", "Steps replayed from a decode graph."),
    "vlm_decoder_decode_launch_seconds": ("counter", "Host time building and launching decode-graph steps."),
    "vlm_decoder_other_launch_seconds": ("counter", "Host time building and launching every other step."),
    "vlm_decoder_token_wait_seconds": ("counter", "Host time blocked on sampled tokens (near none: host-bound)."),
    "vlm_decoder_grammar_rows": ("counter", "Constrained rows sampled (a grammar bitmask filled for each)."),
    "vlm_decoder_grammar_fill_seconds": ("counter", "Host time filling grammar bitmasks."),
    "vlm_decoder_prefix_queries_tokens": ("counter", "Prompt tokens looked up in the prefix cache."),
    "vlm_decoder_prefix_hit_tokens": ("counter", "Prompt tokens served from the prefix cache."),
    "vlm_decoder_prefix_hit_blocks": ("counter", "KV blocks served from the prefix cache."),
    "vlm_decoder_prefix_revived_blocks": ("counter", "Prefix-cache hits on free cached blocks."),
    "vlm_decoder_prefix_conflicts": ("counter", "Blocks whose prefix digest another block had taken."),
    "vlm_decoder_blocks_allocated": ("counter", "Fresh KV blocks handed out."),
    "vlm_decoder_blocks_registered": ("counter", "KV blocks entered in the prefix cache."),
    "vlm_decoder_blocks_evicted_from_cache": ("counter", "Cached KV blocks evicted for reuse."),
    "vlm_decoder_tables_allocated": ("counter", "Block tables allocated (one per sequence admitted)."),
    "vlm_decoder_tables_freed": ("counter", "Block tables freed."),
    "vlm_decoder_kv_blocks_capacity": ("gauge", "KV cache blocks."),
    "vlm_decoder_kv_blocks_used": ("gauge", "KV cache blocks in use."),
    "vlm_decoder_kv_usage": ("gauge", "Share of the KV cache blocks in use (0 to 1)."),
    "vlm_decoder_requests_waiting_for_media": ("gauge", "Requests waiting for their embeddings."),
    "vlm_decoder_requests_waiting_for_grammar": ("gauge", "Requests waiting for their grammar to compile."),
    "vlm_decoder_requests_queued": ("gauge", "Requests waiting for a decoding slot or KV blocks."),
    "vlm_decoder_requests_running": ("gauge", "Sequences decoding."),
    **{
        f"vlm_{role}_security_denied": (
            "counter",
            "CurveZMQ clients this process's tcp:// sockets turned away (no key, an unknown key, plaintext).",
        )
        for role in ("gateway", "cache", "encoder", "decoder")  # (the processes that bind sockets)
    },
}
UNDOCUMENTED = "Not described in gateway/metrics.py."


def family_name(prefix: str, key: str) -> str:
    """A reported key's family: ``_s`` (seconds, in the processes' own counters) spelt ``_seconds``."""
    name = f"{prefix}_{_NOT_NAME.sub('_', key)}".removesuffix("_total")
    return name[: -len("_s")] + "_seconds" if name.endswith("_s") else name


@dataclass
class Reported:
    """Values one kind of process reported: ``values`` as they came, or with ``label``, one dict of them per
    label value (a series each)."""

    prefix: str
    values: dict[str, float] | dict[str, dict[str, float]]
    label: str = ""


def value_families(reported: Reported) -> Iterator[Metric]:
    """Plain values as metric families, typed and described by ``CATALOGUE``."""
    label = reported.label
    series: dict[str, dict[str, float]] = reported.values if label else {"": reported.values}  # type: ignore[assignment]
    for key in sorted({key for each in series.values() for key in each}):
        family = family_name(reported.prefix, key)
        kind, help_text = CATALOGUE.get(family, ("counter" if key.endswith("_total") else "gauge", UNDOCUMENTED))
        make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        metric = make(family, help_text, labels=[label] if label else None)
        for label_value, each in series.items():
            if key in each:
                metric.add_metric([label_value] if label else [], float(each[key]))
        yield metric


class ReportedValues(Collector):
    """The processes' counters and gauges, as they were when the scrape asked for them (``GatewayMetrics.scrape``
    sets them, then collects at once)."""

    def __init__(self) -> None:
        self.reported: list[Reported] = []

    def collect(self) -> Iterator[Metric]:
        for each in self.reported:
            yield from value_families(each)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vlm_time_to_first_token_seconds", "Time from request to its first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "vlm_inter_token_latency_seconds", "Time between a choice's token batches.", TOKEN_GAP_BUCKETS
        )
        self.e2e = histogram("vlm_e2e_request_latency_seconds", "Time from request to its last token.", LATENCY_BUCKETS)
        self.queue = histogram(
            "vlm_request_queue_seconds", "Time a request waited in the decoder for a slot.", LATENCY_BUCKETS
        )
        # The stages of a request with images or videos, so that a slow first token can be placed.
        self.media_prepare = histogram(
            "vlm_media_prepare_seconds",
            "Time from request to its media downloaded, preprocessed and handed to the decoder.",
            LATENCY_BUCKETS,
        )
        self.media_wait = histogram(
            "vlm_media_wait_seconds", "Time a request waited in the decoder for its embeddings.", LATENCY_BUCKETS
        )
        self.values = ReportedValues()
        self.registry.register(self.values)

    def scrape(self, reported: list[Reported]) -> bytes:
        """The Prometheus text exposition of the histograms and of ``reported``."""
        self.values.reported = reported
        try:
            return generate_latest(self.registry)
        finally:
            self.values.reported = []
