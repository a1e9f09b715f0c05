"""The gateway's choice of a decoder replica: by kind, liveness, load, and a conversation's prefix."""

from __future__ import annotations

import time

import pytest

from common.config import Config, DecoderConfig
from common.protocol import MediaInput
from gateway.replicas import AFFINITY_PREFIX_TOKENS, Replicas, prefix_affinity


def replicas(
    count: int, text: list[int] | None = None, media: list[int] | None = None, fallback: bool = True
) -> Replicas:
    decoder = DecoderConfig(
        replicas=count, text_replicas=text or [], media_replicas=media or [], kind_fallback=fallback
    )
    cfg = Config(decoder=decoder)
    pool = Replicas(cfg)
    for replica in pool.all:
        replica.seen = time.monotonic()
    return pool


def test_names_follow_the_config() -> None:
    pool = replicas(3)
    assert [r.name for r in pool.all] == ["decoder", "decoder-1", "decoder-2"]
    assert pool.by_name["decoder-2"].index == 2


def test_kinds_go_only_to_their_replicas() -> None:
    pool = replicas(3, text=[0], media=[1, 2])
    for affinity in range(20):
        assert pool.choose(False, lambda a=affinity: a).index == 0
        assert pool.choose(True, lambda a=affinity: a).index in (1, 2)


def test_the_least_loaded_replica_unless_the_preferred_one_is_close() -> None:
    pool = replicas(2)
    preferred = pool.choose(False, affinity=lambda: 1)
    assert preferred.index == 1  # equal loads: the conversation's replica
    pool.all[1].load = 1
    assert pool.choose(False, lambda: 1).index == 1  # one more request than the other: still its own
    pool.all[1].load = 2
    assert pool.choose(False, lambda: 1).index == 0  # two more: the least loaded
    pool.all[0].load, pool.all[1].load = 40, 50
    assert pool.choose(False, lambda: 1).index == 1  # a quarter more is close enough
    pool.all[1].load = 51
    assert pool.choose(False, lambda: 1).index == 0


def test_a_silent_replica_gets_nothing_while_another_is_live() -> None:
    pool = replicas(2)
    pool.all[0].load = 100
    pool.all[1].seen = time.monotonic() - 2 * pool.dead_after_s
    assert pool.choose(False, lambda: 1).index == 0
    assert pool.stale(time.monotonic()) == [pool.all[1]]
    assert pool.serving() == {"text": True, "media": True}


def test_with_none_live_the_request_waits_for_its_kind_only_at_start_up() -> None:
    pool = replicas(2, text=[0], media=[1], fallback=False)
    pool.all[1].seen = 0.0  # never heard from (start-up): a request may wait for it
    assert pool.choose(True, lambda: 0).index == 1 and pool.unavailable(pool.all[1]) is None
    assert pool.serving() == {"text": True, "media": False}
    later = pool.started + pool.start_grace_s + 1  # still never heard from: not starting, the gateway fails it
    assert "has not started in the 300 s" in (pool.unavailable(pool.all[1], later) or "")
    pool.all[1].seen = time.monotonic() - 2 * pool.dead_after_s  # heard from, then silent: the gateway fails it
    assert pool.choose(True, lambda: 0).index == 1 and "is not responding" in (pool.unavailable(pool.all[1]) or "")
    assert pool.unavailable(pool.all[0]) is None


def test_a_kind_whose_replicas_are_down_falls_back_to_the_others_but_waits_at_start_up() -> None:
    pool = replicas(3, text=[0], media=[1, 2])
    pool.all[1].seen = pool.all[2].seen = 0.0  # the media replicas starting: image requests wait for them
    assert pool.choose(True, lambda: 0).index in (1, 2) and pool.serving() == {"text": True, "media": False}
    pool.all[1].seen = time.monotonic() - 2 * pool.dead_after_s  # one silent, one still starting: wait
    assert pool.choose(True, lambda: 0).index == 2 and pool.all[0].fallbacks == 0
    pool.all[2].seen = time.monotonic() - 2 * pool.dead_after_s  # both down: replica 0 takes images
    assert pool.serving() == {"text": True, "media": True}
    assert [pool.choose(True, lambda a=a: a).index for a in range(4)] == [0] * 4
    assert pool.all[0].fallbacks == 4 and pool.falling_back == {"media"}
    assert pool.choose(False, lambda: 1).index == 0 and pool.all[0].fallbacks == 4  # its own kind: no fallback
    pool.all[2].seen = time.monotonic()  # one back: images go there again
    assert pool.choose(True, lambda: 0).index == 2 and pool.falling_back == set()
    pool.all[0].seen = time.monotonic() - 2 * pool.dead_after_s  # text's only replica down: the media ones
    assert pool.choose(False, lambda: 0).index == 2 and pool.all[2].fallbacks == 1
    pool.all[2].seen = time.monotonic() - 2 * pool.dead_after_s  # none live at all: the kind's, refused
    assert pool.choose(False, lambda: 0).index == 0 and pool.unavailable(pool.all[0]) is not None
    assert pool.serving() == {"text": False, "media": False}


def test_prefix_affinity_is_the_opening_and_the_first_image() -> None:
    opening = list(range(AFFINITY_PREFIX_TOKENS))
    image = [MediaInput("image", "http://a/1.png")]
    assert prefix_affinity([*opening, 1, 2], image) == prefix_affinity([*opening, 3], image)
    assert prefix_affinity(opening, image) != prefix_affinity(opening, [MediaInput("image", "http://a/2.png")])
    assert prefix_affinity([1, 2, 3], []) != prefix_affinity([1, 2, 4], [])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"replicas": 0}, "replicas: expected >= 1"),
        ({"replicas": 2, "media_replicas": [2]}, "must name distinct replicas of 0..1"),
        ({"replicas": 2, "text_replicas": [0, 0]}, "must name distinct replicas"),
        ({"replicas": 2, "text_replicas": [True]}, "expected a list of replica indices"),
        ({"replicas": 2, "text_replicas": "0"}, "expected a list of replica indices"),
    ],
)
def test_bad_replica_settings_are_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**settings).validate("[decoder]")


def render_values(prefix: str, values: dict, label: str = "") -> list[str]:
    """What /metrics serves for one process kind's values (through a registry of their own)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import Reported, ReportedValues

    registry, collector = CollectorRegistry(), ReportedValues()
    registry.register(collector)
    collector.reported = [Reported(prefix, values, label)]
    return generate_latest(registry).decode().splitlines()


def test_metrics_of_several_replicas_are_one_series_each() -> None:
    from gateway.metrics import CATALOGUE, UNDOCUMENTED

    stats = {"0": {"requests_finished": 3.0, "kv_usage": 0.5}, "1": {"requests_finished": 4.0}}
    lines = render_values("vlm_decoder", stats, label="replica")
    assert lines == [
        f"# HELP vlm_decoder_kv_usage {CATALOGUE['vlm_decoder_kv_usage'][1]}",
        "# TYPE vlm_decoder_kv_usage gauge",
        'vlm_decoder_kv_usage{replica="0"} 0.5',
        f"# HELP vlm_decoder_requests_finished_total {CATALOGUE['vlm_decoder_requests_finished'][1]}",
        "# TYPE vlm_decoder_requests_finished_total counter",
        'vlm_decoder_requests_finished_total{replica="0"} 3.0',
        'vlm_decoder_requests_finished_total{replica="1"} 4.0',
    ]
    assert render_values("vlm_decoder", stats["1"])[1:] == [
        "# TYPE vlm_decoder_requests_finished_total counter",
        "vlm_decoder_requests_finished_total 4.0",
    ]
    # seconds counters spelt as Prometheus has them; a key nobody described is still served, and says so
    assert render_values("vlm_encoder", {"busy_s": 1.5})[1:] == [
        "# TYPE vlm_encoder_busy_seconds_total counter",
        "vlm_encoder_busy_seconds_total 1.5",
    ]
    assert render_values("vlm_x", {"new_total": 1.0, "level": 2.0}) == [
        f"# HELP vlm_x_level {UNDOCUMENTED}",
        "# TYPE vlm_x_level gauge",
        "vlm_x_level 2.0",
        f"# HELP vlm_x_new_total {UNDOCUMENTED}",
        "# TYPE vlm_x_new_total counter",
        "vlm_x_new_total 1.0",
    ]
