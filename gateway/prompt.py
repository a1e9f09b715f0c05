"""Messages to prompt token ids with the checkpoint's own chat template, one placeholder per image or video."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import MediaInput
from gateway.errors import ApiError
from gateway.schema import ChatMessage, ImagePart, TextPart, VideoPart
from gateway.tools import history_fields


@dataclass
class Prompt:
    token_ids: list[int]
    media: list[MediaInput]


def _default_template(found: Any) -> str | None:
    """A template as stored: a string, or named templates (a map, or a list of {name, template}) of which
    the one named "default" is used."""
    if isinstance(found, list):
        found = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
    if isinstance(found, dict):
        found = found.get("default")
    return found if isinstance(found, str) and found else None


def _json_field(path: Path, key: str) -> Any:
    return json.loads(path.read_text(encoding="utf-8")).get(key) if path.is_file() else None


def processor_chat_template(model_dir: Path) -> str | None:
    """The template transformers' Qwen2-VL processor renders with, found where it looks: the
    ``chat_template`` of processor_config.json, else chat_template.json (the legacy file, which a
    tokenizer does not read), else chat_template.jinja (or additional_chat_templates/default.jinja)."""
    jinja = model_dir / "chat_template.jinja"
    if not jinja.is_file():
        jinja = model_dir / "additional_chat_templates" / "default.jinja"
    for found in (
        _json_field(model_dir / "processor_config.json", "chat_template"),
        _json_field(model_dir / "chat_template.json", "chat_template"),
        jinja.read_text(encoding="utf-8") if jinja.is_file() else None,
    ):
        if template := _default_template(found):
            return template
    return None


# apply_chat_template's own parameters: a template variable of one of these names would change how it renders
_RESERVED = {
    *("conversation", "messages", "chat_template", "tools", "documents", "add_generation_prompt"),
    *("continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors"),
    *("return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"),
}


def _template_variables(given: dict[str, Any]) -> dict[str, Any]:
    for name in given:
        if not name.isidentifier() or name in _RESERVED:
            raise ApiError(
                400,
                f"chat_template_kwargs: {name!r} cannot be a template variable (a Python identifier, and none of "
                f"{', '.join(sorted(_RESERVED))})",
                param="chat_template_kwargs",
            )
    return given


class PromptBuilder:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        # The processor's template is the one a Qwen2-VL checkpoint is used with (it may differ from the
        # tokenizer's, or be the only one); the tokenizer's serves where the processor has none.
        self.chat_template = processor_chat_template(model_dir) or _default_template(self.tokenizer.chat_template)
        if not self.chat_template:
            raise ValueError(
                f"{model_dir} has no chat template (looked in processor_config.json, chat_template.json, "
                "chat_template.jinja and tokenizer_config.json)"
            )

    def build(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        """The prompt's token ids and media; the options are vLLM's: ``continue_final_message`` leaves the last
        (assistant) message open for the answer to continue, ``template_kwargs`` are the template's variables;
        ``tools`` (transformers' form, ``{"type": "function", "function": {...}}``) go to the template."""
        media: list[MediaInput] = []
        rendered: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            role = "system" if message.role == "developer" else message.role
            if message.content is None or isinstance(message.content, str):
                rendered.append({"role": role, "content": message.content or "", **history_fields(message)})
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
            rendered.append({"role": role, "content": parts, **history_fields(message)})
        try:
            text = self.tokenizer.apply_chat_template(
                rendered,
                chat_template=self.chat_template,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **_template_variables(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as exc:  # the template's own raise_exception, or a final message
            # that continue_final_message cannot find in the rendered text
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from exc
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(list(ids), media)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools: a conversation rendered with a tool and without differs. (Read
        from what it renders, not from its source: a template may mention tools, or a ``tool`` role, and still
        leave them out of the prompt, as Qwen2-VL's tool-role-only templates do.)"""
        conversation = [{"role": "user", "content": "hi"}]
        probe = [{"type": "function", "function": {"name": "probe", "description": "a probe", "parameters": {}}}]

        def render(tools: list[dict[str, Any]] | None) -> str:
            return str(self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, tools=tools, tokenize=False, add_generation_prompt=True
            ))  # fmt: skip

        try:
            return render(probe) != render(None)
        except (TemplateError, ValueError):
            return False

    def encode_text(self, prompt: str | list[int]) -> Prompt:
        """A raw text prompt (``/v1/completions``): tokenized as is, no chat template."""
        if isinstance(prompt, list):
            return Prompt(list(prompt), [])
        return Prompt(list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]), [])
