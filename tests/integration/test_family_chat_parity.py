"""Each model family beside Qwen2-VL through the whole stack, as ``./ops/serve`` starts it on the family's tiny
synthetic checkpoint, against transformers' own model of that family: Qwen2-VL's chat and video parity tests
(test_chat_parity, test_video) run again here, their ``stack``, ``client`` and ``hf`` being this module's, plus a
grayscale image. A family joins with its model_type in FAMILIES; every family's videos are served, Qwen3-VL's with
the timestamps its processor writes (test_video's reference builds them from transformers' processor pieces)."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack
from tests.integration.test_chat_parity import (  # noqa: F401 (collected here, on this module's stack)
    check_parity,
    image_part,
    test_image_by_http_url,
    test_models_and_health,
    test_streaming_chunks_usage_and_done,
    test_system_prompt_and_one_image,
    test_text_only,
    test_three_turns_run_the_vit_once,
    test_two_images_of_different_sizes,
)
from tests.integration.test_video import (  # noqa: F401 (collected here, on this module's stack)
    ask,
    clip,
    spec,
    test_fps_changes_frames_and_matches_transformers,
    test_long_thin_video_matches_transformers,
    test_video_by_http,
    video_part,
)
from tests.media import data_url, make_image

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


pytestmark = pytest.mark.parametrize("family_stack", FAMILIES, indirect=True, scope="session")


@pytest.fixture(scope="module")
def stack(family_stack: Stack) -> Stack:
    """conftest's stack of the family (shared with the other modules that serve its tiny checkpoint as it is)."""
    return family_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(stack: Stack) -> HfChat:
    reference = HfChat(load_config(stack.config_path).model_path())
    assert reference.model.config.model_type in FAMILIES  # the family's checkpoint, not the Qwen2-VL demo
    return reference


def test_grayscale_image(client: OpenAI, hf: HfChat) -> None:
    content: list[dict[str, Any]] = [
        image_part(data_url(make_image(150, 100, seed=9, mode="L"))),
        {"type": "text", "text": "Which shades?"},
    ]
    check_parity(client, hf, [{"role": "user", "content": content}])
