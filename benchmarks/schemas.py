"""The JSON schemas of the ``structured`` workload and of `benchmarks.grammar_cost`: what agents and document
extraction send (nested objects, enums, arrays with bounds, integer ranges, ``$ref``/``$defs``, optional fields,
a pattern), each with a task for the prompt and one valid answer.

Every string has a ``maxLength`` and every array a ``maxItems``, so each grammar is finite: a constrained answer
ends when its grammar does, whatever the weights (a random-weight checkpoint's answers too). The example answers
are compact JSON with the properties in the schema's order, as the constrained decoders of both libraries write
them, so a matcher can be walked through their tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    task: str  # what the prompt asks for, after "Reply with a JSON object ..."
    schema: dict[str, Any]
    example: dict[str, Any]  # a valid answer, properties in the schema's order

    def example_text(self) -> str:
        return json.dumps(self.example, separators=(",", ":"))


def _object(properties: dict[str, Any], required: list[str], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False, **more}


def _string(max_length: int, **more: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **more}


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


INVOICE = SchemaCase(
    "invoice",
    "with the vendor, the currency, every line item and the total of the invoice in the text.",
    _object(
        {
            "vendor": _string(24),
            "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3},
            "total_cents": _integer(0, 10_000_000),
            "paid": {"type": "boolean"},
        },
        ["vendor", "currency", "items", "total_cents"],
        **{
            "$defs": {
                "line": _object(
                    {"description": _string(24), "quantity": _integer(1, 99), "unit_cents": _integer(0, 1_000_000)},
                    ["description", "quantity", "unit_cents"],
                )
            }
        },
    ),
    {
        "vendor": "Acme Office Supply",
        "currency": "EUR",
        "items": [
            {"description": "Printer paper", "quantity": 4, "unit_cents": 899},
            {"description": "Stapler", "quantity": 1, "unit_cents": 1450},
        ],
        "total_cents": 5046,
        "paid": True,
    },
)

UI_ACTION = SchemaCase(
    "ui_action",
    "naming the next action a user interface agent should take, where on the screen, and why.",
    _object(
        {
            "action": {"enum": ["click", "type", "scroll", "wait", "done"]},
            "target": _object({"x": _integer(0, 4096), "y": _integer(0, 4096)}, ["x", "y"]),
            "text": _string(32),
            "reason": _string(48),
        },
        ["action", "target", "reason"],
    ),
    {"action": "click", "target": {"x": 412, "y": 1088}, "reason": "The submit button is below the form"},
)

PERSON = SchemaCase(
    "person",
    "describing the person in the text: name, age, postal address and email addresses.",
    _object(
        {
            "name": _string(32),
            "age": _integer(0, 120),
            "address": _object(
                {
                    "street": _string(32),
                    "city": _string(24),
                    "country": {"enum": ["FR", "DE", "GB", "US", "JP", "other"]},
                },
                ["city", "country"],
            ),
            "emails": {"type": "array", "items": _string(32), "minItems": 0, "maxItems": 2},
        },
        ["name", "age", "address"],
    ),
    {
        "name": "Marie Dupont",
        "age": 41,
        "address": {"street": "12 rue des Lilas", "city": "Lyon", "country": "FR"},
        "emails": ["marie@example.org"],
    },
)

CLASSIFICATION = SchemaCase(
    "classification",
    "classifying the text: one label, a confidence from 0 to 100 and up to four keywords.",
    _object(
        {
            "label": {"enum": ["invoice", "receipt", "letter", "form", "photo", "other"]},
            "confidence": _integer(0, 100),
            "keywords": {"type": "array", "items": _string(16), "minItems": 1, "maxItems": 4},
        },
        ["label", "confidence", "keywords"],
    ),
    {"label": "letter", "confidence": 87, "keywords": ["insurance", "claim", "water damage"]},
)

TABLE = SchemaCase(
    "table",
    "holding the table in the text: its title, its unit and its rows of labels and values.",
    _object(
        {
            "title": _string(32),
            "unit": {"enum": ["count", "percent", "EUR", "USD", "kg"]},
            "rows": {"type": "array", "items": {"$ref": "#/$defs/row"}, "minItems": 1, "maxItems": 4},
        },
        ["title", "rows"],
        **{"$defs": {"row": _object({"label": _string(16), "value": _integer(-1000, 1000)}, ["label", "value"])}},
    ),
    {
        "title": "Claims per quarter",
        "unit": "count",
        "rows": [{"label": "Q1", "value": 120}, {"label": "Q2", "value": 98}, {"label": "Q3", "value": -4}],
    },
)

RECEIPT = SchemaCase(
    "receipt",
    "with what the receipt in the text shows: merchant, date, tip and the card's last four digits, "
    "leaving out what it does not show.",
    _object(
        {
            "merchant": _string(24),
            "date": _string(10, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"),
            "tip_cents": _integer(0, 100_000),
            "card_last4": _string(4, pattern=r"^[0-9]{4}$"),
        },
        ["merchant"],
    ),
    {"merchant": "Cafe Central", "date": "2026-03-14", "card_last4": "4242"},
)

CASES: tuple[SchemaCase, ...] = (INVOICE, UI_ACTION, PERSON, CLASSIFICATION, TABLE, RECEIPT)
SCHEMAS: dict[str, SchemaCase] = {case.name: case for case in CASES}


def case_for(index: int) -> SchemaCase:
    """The schemas in turn: request ``index`` gets ``CASES[index % len(CASES)]``."""
    return CASES[index % len(CASES)]


def response_format(case: SchemaCase) -> dict[str, Any]:
    """OpenAI's strict ``json_schema`` response format of ``case`` (vLLM 0.22 takes it as is)."""
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}


def check_answer(case: SchemaCase, text: str) -> tuple[bool, bool | None]:
    """(the answer parses as JSON, it validates against the schema); the second is None where ``jsonschema`` is
    not installed (it is a test extra, not in every benchmark machine's environment)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    try:
        import jsonschema
    except ImportError:
        return True, None
    return True, jsonschema.Draft202012Validator(case.schema).is_valid(value)
