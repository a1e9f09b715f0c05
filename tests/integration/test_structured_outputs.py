"""Structured outputs through the real stack with the official client, on Qwen2-VL's and Qwen3-VL's tiny
checkpoints: every constrained answer parses and validates (random weights emit garbage, so only the grammar
can make them valid), bad grammars are refused by name, and unconstrained requests in the same batch still
match transformers."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack
from tests.integration.test_chat_parity import check_parity

FAMILIES = ["qwen2_vl", "qwen3_vl"]
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 300  # every schema below is finite (bounded strings, enums, ranges, bounded arrays): it closes

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "floor": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 9}},
                "required": ["city", "floor"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2,
                      "maxItems": 4},
    "integer_range": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
                      "required": ["age"], "additionalProperties": False},
    "ref_defs": {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/point"}, "work": {"$ref": "#/$defs/point"}},
        "required": ["home", "work"],
        "additionalProperties": False,
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                               "y": {"type": "boolean"}},
                            "required": ["x", "y"], "additionalProperties": False}},
    },
    "optional_fields": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1000}, "note": {"type": "string",
                                                                                       "maxLength": 5},
                       "flag": {"type": "boolean"}},
        "required": ["id"],
        "additionalProperties": False,
    },
}  # fmt: skip


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
    return HfChat(load_config(stack.config_path).model_path())


def create(client: OpenAI, **options: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=options.pop("messages", MESSAGES),
        max_tokens=options.pop("max_tokens", MAX_TOKENS),
        **options,
    )


def json_schema_format(name: str, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": strict}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates_against_its_schema(client: OpenAI, temperature: float) -> None:
    def one(name: str) -> tuple[str, Any]:
        return name, create(client, temperature=temperature, seed=3, response_format=json_schema_format(name))

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # constrained rows batched together
        replies = dict(pool.map(one, SCHEMAS))
    for name, reply in replies.items():
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_non_strict_schemas_n_choices_logprobs_and_streams_are_constrained(client: OpenAI) -> None:
    reply = create(client, temperature=1.0, n=3, logprobs=True, top_logprobs=2,
                   response_format=json_schema_format("ref_defs", strict=False))  # fmt: skip
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["ref_defs"])
        assert all(entry.logprob > float("-inf") for entry in choice.logprobs.content)
    stream = create(client, temperature=1.0, stream=True, extra_body={"guided_json": SCHEMAS["nested"]})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_json_object_answers_parse(client: OpenAI, stack: Stack) -> None:
    tokenizer = AutoTokenizer.from_pretrained(load_config(stack.config_path).model_path())
    (close,) = tokenizer.encode("}")  # pushed hard: the grammar still makes the answer start with {
    reply = create(client, temperature=0, response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    again = create(client, temperature=0, max_tokens=2, extra_body={"structured_outputs": {"json_object": True}})
    assert again.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": "[a-c]{2}-[0-9]{3}"}, re.compile("[a-c]{2}-[0-9]{3}").fullmatch),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, re.compile("(yes|no)!").fullmatch),
        ({"guided_choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        ({"structured_outputs": {"choice": ["Paris", "Oslo"]}}, lambda t: t in ("Paris", "Oslo")),
        ({"guided_grammar": 'start: "x=" NUM\nNUM: /[0-9]{1,3}/'}, re.compile("x=[0-9]{1,3}").fullmatch),
        ({"structured_outputs": {"grammar": 'root ::= "ok" | "fine"'}}, lambda t: t in ("ok", "fine")),
    ],
)
def test_regex_choice_and_grammar_forms_match(client: OpenAI, extra: dict[str, Any], check: Any) -> None:
    for temperature in (0.0, 1.0):
        reply = create(client, temperature=temperature, extra_body={**extra, "ignore_eos": True, "min_tokens": 5})
        assert reply.choices[0].finish_reason == "stop"
        assert check(reply.choices[0].message.content), reply.choices[0].message.content


@pytest.mark.parametrize(
    ("options", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "foo"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "guided_json", "missing"),
        ({"extra_body": {"guided_regex": "a["}}, "guided_regex", "regex"),
        ({"extra_body": {"guided_choice": "yes"}}, "guided_choice", "list"),
        ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar", "undefined_rule"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "one of"),
        ({"extra_body": {"structured_outputs": {"json": 5}}}, "structured_outputs.json", "schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "one"),
    ],
)  # fmt: skip
def test_bad_forms_are_refused_naming_the_parameter(
    client: OpenAI, options: dict[str, Any], param: str, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, max_tokens=4, **options)
    error = caught.value.body
    assert error["param"] == param, error  # type: ignore[index]
    assert needle.lower() in error["message"].lower(), error  # type: ignore[index]


def test_unconstrained_requests_beside_constrained_ones_still_match_transformers(client: OpenAI, hf: HfChat) -> None:
    def constrained(i: int) -> Any:
        return create(client, temperature=1.0, seed=i, response_format=json_schema_format("nested"))

    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(constrained, i) for i in range(3)]
        check_parity(client, hf, [{"role": "user", "content": "Write a haiku about the sea."}])
        for future in busy:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), SCHEMAS["nested"])
