"""A chat template that renders tools as Qwen3-VL-Instruct's does (its tools section, its assistant ``tool_calls``
and its grouped ``tool`` messages), over the synthetic Qwen3-VL template's message parts; and a way to put it into
a synthetic checkpoint. The synthetic checkpoints' own templates leave tools out, as Qwen2-VL's real one does."""

from __future__ import annotations

import json
from pathlib import Path

from workers.models.qwen3_vl_synth import CHAT_TEMPLATE as QWEN3_VL_MESSAGES

_CONTENT_MACRO, _, _MESSAGES = QWEN3_VL_MESSAGES.partition("{%- for message in messages %}")

_TOOLS_SECTION = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content, false) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' }}{%- endif %}"
)

_MESSAGE_LOOP = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content, true) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + render_content(message.content, true) }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content, true) + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS_CHAT_TEMPLATE = _CONTENT_MACRO + _TOOLS_SECTION + _MESSAGE_LOOP


def with_tools_template(model_dir: Path) -> Path:
    """The checkpoint with its chat template (everywhere one is looked for) replaced by TOOLS_CHAT_TEMPLATE."""
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": TOOLS_CHAT_TEMPLATE}))
    for name in ("tokenizer_config.json", "processor_config.json"):
        path = model_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            if "chat_template" in config:
                config["chat_template"] = TOOLS_CHAT_TEMPLATE
                path.write_text(json.dumps(config))
    return model_dir
