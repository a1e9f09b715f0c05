"""The gateway process runs without torch (``gateway.__main__.without_torch``), and its tokenizer is still
transformers' own: the same class, prompt ids, decoded text and llguidance tokenizer as in a process where torch is
loaded (this one: pytest's), on each model family's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "héllo wörld 你好 <|im_end|>  two spaces\n\nand a line"},
                {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
            ],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And <think>its</think> colour?"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
}


def what_the_gateway_makes(checkpoints: list[str]) -> dict[str, Any]:
    """Per checkpoint: the gateway's tokenizer class, a chat's prompt ids, decoded and re-encoded text, and its
    llguidance tokenizer's tokens. Imports the gateway here, so that a caller can hide torch first."""
    from gateway.prompt import PromptBuilder
    from gateway.schema import parse_chat_request
    from gateway.structured import GrammarChecker

    out: dict[str, Any] = {}
    for path in checkpoints:
        builder = PromptBuilder(Path(path))
        tokenizer = builder.tokenizer
        request = parse_chat_request(CHAT)
        ids = [*range(0, tokenizer.vocab_size, 997), *range(151640, len(tokenizer))]
        out[Path(path).name] = {
            "class": type(tokenizer).__name__,
            "prompt": builder.build(request.messages, tools=CHAT["tools"]).token_ids,
            "decoded": tokenizer.decode(ids),
            "decoded_skipping_special": tokenizer.decode(ids, skip_special_tokens=True),
            "tokens": tokenizer.convert_ids_to_tokens(ids),
            "encoded": tokenizer("héllo  <think>x</think> 123 ", add_special_tokens=False)["input_ids"],
            "special": tokenizer.all_special_ids,
            "llguidance": GrammarChecker(tokenizer).tokenizer().tokenize_str("héllo <tool_call> 12"),
        }
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from workers.models.synth import generate_checkpoint

    root = tmp_path_factory.mktemp("families")
    return [str(generate_checkpoint(root / family, "tiny", 0, family=family)) for family in FAMILIES]


def test_the_gateway_tokenizes_without_torch_as_transformers_does_with_it(checkpoints: list[str]) -> None:
    script = (
        "import json, sys\n"
        "from gateway.__main__ import without_torch\n"
        "without_torch()\n"
        "import gateway.app\n"  # (everything the process imports)
        "from tests.unit.test_gateway_without_torch import what_the_gateway_makes\n"
        f"made = what_the_gateway_makes({checkpoints!r})\n"
        "loaded = sorted(name for name, module in sys.modules.items() if name.split('.')[0] == 'torch' and module)\n"
        "print(json.dumps({'made': made, 'torch': loaded}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr
    without = json.loads(done.stdout)
    assert without["torch"] == []
    import torch  # noqa: F401  (the reference: transformers as it is with torch loaded)

    assert without["made"] == what_the_gateway_makes(checkpoints)
