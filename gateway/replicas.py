"""Which decoder replica serves a request: data-parallel copies of the decoder, their liveness and load.

Each replica is a whole decoder (its own GPUs, KV cache and prefix cache). A request goes to a live replica
of those that take its kind (``[decoder] text_replicas`` / ``media_replicas``; all by default), the least
loaded one, except that a request whose prompt begins like an earlier one's goes where that one went while
that replica is not much busier: a conversation's next turn then finds its prefix (images included) in
that replica's prefix cache. Load is the number of requests routed to a replica and not yet finished.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.config import Config, decoder_name
from common.protocol import MediaInput

AFFINITY_PREFIX_TOKENS = 256  # the prompt tokens that say which conversation (system prompt, first turn) it is


@dataclass
class Replica:
    index: int
    name: str
    incarnation: str = ""
    seen: float = 0.0  # monotonic time of its last heartbeat; 0: never heard from
    stats: dict[str, float] = field(default_factory=dict)  # its decoder's counters and gauges, as last reported
    load: int = 0  # requests routed here and not yet finished
    routed: int = 0  # requests routed here, ever


def prefix_affinity(prompt_ids: Sequence[int], media: Sequence[MediaInput]) -> int:
    """A number that requests beginning with the same tokens and the same first image share. (Image
    placeholders are the same token ids for every image, so the first image's URL tells them apart.)"""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(list(prompt_ids[:AFFINITY_PREFIX_TOKENS])).encode())
    if media:
        digest.update(media[0].url[:4096].encode(errors="replace"))
    return int.from_bytes(digest.digest(), "little")


class Replicas:
    def __init__(self, cfg: Config) -> None:
        count = cfg.decoder.replicas
        self.all = [Replica(r, decoder_name(r)) for r in range(count)]
        self.by_name = {replica.name: replica for replica in self.all}
        self.text = list(cfg.decoder.text_replicas or range(count))
        self.media = list(cfg.decoder.media_replicas or range(count))
        self.dead_after_s = cfg.liveness.dead_after_s
        # A replica never heard from this long after the gateway started is not starting: it is not running
        # (a static ops/vlm.conf starts replica 0 only) or fails at start-up. A request would only time out.
        self.start_grace_s = cfg.server.request_timeout_s
        self.started = time.monotonic()

    def live(self, replica: Replica, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(replica.seen) and now - replica.seen <= self.dead_after_s

    def unavailable(self, replica: Replica, now: float | None = None) -> str | None:
        """Why a request sent to ``replica`` would only fail, or None while it is live or may be starting."""
        now = time.monotonic() if now is None else now
        if replica.seen and not self.live(replica, now):
            return "is not responding (supervisord restarts it)"
        if not replica.seen and now - self.started > self.start_grace_s:
            return f"has not started in the {self.start_grace_s:.0f} s since the gateway did (is its process running?)"
        return None

    def stale(self, now: float) -> list[Replica]:
        """Replicas heard from once and silent since for longer than ``dead_after_s``."""
        return [r for r in self.all if r.seen and not self.live(r, now)]

    def serving(self) -> dict[str, bool]:
        """Whether text-only requests and requests with media each have a live replica."""
        now = time.monotonic()
        return {
            kind: any(self.live(self.all[r], now) for r in indices)
            for kind, indices in (("text", self.text), ("media", self.media))
        }

    def choose(self, has_media: bool, affinity: Callable[[], int]) -> Replica:
        """The replica for a new request (the caller counts it into ``load`` and out when it ends).
        ``affinity`` (`prefix_affinity` of its prompt) is asked only where there is a choice to make."""
        indices = self.media if has_media else self.text
        now = time.monotonic()
        # None live: one of them all the same, and the caller asks `unavailable` whether the request may wait
        # for it (starting up) or is refused (down, or never started).
        candidates = [self.all[r] for r in indices if self.live(self.all[r], now)] or [self.all[r] for r in indices]
        if len(candidates) == 1:
            return candidates[0]
        least = min(candidates, key=lambda r: r.load)
        preferred = candidates[affinity() % len(candidates)]
        slack = max(1, least.load // 4)  # a quarter more requests than the least loaded one: still preferred
        return preferred if preferred.load <= least.load + slack else least
