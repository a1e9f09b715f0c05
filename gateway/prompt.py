"""Messages to prompt token ids with the checkpoint's own chat template, one placeholder per image or video."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import MediaInput
from gateway.errors import ApiError
from gateway.schema import ChatMessage, ImagePart, TextPart, VideoPart


@dataclass
class Prompt:
    token_ids: list[int]
    media: list[MediaInput]


class PromptBuilder:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        if not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template")

    def build(self, messages: list[ChatMessage]) -> Prompt:
        media: list[MediaInput] = []
        rendered: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            role = "system" if message.role == "developer" else message.role
            if message.content is None or isinstance(message.content, str):
                rendered.append({"role": role, "content": message.content or ""})
                continue
            parts: list[dict[str, Any]] = []
            for part in message.content:
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, ImagePart):
                    if role != "user":
                        raise ApiError(400, f"messages[{i}]: images are only allowed in user messages")
                    url = part.image_url
                    media.append(MediaInput("image", url.url, url.min_pixels, url.max_pixels))
                    parts.append({"type": "image"})
                elif isinstance(part, VideoPart):
                    if role != "user":
                        raise ApiError(400, f"messages[{i}]: videos are only allowed in user messages")
                    video = part.video_url
                    media.append(MediaInput("video", video.url, video.min_pixels, video.max_pixels, video.fps))
                    # The Qwen2-VL template renders this as <|vision_start|><|video_pad|><|vision_end|>.
                    parts.append({"type": "video"})
            rendered.append({"role": role, "content": parts})
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(list(ids), media)

    def encode_text(self, prompt: str | list[int]) -> Prompt:
        """A raw text prompt (``/v1/completions``): tokenized as is, no chat template."""
        if isinstance(prompt, list):
            return Prompt(list(prompt), [])
        return Prompt(list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]), [])
