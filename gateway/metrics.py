"""Prometheus text exposition for the gateway: request latencies as histograms, stage counters as
counters and gauges. Small enough not to need a client library; tests parse it with one."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip([*self.buckets, float("inf")], self.counts, strict=True):
            cumulative += n
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{label}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {self.count}"]
        return lines


_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")

# What each value a process reports means, by its family name (without ``_total``): counter or gauge, and the
# HELP line. A value reported under a name not listed here renders as a gauge ("_total": a counter) with a
# HELP that says it is undocumented; tests/integration/test_errors.py checks that none is.
CATALOGUE: dict[str, tuple[str, str]] = {
    # the gateway
    "vlm_gateway_requests": ("counter", "Completion requests that passed validation (one per HTTP request)."),
    "vlm_gateway_requests_failed": ("counter", "Of those, requests answered with an error."),
    "vlm_gateway_requests_disconnected": ("counter", "Requests whose client went away before the answer ended."),
    "vlm_gateway_requests_refused_busy": ("counter", "Requests refused at once (503) past the in-flight limits."),
    "vlm_gateway_tokens_generated": ("counter", "Tokens sent to clients."),
    "vlm_gateway_requests_in_flight": ("gauge", "Prompts and choices in the pipeline (fetcher or decoder)."),
    "vlm_gateway_requests_reissued": (
        "counter",
        "Requests sent again after their decoder replica was lost before their first token.",
    ),
    "vlm_gateway_requests_held": ("gauge", "Requests lost with their replica, waiting for a live one."),
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
    "vlm_cache_evictions": ("counter", "Entries evicted (least recently used first) to make room."),
    "vlm_cache_spills": ("counter", "Entries moved from the GPU pool to the host spill tier."),
    "vlm_cache_failed": ("counter", "Reserved slots whose encode failed or expired."),
    "vlm_cache_full": ("counter", "Reservations refused because nothing evictable would make room."),
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
    "vlm_decoder_requests_queued": ("gauge", "Requests waiting for a decoding slot or KV blocks."),
    "vlm_decoder_requests_running": ("gauge", "Sequences decoding."),
}
UNDOCUMENTED = "Not described in gateway/metrics.py."


def family_name(prefix: str, key: str) -> str:
    """A reported key's family: ``_s`` (seconds, in the processes' own counters) spelt ``_seconds``."""
    name = f"{prefix}_{_NOT_NAME.sub('_', key)}".removesuffix("_total")
    return name[: -len("_s")] + "_seconds" if name.endswith("_s") else name


def render_values(prefix: str, values: dict[str, float] | dict[str, dict[str, float]], label: str = "") -> list[str]:
    """Plain values, typed and described by ``CATALOGUE``. With ``label``, ``values`` maps each label value to its
    values: one series per label value."""
    series: dict[str, dict[str, float]] = values if label else {"": values}  # type: ignore[assignment]
    keys = sorted({key for each in series.values() for key in each})
    lines = []
    for key in keys:
        family = family_name(prefix, key)
        kind, help_text = CATALOGUE.get(family, ("counter" if key.endswith("_total") else "gauge", UNDOCUMENTED))
        name = family + "_total" if kind == "counter" else family
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for label_value, each in series.items():
            if key in each:
                labels = f'{{{label}="{label_value}"}}' if label else ""
                lines.append(f"{name}{labels} {float(each[key])}")
    return lines


class GatewayMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            "vlm_time_to_first_token_seconds", "Time from request to its first token.", LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "vlm_inter_token_latency_seconds", "Time between a choice's token batches.", TOKEN_GAP_BUCKETS
        )
        self.e2e = Histogram("vlm_e2e_request_latency_seconds", "Time from request to its last token.", LATENCY_BUCKETS)
        self.queue = Histogram(
            "vlm_request_queue_seconds", "Time a request waited in the decoder for a slot.", LATENCY_BUCKETS
        )
        # The stages of a request with images or videos, so that a slow first token can be placed.
        self.media_prepare = Histogram(
            "vlm_media_prepare_seconds",
            "Time from request to its media downloaded, preprocessed and handed to the decoder.",
            LATENCY_BUCKETS,
        )
        self.media_wait = Histogram(
            "vlm_media_wait_seconds", "Time a request waited in the decoder for its embeddings.", LATENCY_BUCKETS
        )

    def render(self) -> list[str]:
        histograms = (self.ttft, self.itl, self.e2e, self.queue, self.media_prepare, self.media_wait)
        return [line for h in histograms for line in h.render()]
