"""Which decoder replica serves a request: data-parallel copies of the decoder, their liveness and load.

Each replica is a whole decoder (its own GPUs, KV cache and prefix cache). A request goes to a live replica
of those that take its kind (``[decoder] text_replicas`` / ``media_replicas``; all by default), the least
loaded one, except that a request whose prompt begins like an earlier one's goes where that one went while
that replica is not much busier: a conversation's next turn then finds its prefix (images included) in
that replica's prefix cache. Load is the number of requests routed to a replica and not yet finished.
While every replica of a kind is down, another live replica takes its requests (``kind_fallback``).
Liveness is judged by the gateway's `LivenessClock`, which does not count the time its own loop was stalled.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.config import Config, decoder_name
from common.liveness import LivenessClock
from common.protocol import MediaInput

log = logging.getLogger(__name__)

AFFINITY_PREFIX_TOKENS = 256  # the prompt tokens that say which conversation (system prompt, first turn) it is


@dataclass
class Replica:
    index: int
    name: str
    incarnation: str = ""
    seen: float = 0.0  # `LivenessClock` time of its last heartbeat; 0: never heard from
    stats: dict[str, float] = field(default_factory=dict)  # its decoder's counters and gauges, as last reported
    load: int = 0  # requests routed here and not yet finished
    routed: int = 0  # requests routed here, ever
    fallbacks: int = 0  # of them, requests of a kind it does not take, while that kind's replicas were down
    reissued: int = 0  # requests it lost (died, restarted, stopped answering) before their first token, sent again
    lost: int = 0  # times it was taken for lost: silent for ``dead_after_s``, or back as a new process
    silent: bool = False  # taken for lost for its silence, and not heard from since


def prefix_affinity(prompt_ids: Sequence[int], media: Sequence[MediaInput]) -> int:
    """A number that requests beginning with the same tokens and the same first image share. (Image
    placeholders are the same token ids for every image, so the first image's URL tells them apart.)"""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr(list(prompt_ids[:AFFINITY_PREFIX_TOKENS])).encode())
    if media:
        digest.update(media[0].url[:4096].encode(errors="replace"))
    return int.from_bytes(digest.digest(), "little")


class Replicas:
    def __init__(self, cfg: Config, clock: LivenessClock | None = None) -> None:
        """``clock``: the one the gateway's liveness tick advances (None: a new one that no tick advances past its
        first period, for a caller that gives every time itself, as a test does)."""
        self.clock = clock if clock is not None else LivenessClock(cfg.liveness.heartbeat_s)
        count = cfg.decoder.replicas
        self.all = [Replica(r, decoder_name(r)) for r in range(count)]
        self.by_name = {replica.name: replica for replica in self.all}
        self.text = list(cfg.decoder.text_replicas or range(count))
        self.media = list(cfg.decoder.media_replicas or range(count))
        self.kind_fallback = cfg.decoder.kind_fallback
        self.falling_back: set[str] = set()  # the kinds whose requests go to other replicas now
        self.dead_after_s = cfg.liveness.dead_after_s
        # A replica never heard from this long after the gateway started is not starting: it is not running
        # (a static ops/vlm.conf starts replica 0 only) or fails at start-up. A request would only time out.
        self.start_grace_s = cfg.server.request_timeout_s
        self.started = self.clock.now()

    def heard(self, replica: Replica, incarnation: str) -> bool:
        """A heartbeat from ``replica``'s process ``incarnation`` was read: True where that is a new process
        (the one before is lost, counted once: not again where its silence was)."""
        restarted = bool(replica.incarnation) and incarnation != replica.incarnation
        if restarted and not replica.silent:
            replica.lost += 1
        replica.incarnation, replica.seen, replica.silent = incarnation, self.clock.now(), False
        return restarted

    def live(self, replica: Replica, now: float | None = None) -> bool:
        """``now``: `LivenessClock` time (the clock's now if None), as every ``now`` here."""
        now = self.clock.now() if now is None else now
        return bool(replica.seen) and now - replica.seen <= self.dead_after_s

    def unavailable(self, replica: Replica, now: float | None = None) -> str | None:
        """Why a request sent to ``replica`` would only fail, or None while it is live or may be starting."""
        now = self.clock.now() if now is None else now
        if replica.seen and not self.live(replica, now):
            return "is not responding (supervisord restarts it)"
        if not replica.seen and now - self.started > self.start_grace_s:
            return f"has not started in the {self.start_grace_s:.0f} s since the gateway did (is its process running?)"
        return None

    def stale(self, now: float | None = None) -> list[Replica]:
        """Replicas heard from once and silent since for longer than ``dead_after_s``."""
        now = self.clock.now() if now is None else now
        return [r for r in self.all if r.seen and not self.live(r, now)]

    def silenced(self) -> list[Replica]:
        """The `stale` replicas, each counted lost once for its silence (the first time it is found stale)."""
        stale = self.stale()
        for replica in stale:
            if not replica.silent:
                replica.silent, replica.lost = True, replica.lost + 1
        return stale

    def serving(self) -> dict[str, bool]:
        """Whether text-only requests and requests with media each have a live replica to go to."""
        now = self.clock.now()
        return {
            kind: any(self.live(r, now) for r in self._targets(indices, now)[0])
            for kind, indices in (("text", self.text), ("media", self.media))
        }

    def choose(self, has_media: bool, affinity: Callable[[], int]) -> Replica:
        """The replica for a new request (the caller counts it into ``load`` and out when it ends).
        ``affinity`` (`prefix_affinity` of its prompt) is asked only where there is a choice to make. With
        none live nor starting, one of the kind's all the same: the caller asks `unavailable` and refuses it."""
        kind, indices = ("media", self.media) if has_media else ("text", self.text)
        candidates, fallback = self._targets(indices, self.clock.now())
        chosen = self._least_loaded_or_preferred(candidates, affinity)
        if fallback:
            chosen.fallbacks += 1
        if fallback != (kind in self.falling_back):  # say when the fallback starts and ends, not per request
            self.falling_back ^= {kind}
            if fallback:
                log.warning("no %s replica %s is live: another live replica takes those requests", kind, indices)
            else:
                log.info("a %s replica %s is back (live or starting): those requests go there", kind, indices)
        return chosen

    def _targets(self, indices: list[int], now: float) -> tuple[list[Replica], bool]:
        """Where a request for these replicas may go: the live ones; else those starting (it waits for them);
        else, with ``kind_fallback``, any live replica (True: a fallback); else all of them."""
        own = [self.all[r] for r in indices]
        candidates = [r for r in own if self.live(r, now)] or [r for r in own if self.unavailable(r, now) is None]
        if candidates or not self.kind_fallback:
            return candidates or own, False
        others = [r for r in self.all if self.live(r, now)]
        return (others, True) if others else (own, False)

    @staticmethod
    def _least_loaded_or_preferred(candidates: list[Replica], affinity: Callable[[], int]) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        least = min(candidates, key=lambda r: r.load)
        preferred = candidates[affinity() % len(candidates)]
        slack = max(1, least.load // 4)  # a quarter more requests than the least loaded one: still preferred
        return preferred if preferred.load <= least.load + slack else least
