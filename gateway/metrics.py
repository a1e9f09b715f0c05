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


def render_values(
    prefix: str,
    values: dict[str, float] | dict[str, dict[str, float]],
    counters: set[str] | None = None,
    label: str = "",
) -> list[str]:
    """Plain values: names ending in ``_total`` or listed in ``counters`` are counters, others gauges.
    With ``label``, ``values`` maps each label value to its values: one series per label value."""
    series: dict[str, dict[str, float]] = values if label else {"": values}  # type: ignore[assignment]
    keys = sorted({key for each in series.values() for key in each})
    lines = []
    for key in keys:
        name = f"{prefix}_{_NOT_NAME.sub('_', key)}"
        is_counter = key.endswith("_total") or (counters is not None and key in counters)
        if is_counter and not name.endswith("_total"):
            name += "_total"
        lines.append(f"# TYPE {name} {'counter' if is_counter else 'gauge'}")
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
