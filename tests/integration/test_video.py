"""``video_url`` parts through the real stack, checked against transformers fed the same frames."""

from __future__ import annotations

import base64
import urllib.request
from typing import Any

import openai
import pytest
import torch
from openai import OpenAI
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from benchmarks.hf_chat import HfChat
from benchmarks.media import data_url, jpeg_bytes, mjpeg_avi, video_frames
from common.config import FetcherConfig, load_config
from tests import qwen3_vl_video_reference
from tests.integration.conftest import MediaServer, Stack
from workers.fetcher.video import VideoProcessorSpec, decode_video, frame_indices, preprocess_video

NEW_TOKENS = 16
CLIP_FPS = 8  # 16 frames at 8 fps: 2 seconds, so fps 2 samples 4 frames and fps 4 samples 8
# 160x112 resizes to 168x112: a 12x8 patch grid, 6x4 merged tokens per temporal slice. Wide enough that
# grid_t (at most 4 here) never exceeds max(h, w) / merge, where the two M-RoPE rules agree (see below).
WIDTH, HEIGHT = 160, 112


@pytest.fixture(scope="module")
def spec(stack: Stack) -> VideoProcessorSpec:
    return VideoProcessorSpec.from_dir(load_config(stack.config_path).model_path())


@pytest.fixture(scope="module")
def clip() -> bytes:
    frames = video_frames(WIDTH, HEIGHT, 16, seed=5)
    return mjpeg_avi([jpeg_bytes(f) for f in frames], WIDTH, HEIGHT, CLIP_FPS)


def video_part(url: str, fps: float | None = None) -> dict[str, Any]:
    video: dict[str, Any] = {"url": url}
    if fps is not None:
        video["fps"] = fps
    return {"type": "video_url", "video_url": video}


def ask(client: OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True},
    )


def _video_bytes(url: str) -> bytes:
    if url.startswith("data:"):
        return base64.b64decode(url.split(",", 1)[1])
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def hf_generate(hf: HfChat, spec: VideoProcessorSpec, messages: list[dict[str, Any]]) -> tuple[list[int], int]:
    """transformers' generate on the frames our fetcher samples and preprocesses (transformers'
    own video processor needs torchvision), with the <|video_pad|> expansion its processor does. For Qwen3-VL,
    whose processor follows transformers' own rules (not qwen-vl-utils'), the frames, pixels and timestamped
    expansion are transformers' processor pieces run without torchvision: `tests.qwen3_vl_video_reference` says
    how (the size its resize asks for, PIL's bicubic resize to it, torchvision's normalize arithmetic)."""
    rules = FetcherConfig()
    pixels, grids, converted, seconds, replacements = [], [], [], [], []
    qwen3 = hf.model.config.model_type == "qwen3_vl"
    for message in messages:
        parts = []
        for part in message["content"]:
            if part["type"] == "video_url" and qwen3:
                data = _video_bytes(part["video_url"]["url"])
                processor = Qwen3VLVideoProcessor.from_pretrained(str(hf.model.name_or_path))
                fps = float(part["video_url"].get("fps", processor.fps))
                values, grid, text = qwen3_vl_video_reference.video_inputs(processor, data, fps, rules.max_image_pixels)
                pixels.append(values)
                grids.append(grid)
                replacements.append(text)
                parts.append({"type": "video"})
            elif part["type"] == "video_url":
                fps = float(part["video_url"].get("fps", 2.0))
                video = decode_video(_video_bytes(part["video_url"]["url"]), fps, spec, 768, rules.max_image_pixels)
                values, grid, _ = preprocess_video(video, spec, rules.max_video_tokens)
                pixels.append(torch.from_numpy(values))
                grids.append(list(grid))
                # Qwen2.5-VL's processor: second_per_grid_ts = temporal patch size / the sampled frames' fps
                sampled = frame_indices(video.total_frames, len(video.frames))
                metadata = VideoMetadata(
                    total_num_frames=video.total_frames, fps=video.video_fps, frames_indices=sampled
                )
                seconds.append(spec.frames.temporal_patch_size / metadata.sampled_fps)
                parts.append({"type": "video"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        converted.append({"role": message["role"], "content": parts})
    text = hf.tokenizer.apply_chat_template(
        converted, chat_template=hf.chat_template, tokenize=False, add_generation_prompt=True
    )
    merge = spec.frames.merge_size**2
    pieces = text.split("<|video_pad|>")
    if not qwen3:
        replacements = ["<|video_pad|>" * (g[0] * g[1] * g[2] // merge) for g in grids]
    text = pieces[0] + "".join(new + rest for new, rest in zip(replacements, pieces[1:], strict=True))
    ids = hf.tokenizer([text], return_tensors="pt", add_special_tokens=False)["input_ids"]
    types = 2 * (ids == hf.tokenizer.convert_tokens_to_ids("<|video_pad|>")).long()
    timed = {"second_per_grid_ts": torch.tensor(seconds)} if hf.model.config.model_type == "qwen2_5_vl" else {}
    with torch.inference_mode():
        out = hf.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=types,
            pixel_values_videos=torch.cat(pixels),
            video_grid_thw=torch.tensor(grids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            **timed,
        )
    return out[0, ids.shape[1] :].tolist(), ids.shape[1]


def check_parity(client: OpenAI, hf: HfChat, spec: VideoProcessorSpec, messages: list[dict[str, Any]]) -> Any:
    response = ask(client, messages)
    expected, prompt_len = hf_generate(hf, spec, messages)
    assert response.choices[0].token_ids == expected
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.completion_tokens == NEW_TOKENS
    return response


def test_fps_changes_frames_and_matches_transformers(
    client: OpenAI, hf: HfChat, spec: VideoProcessorSpec, clip: bytes
) -> None:
    url = data_url(clip, "video/x-msvideo")
    two = check_parity(
        client, hf, spec, [{"role": "user", "content": [video_part(url, 2), {"type": "text", "text": "?"}]}]
    )
    four = check_parity(
        client, hf, spec, [{"role": "user", "content": [video_part(url, 4), {"type": "text", "text": "?"}]}]
    )
    if hf.model.config.model_type == "qwen3_vl":
        # 20 tokens per 2 frames (160x128, patch 16) and before each 2 frames "<t seconds>" (8 tokens) between
        # <|vision_start|> and <|vision_end|>: 4 frames -> 60, 8 frames -> 120.
        assert four.usage.prompt_tokens - two.usage.prompt_tokens == 60
    else:
        # 24 tokens per 2 frames: 4 frames -> 48, 8 frames -> 96.
        assert four.usage.prompt_tokens - two.usage.prompt_tokens == 48


def test_long_thin_video_matches_transformers(client: OpenAI, hf: HfChat, spec: VideoProcessorSpec) -> None:
    # 96x64 -> a 6x4 patch grid (3x2 merged); fps 4 gives grid_t = 4 > 3.
    data = mjpeg_avi([jpeg_bytes(f) for f in video_frames(96, 64, 16, seed=5)], 96, 64, CLIP_FPS)
    url = data_url(data, "video/x-msvideo")
    check_parity(client, hf, spec, [{"role": "user", "content": [video_part(url, 4), {"type": "text", "text": "?"}]}])


def test_default_fps_is_two(client: OpenAI, clip: bytes) -> None:
    url = data_url(clip, "video/x-msvideo")
    default = ask(client, [{"role": "user", "content": [video_part(url), {"type": "text", "text": "?"}]}])
    two = ask(client, [{"role": "user", "content": [video_part(url, 2.0), {"type": "text", "text": "?"}]}])
    assert default.usage.prompt_tokens == two.usage.prompt_tokens
    assert default.choices[0].token_ids == two.choices[0].token_ids


def test_video_by_http(
    client: OpenAI, hf: HfChat, spec: VideoProcessorSpec, clip: bytes, media_server: MediaServer
) -> None:
    url = media_server.put("clip.avi", clip)
    content = [{"type": "text", "text": "What happens?"}, video_part(url, 4)]
    check_parity(client, hf, spec, [{"role": "user", "content": content}])


def test_image_and_video_in_one_message(client: OpenAI, clip: bytes, media_server: MediaServer) -> None:
    image_url = data_url(jpeg_bytes(video_frames(64, 64, 1, seed=2)[0]), "image/jpeg")
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        video_part(data_url(clip, "video/x-msvideo"), 2),
        {"type": "text", "text": "Compare."},
    ]
    response = ask(client, [{"role": "user", "content": content}])
    assert response.usage.completion_tokens == NEW_TOKENS


def test_non_video_is_400(client: OpenAI) -> None:
    not_video = data_url(b"this is plain text, not a video" * 10, "video/mp4")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, [{"role": "user", "content": [video_part(not_video), {"type": "text", "text": "?"}]}])
    assert "not a decodable video" in str(caught.value)
