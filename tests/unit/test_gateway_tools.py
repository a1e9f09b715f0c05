"""Tool calling in the gateway: tools and tool_choice checked (400s naming the parameter), the grammars of named and
required choices, the prompt rendered with tools and tool history as transformers renders it, and the answer's
``<tool_call>`` blocks parsed, whole and streamed (on recorded token streams)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.app import sampling_params
from gateway.detokenize import IncrementalDetokenizer
from gateway.errors import ApiError
from gateway.prompt import PromptBuilder
from gateway.schema import parse_chat_request
from gateway.tools import ToolPlan, parse_tool_calls, plan_tools, required_schema
from tests.tool_template import with_tools_template
from workers.models.synth import generate_checkpoint

USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def plan(renders_tools: bool = True, **body: Any) -> ToolPlan:
    return plan_tools(parse_chat_request({"messages": [USER], **body}), lambda: renders_tools)


def refused(param: str, needle: str, renders_tools: bool = True, **body: Any) -> None:
    with pytest.raises(ApiError) as raised:
        plan(renders_tools, **body)
    assert raised.value.status == 400
    assert raised.value.param == param, raised.value.message
    assert needle.lower() in raised.value.message.lower(), raised.value.message


# ------------------------------------------------------------------------------------------------ the request


@pytest.mark.parametrize(
    ("tools", "param", "needle"),
    [
        ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name", "missing"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools.0.function.name", "'has space'"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools.0.function.name", "1 to 64"),
        ([WEATHER, WEATHER], "tools.1.function.name", "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "city"}}], "tools.0.function.parameters",
         "JSON schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "tools.0.function.parameters", "'object'"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integr"}}}}}],
         "tools.0.function.parameters", "not a valid JSON schema at properties.a.type"),
        ([{"type": "retrieval"}], "tools.0.type", "'function'"),
        ([{"type": "function"}], "tools.0.function", "missing"),
        ({"name": "f"}, "tools", "list"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_path(tools: Any, param: str, needle: str) -> None:
    refused(param, needle, tools=tools, tool_choice="required")


def test_tool_choice_is_checked_against_the_tools() -> None:
    refused("tool_choice.function.name", "'get_time'", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tool_choice", "needs tools", tool_choice="auto")
    refused("tool_choice", "'none', 'auto'", tools=[WEATHER], tool_choice="sometimes")
    refused("tool_choice", "'none', 'auto'", tools=[WEATHER], tool_choice={"type": "function"})
    refused("response_format", "response_format", tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"})  # fmt: skip


def test_auto_needs_a_template_that_renders_tools() -> None:
    refused("tool_choice", "chat template that renders tools", renders_tools=False, tools=[WEATHER])
    refused("tool_choice", "chat template", renders_tools=False, tools=[WEATHER], tool_choice="auto")
    assert plan(renders_tools=True, tools=[WEATHER]).kind == "auto"  # (auto: the default with tools)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        assert plan(renders_tools=False, tools=[WEATHER], tool_choice=choice).kind != "auto"


def test_none_and_no_tools_change_nothing() -> None:
    for body in ({}, {"tools": [WEATHER], "tool_choice": "none"}, {"tool_choice": "none"}):
        chosen = plan(**body)
        assert (chosen.grammar, chosen.template_tools, chosen.stream()) == ("", None, None)
        assert chosen.message("hi <tool_call>", "stop") == ({"role": "assistant", "content": "hi <tool_call>"}, "stop")


def test_legacy_functions_point_at_tools() -> None:
    with pytest.raises(ApiError, match="send the functions as tools") as raised:
        parse_chat_request({"messages": [USER], "functions": [{"name": "f"}]})
    assert raised.value.param == "functions"


def schema_of(grammar: str) -> dict[str, Any]:
    """The JSON schema a grammar holds, without llguidance's options (``x-guidance``: compact JSON)."""
    schema = dict(json.loads(grammar)["grammars"][0]["json_schema"])
    schema.pop("x-guidance", None)
    return schema


def test_named_choice_constrains_to_the_functions_parameters() -> None:
    chosen = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert chosen.kind == "named" and chosen.template_tools is None
    assert schema_of(chosen.grammar) == WEATHER["function"]["parameters"]
    no_parameters = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert schema_of(no_parameters.grammar) == {"properties": {}, "type": "object"}
    request = parse_chat_request({"messages": [USER], "tools": [WEATHER], "tool_choice": "required"})
    assert sampling_params(request).grammar == ""  # (the grammar joins in the gateway's _submit)


def test_required_schema_takes_calls_of_the_tools_only() -> None:
    tools = plan(tools=[WEATHER, TIME], tool_choice="required").tools
    one = required_schema(tools, parallel=False)
    many = required_schema(tools, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, one)
    jsonschema.validate([*good, {"name": "get_time", "parameters": {}}], many)
    for bad, schema in (
        ([], many),  # at least one call
        ([*good, *good], one),  # parallel_tool_calls false: one
        ([{"name": "get_weather", "parameters": {}}], one),  # its parameters' schema holds
        ([{"name": "get_weather", "parameters": {"city": 3}}], many),
        ([{"name": "launch", "parameters": {}}], many),  # not an offered tool
        ([{"name": "get_time"}], many),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert (
        "maxItems"
        not in json.loads(plan(tools=[WEATHER], tool_choice="required").grammar)["grammars"][0]["json_schema"]
    )
    serial = plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(serial.grammar)["grammars"][0]["json_schema"]["maxItems"] == 1


def test_a_schema_the_grammar_cannot_take_is_a_400() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}
    refused("tools.0.function.parameters", "cannot be made into a grammar", tools=[tool],
            tool_choice={"type": "function", "function": {"name": "f"}})  # fmt: skip
    assert plan(tools=[tool]).kind == "auto"  # (auto makes no grammar)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "42"}, "messages.1.tool_call_id"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{'a': 1}"}}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
         "messages.1.tool_calls"),
    ],
)  # fmt: skip
def test_bad_tool_history_is_refused(message: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_chat_request({"messages": [USER, message]})
    assert raised.value.param == param, raised.value.message


# ------------------------------------------------------------------------------------------------ the prompt


@pytest.fixture(scope="module")
def tools_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = generate_checkpoint(tmp_path_factory.mktemp("tools") / "tiny", "tiny", 0, family="qwen3_vl")
    return with_tools_template(model)


@pytest.fixture(scope="module")
def tokenizer(tools_checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tools_checkpoint))


HISTORY = [
    {"role": "system", "content": "Be brief."},
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
]  # fmt: skip


def test_the_prompt_renders_tools_and_tool_history_as_transformers_does(tools_checkpoint: Path) -> None:
    builder = PromptBuilder(tools_checkpoint)
    assert builder.renders_tools
    request = parse_chat_request({"messages": HISTORY, "tools": [WEATHER, TIME]})
    chosen = plan_tools(request, lambda: builder.renders_tools)
    ids = builder.build(request.messages, tools=chosen.template_tools).token_ids
    # transformers' convention: the arguments as a mapping
    hf_history = json.loads(json.dumps(HISTORY))
    for call in hf_history[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    hf_history[2]["content"] = ""
    expected = builder.tokenizer.apply_chat_template(
        hf_history, tools=[WEATHER, TIME], chat_template=builder.chat_template, add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )  # fmt: skip
    assert ids == list(expected)
    text = builder.tokenizer.decode(ids)
    assert json.dumps(WEATHER) in text  # the tools section
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C, sunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>" in text
    without = builder.build(request.messages).token_ids
    assert len(ids) > len(without)


def test_templates_without_a_tools_section_are_detected(tmp_path: Path) -> None:
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):  # the synthetic templates leave tools out
        assert not PromptBuilder(generate_checkpoint(tmp_path / family, "tiny", 0, family=family)).renders_tools


# ------------------------------------------------------------------------------------------------ the answer

ANSWER = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
NAMES = {"get_weather", "get_time"}


def test_tool_call_blocks_are_parsed_and_the_rest_is_content() -> None:
    calls, content = parse_tool_calls(ANSWER, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})
    ]  # fmt: skip
    assert content == "Let me look."
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(
    ("text", "names", "content"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {}}', ["get_time"], None),  # left open at the end
        ('<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>', [], '<tool_call>\n{"name": "get_time", '
         '"arguments": {}\n</tool_call>'),  # not JSON: stays content
        ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', [], '<tool_call>\n{"name": "launch", '
         '"arguments": {}}\n</tool_call>'),  # not an offered tool
        ('<tool_call>\n{"name": "get_time", "arguments": "now"}\n</tool_call>', [], '<tool_call>\n{"name": '
         '"get_time", "arguments": "now"}\n</tool_call>'),  # arguments not an object
        ('a <tool_call>oops</tool_call> b <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> c',
         ["get_time"], "a <tool_call>oops</tool_call> b  c"),
        ("no calls at all", [], "no calls at all"),
    ],
)  # fmt: skip
def test_blocks_that_are_not_calls_stay_in_the_content(text: str, names: list[str], content: str | None) -> None:
    calls, found = parse_tool_calls(text, NAMES)
    assert [c.name for c in calls] == names
    assert found == content


def test_the_whole_message_of_each_choice() -> None:
    auto = plan(tools=[WEATHER, TIME])
    message, finish = auto.message(ANSWER, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str) for c in message["tool_calls"])
    assert auto.message("plain", "stop") == ({"role": "assistant", "content": "plain"}, "stop")
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message, finish = named.message('{"city": "Oslo"}', "stop")
    assert (finish, message["content"]) == ("tool_calls", None)
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert named.message('{"city": "Os', "length")[1] == "length"  # cut short: said so
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    message, finish = required.message('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                       '"parameters": {"city": "Rome"}}]', "stop")  # fmt: skip
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_time", {}), ("get_weather", {"city": "Rome"})
    ]  # fmt: skip
    assert required.message('[{"name": "get_ti', "length") == (
        {"role": "assistant", "content": '[{"name": "get_ti'}, "length"
    )  # fmt: skip


def as_client_assembles(chunks: list[tuple[list[dict[str, Any]], str | None]]) -> dict[str, Any]:
    """The deltas joined as OpenAI's client libraries join them; each call's first piece must carry its id, type and
    name, and later pieces only arguments."""
    content, calls, finish = "", {}, None
    for deltas, finish_reason in chunks:
        finish = finish_reason or finish
        for delta in deltas:
            content += delta.get("content", "")
            for piece in delta.get("tool_calls", []):
                if piece["index"] not in calls:
                    assert piece["type"] == "function" and piece["id"].startswith("call_"), piece
                    calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in piece and "name" not in piece["function"], piece
                calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def recorded(tokenizer: PreTrainedTokenizerBase, text: str) -> list[str]:
    """The text as the gateway's detokenizer hands it over, token by token."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]


def streamed(chosen: ToolPlan, pieces: list[str], finish: str = "stop") -> dict[str, Any]:
    stream = chosen.stream()
    assert stream is not None
    return as_client_assembles([stream.feed(p, finish if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)])


def whole(chosen: ToolPlan, text: str, finish: str = "stop") -> dict[str, Any]:
    message, finish_reason = chosen.message(text, finish)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.get(
        "tool_calls", [])]  # fmt: skip
    return {"content": message["content"], "calls": calls, "finish": finish_reason}


@pytest.mark.parametrize(
    "text",
    [
        ANSWER,
        "no call here, only <tool_ and <tool_call text that is no call",
        'before <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> after',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>bad</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}',  # left open at the end
    ],
)
def test_auto_streams_what_the_whole_answer_gives(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    auto = plan(tools=[WEATHER, TIME])
    expected = whole(auto, text)
    for pieces in (recorded(tokenizer, text), list(text), [text]):
        got = streamed(auto, pieces)
        assert got["calls"] == expected["calls"]
        assert got["finish"] == expected["finish"]
        assert (got["content"].strip() or None) == expected["content"]


def test_auto_holds_content_back_while_a_tag_may_be_starting() -> None:
    stream = plan(tools=[TIME]).stream()
    assert stream is not None
    assert stream.feed("Hi <tool", None) == ([{"content": "Hi "}], None)
    assert stream.feed("box", None) == ([{"content": "<toolbox"}], None)
    deltas, _ = stream.feed(' <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool', None)
    assert deltas == [{"content": " "}]  # the call is sent once whole
    deltas, finish = stream.feed("_call>", "stop")
    assert [list(d["tool_calls"][0]) for d in deltas] == [["index", "id", "type", "function"], ["index", "function"]]
    assert finish == "tool_calls"


def test_named_and_required_stream_what_the_whole_answer_gives(tokenizer: PreTrainedTokenizerBase) -> None:
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    arguments = '{"city": "Paris", "unit": "f"}'
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    calls = '[{"name": "get_weather", "parameters": {"city": "[x]"}}, {"name": "get_time", "parameters": {}}]'
    for chosen, text in ((named, arguments), (required, calls)):
        expected = whole(chosen, text)
        assert expected["finish"] == "tool_calls" and expected["calls"]
        for pieces in (recorded(tokenizer, text), list(text)):
            got = streamed(chosen, pieces)
            assert (got["calls"], got["finish"], got["content"]) == (expected["calls"], "tool_calls", "")
    assert streamed(named, ['{"city"', ': "Pa'], "length")["finish"] == "length"
