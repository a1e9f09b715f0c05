"""Tool calling through the real stack with the official client: bad tools refused by name; the prompt rendered with
the tools and the tool history as transformers renders it (prompt token counts); ``auto`` parsing what the model
emits; named and ``required`` choices giving calls whose arguments validate (these need the decoder's grammar
masking, workers/decoder/grammar.py: skipped until it is there)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from common.config import load_config
from tests.integration.conftest import REPO, Stack, serve
from tests.tool_template import with_tools_template
from workers.models.synth import generate_checkpoint

needs_grammar_masking = pytest.mark.skipif(
    not (REPO / "workers/decoder/grammar.py").is_file(),
    reason="the decoder's grammar masking (workers/decoder/grammar.py) has not landed: a grammar-made call's "
    "arguments cannot hold until it does",
)

USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
TOOL_CALL = 151657  # <tool_call> in Qwen's vocabulary (the synthetic Qwen3-VL checkpoint keeps the hub's ids)


@pytest.fixture(scope="module")
def tools_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A Qwen3-VL checkpoint whose template renders tools (as the real Qwen3-VL's does)."""
    model = with_tools_template(generate_checkpoint(tmp_path_factory.mktemp("tools") / "tiny", "tiny", 0, "qwen3_vl"))
    yield from serve(tmp_path_factory, "tools", f'[model]\npath = "{model}"\n')


@pytest.fixture(scope="module")
def tools_client(tools_stack: Stack) -> OpenAI:
    return OpenAI(base_url=tools_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: OpenAI, **options: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=options.pop("messages", [USER]),
        max_tokens=options.pop("max_tokens", 4),
        **options,
    )


def refused(client: OpenAI, *needles: str, param: str | None = None, **options: Any) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, **options)
    error = raised.value.body
    assert isinstance(error, dict)
    for needle in needles:
        assert needle.lower() in error["message"].lower(), error["message"]
    if param is not None:
        assert error["param"] == param, error


# ------------------------------------------------------------------------ Qwen2-VL: a template without tools


def test_bad_tools_are_refused_by_name(client: OpenAI) -> None:
    refused(client, "missing", param="tools.0.function.name", tools=[{"type": "function", "function": {}}],
            tool_choice="required")  # fmt: skip
    refused(client, "twice", param="tools.1.function.name", tools=[WEATHER, WEATHER], tool_choice="required")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}
    refused(client, "not a valid JSON schema", param="tools.0.function.parameters", tools=[bad_schema],
            tool_choice="required")  # fmt: skip
    refused(client, "'launch'", param="tool_choice.function.name", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}})  # fmt: skip
    refused(client, "needs tools", param="tool_choice", tool_choice="required")
    refused(client, "send the functions as tools", functions=[{"name": "f"}])


def test_auto_is_refused_where_the_template_has_no_tools(client: OpenAI) -> None:
    refused(client, "chat template that renders tools", param="tool_choice", tools=[WEATHER])
    refused(client, "chat template that renders tools", param="tool_choice", tools=[WEATHER], tool_choice="auto")


def test_a_named_call_cut_short_keeps_its_shape(client: OpenAI) -> None:
    """(Runs before the decoder masks: the shape of the answer, not its arguments.) A named call cut short by
    max_tokens is still that function's call, finishing "length"; streamed, its first piece carries the id, type and
    name, and the arguments follow. A required answer cut short is no array of calls: it stays text."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=3, temperature=0).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("length", None)
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather") and call.id.startswith("call_")
    pieces, finish = [], None
    for chunk in ask(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=3, temperature=0, stream=True):
        for streamed in chunk.choices:
            pieces += streamed.delta.tool_calls or []
            finish = streamed.finish_reason or finish
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments  # (greedy: the same)
    assert finish == "length"
    cut = ask(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=3, temperature=0).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls) == ("length", None) and cut.message.content


@needs_grammar_masking
@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_work_where_the_template_has_no_tools(client: OpenAI, stream: bool) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for call in calls_of(client, stream, tool_choice=choice, temperature=1.0, seed=3):
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


# ------------------------------------------------------------------------ a template that renders tools


def hf_prompt_tokens(stack: Stack, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """transformers' own count: the checkpoint's tokenizer and template, the arguments as a mapping (its convention)."""
    tokenizer = AutoTokenizer.from_pretrained(str(load_config(stack.config_path).model_path()))
    messages = json.loads(json.dumps(messages))
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message.get("content") is None:
            message["content"] = ""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)  # fmt: skip
    return len(ids)


HISTORY = [
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
]  # fmt: skip


def test_the_prompt_holds_the_tools_and_the_tool_history(tools_stack: Stack, tools_client: OpenAI) -> None:
    plain = ask(tools_client, temperature=0).usage.prompt_tokens
    with_tools = ask(tools_client, tools=[WEATHER, TIME], temperature=0).usage.prompt_tokens
    assert plain == hf_prompt_tokens(tools_stack, [USER], None)
    assert with_tools == hf_prompt_tokens(tools_stack, [USER], [WEATHER, TIME]) > plain
    history = ask(tools_client, messages=HISTORY, tools=[WEATHER, TIME], temperature=0).usage.prompt_tokens
    assert history == hf_prompt_tokens(tools_stack, HISTORY, [WEATHER, TIME]) > with_tools
    # none: the tools are left out of the prompt
    assert ask(tools_client, tools=[WEATHER], tool_choice="none", temperature=0).usage.prompt_tokens == plain


@pytest.mark.parametrize("stream", [False, True])
def test_auto_keeps_a_tool_call_tag_that_is_no_call_as_content(tools_client: OpenAI, stream: bool) -> None:
    """A random-weight model emits no call of its own; biased to <tool_call> it opens one it cannot finish in one
    token: the open tag, no JSON after it, stays text (streamed too, once the tag is known to be no call)."""
    options = dict(tools=[WEATHER], max_tokens=1, temperature=0, logit_bias={str(TOOL_CALL): 100})
    if not stream:
        choice = ask(tools_client, **options).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("<tool_call>", None,
                                                                                             "length")  # fmt: skip
        return
    content, finish, pieces = "", None, 0
    for chunk in ask(tools_client, stream=True, **options):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            pieces += len(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert (content, pieces, finish) == ("<tool_call>", 0, "length")


def calls_of(client: OpenAI, stream: bool, **options: Any) -> list[dict[str, str]]:
    """The calls of one answer, whole or as the client joins the streamed pieces; the finish reason checked."""
    options = {"tools": [WEATHER, TIME], "max_tokens": 200, **options}
    if not stream:
        choice = ask(client, **options).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
        return [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in ask(client, stream=True, **options):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += (piece.function.name or "") if piece.function else ""
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
    assert finish == "tool_calls"
    return [calls[i] for i in sorted(calls)]


@needs_grammar_masking
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_and_required_calls_validate(tools_client: OpenAI, stream: bool, temperature: float) -> None:
    named = calls_of(tools_client, stream, temperature=temperature, seed=1,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    assert [c["name"] for c in named] == ["get_weather"]
    jsonschema.validate(json.loads(named[0]["arguments"]), SCHEMAS["get_weather"])
    # One call: with parallel calls allowed the array is unbounded, and random weights need not close it (the
    # schema with several calls is checked in tests/unit/test_gateway_tools.py).
    required = calls_of(tools_client, stream, temperature=temperature, seed=2, tool_choice="required",
                        parallel_tool_calls=False)  # fmt: skip
    assert len(required) == 1 and required[0]["name"] in SCHEMAS
    jsonschema.validate(json.loads(required[0]["arguments"]), SCHEMAS[required[0]["name"]])


@needs_grammar_masking
@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_the_model_emits(tools_client: OpenAI, stream: bool) -> None:
    """The model made to emit a call by a pattern (vLLM's ``structured_outputs`` regex, the grammar engineer's)."""
    # Qwen's <tool_call> and </tool_call> are single added tokens: the grammar names them by id (llguidance's
    # <[id]>), as the model emits them; their text in a regex would be spelled out in plain characters instead.
    call = r'"\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" /[a-z]{1,8}/ "\", \"unit\": \"c\"}}\n"'
    grammar = f"start: <[{TOOL_CALL}]> {call} <[{TOOL_CALL + 1}]>"
    calls = calls_of(
        tools_client, stream, temperature=1.0, seed=5, extra_body={"structured_outputs": {"grammar": grammar}}
    )
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_the_tools_checkpoints_template_renders_tools(tools_stack: Stack) -> None:
    """(The fixture's premise: the template written into the checkpoint is the one served.)"""
    model = Path(load_config(tools_stack.config_path).model_path())
    assert "# Tools" in json.loads((model / "chat_template.json").read_text())["chat_template"]
