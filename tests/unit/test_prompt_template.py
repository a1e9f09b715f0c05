"""The gateway renders with the chat template transformers' Qwen2-VL processor uses, wherever the checkpoint keeps
it: processor_config.json, chat_template.json (which a tokenizer does not read), chat_template.jinja, or only the
tokenizer's. The reference is transformers' own lookup (``Qwen2VLProcessor.get_processor_dict``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.hf_chat import processor_template
from gateway.prompt import PromptBuilder
from gateway.schema import ChatMessage
from workers.models import synth
from workers.models.synth import demo_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
PROCESSOR_TEMPLATE = synth.CHAT_TEMPLATE.replace("You are a helpful assistant.", "You answer in haiku.")
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
            {"type": "text", "text": "What is it?"},
        ],
    },
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And its colour?"},
]


def checkpoint(tmp_path: Path, tokenizer_template: str | None, files: dict[str, str]) -> Path:
    """The demo checkpoint's tokenizer with ``tokenizer_template`` (None: none) and the extra ``files``."""
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(demo_checkpoint() / name, root / name)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if tokenizer_template is not None:
        config["chat_template"] = tokenizer_template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def reference_ids(root: Path) -> list[int]:
    """transformers: the processor's template (its own lookup) rendered by the tokenizer, image placeholder kept."""
    tokenizer = AutoTokenizer.from_pretrained(str(root))
    hf_messages = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [{"type": "image"}, {"type": "text", "text": "What is it?"}],
        }
        for m in MESSAGES
    ]
    text = tokenizer.apply_chat_template(
        hf_messages, chat_template=processor_template(root, tokenizer), tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def our_ids(root: Path) -> list[int]:
    return PromptBuilder(root).build([ChatMessage.model_validate(m) for m in MESSAGES]).token_ids


def haiku_prompt(root: Path) -> bool:
    return "You answer in haiku." in AutoTokenizer.from_pretrained(str(root)).decode(our_ids(root))


@pytest.mark.parametrize(
    ("tokenizer_template", "files"),
    [
        (None, {"chat_template.json": json.dumps({"chat_template": PROCESSOR_TEMPLATE})}),
        (synth.CHAT_TEMPLATE, {"chat_template.json": json.dumps({"chat_template": PROCESSOR_TEMPLATE})}),
        (synth.CHAT_TEMPLATE, {"chat_template.jinja": PROCESSOR_TEMPLATE}),
        (synth.CHAT_TEMPLATE, {"additional_chat_templates/default.jinja": PROCESSOR_TEMPLATE}),
        (
            synth.CHAT_TEMPLATE,
            {
                "processor_config.json": json.dumps({"chat_template": PROCESSOR_TEMPLATE}),
                "chat_template.json": json.dumps({"chat_template": synth.CHAT_TEMPLATE}),
            },
        ),
    ],
    ids=["json-only", "json-beside-tokenizer", "jinja", "templates-dir", "processor-config-first"],
)
def test_the_processor_template_is_used(tmp_path: Path, tokenizer_template: str | None, files: dict[str, str]) -> None:
    root = checkpoint(tmp_path, tokenizer_template, files)
    assert our_ids(root) == reference_ids(root)
    assert haiku_prompt(root)  # (the tokenizer's own template would say "a helpful assistant")


def test_the_tokenizer_template_serves_where_the_processor_has_none(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, PROCESSOR_TEMPLATE, {})
    assert our_ids(root) == reference_ids(root)
    assert haiku_prompt(root)


def test_a_checkpoint_without_any_template_is_refused(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, None, {})
    with pytest.raises(ValueError, match=r"has no chat template .looked in processor_config.json, chat_template.json"):
        PromptBuilder(root)
