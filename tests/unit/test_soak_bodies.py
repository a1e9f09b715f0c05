"""The overload run's bodies (`benchmarks.soak.BodyPool`): built before the run, each request a distinct cache miss
of the same work, and a burst sent slower than asked fails the run as the harness's fault."""

from __future__ import annotations

import json

from benchmarks import soak
from benchmarks.workloads import seed3img_request


def _args(workload: str, pool: int = 3) -> object:
    return soak.parse_args(["--burst", "--burst-workload", workload, "--body-pool", str(pool), "--out", "x.json"])


def test_seed3img_requests_differ_only_in_their_images_pixel_budget() -> None:
    args = _args("seed3img")
    pool = soak.BodyPool.build(args)
    opts = soak.workload_options(args)
    seen = set()
    for index in range(12):
        body = json.loads(pool.request(index).body)
        parts = body["messages"][0]["content"]
        expected = seed3img_request(opts, index % 3).messages[0]["content"]
        images = [p["image_url"] for p in parts if p["type"] == "image_url"]
        assert [i["url"] for i in images] == [p["image_url"]["url"] for p in expected if p["type"] == "image_url"]
        budgets = {i["min_pixels"] for i in images}
        assert len(budgets) == 1 and 1 <= budgets.pop() <= soak.IMAGE_VARIANTS
        assert parts[-1] == expected[-1]  # the question
        assert body["max_tokens"] == args.max_tokens and body["stream"] is False
        seen.add(json.dumps(images))
    assert len(seen) == 12  # every request a cache miss


def test_text_requests_differ_from_their_first_words() -> None:
    pool = soak.BodyPool.build(_args("text", pool=2))
    prompts = [json.loads(pool.request(i).body)["messages"][0]["content"] for i in range(6)]
    assert len({p.split(".")[0] for p in prompts}) == 6
    assert prompts[0].split(".", 1)[1] == prompts[2].split(".", 1)[1]  # (the same text, another variant)


def test_sent_rate_is_the_requests_over_the_time_they_took_to_send() -> None:
    burst = [{"start_s": 10.0 + i * 0.5} for i in range(60)]  # 60 begun over 29.5 s: on time for a 30 s burst
    assert soak.sent_rate(burst, 10.0, 30.0) == 2.0
    late = [{"start_s": 10.0 + i * 2.0} for i in range(60)]  # the same 60 over 118 s
    assert soak.sent_rate(late, 10.0, 30.0) == 60 / 118.0
