"""Structured outputs: the request's output format turned into one llguidance grammar (`SamplingParams.grammar`).

The forms taken (docs/structured-outputs.md), at most one per request:

- ``response_format``: ``{"type": "text"}`` (unconstrained), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. ``strict`` false is constrained to
  the schema all the same, as vLLM does it;
- vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON text), ``regex``, ``choice`` (a list of
  strings), ``grammar`` (Lark or GBNF/EBNF), ``json_object`` (true);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Every grammar is checked against the served tokenizer before the request goes anywhere (a 400 naming the
parameter and the problem), and the verdict is cached by the grammar's text. JSON is generated compact (no
whitespace between tokens): the model cannot pad an answer with runs of newlines until its token limit.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from gateway.errors import ApiError

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
CHECKED_GRAMMARS = 1024  # verdicts kept (a grammar's text and its error, "" when it compiles)
LEGACY_FORMS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FORMS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs keys that change nothing here: JSON is compact already, and there is one backend.
STRUCTURED_NEUTRAL = ("disable_any_whitespace", "disable_fallback", "backend")


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON values valid under ``schema`` (compact JSON). Unchecked: see `GrammarChecker`."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", code="invalid_value", param=param)


def _form_grammar(form: str, value: Any, param: str) -> str:
    """One form's value as a grammar; a value of the wrong type is a 400 naming ``param``."""
    if form == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _bad(param, f"the schema is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise _bad(param, "must be a JSON schema (an object)")
        return json_schema_grammar(value)
    if form == "json_object":
        if value is not True:
            raise _bad(param, "must be true")
        return json_schema_grammar(ANY_JSON_OBJECT)
    if form == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad(param, "must be a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    if form == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    try:  # form == "grammar": Lark, or GBNF/EBNF converted to Lark
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise _bad(param, f"the grammar does not parse: {exc}") from exc


def _response_format_grammar(response_format: Any) -> str | None:
    if not isinstance(response_format, dict):
        raise _bad("response_format", "must be an object with a type")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise ApiError(
            400,
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            code="unsupported_value",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object with name and schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON schema (an object)")
    return json_schema_grammar(schema)  # strict or not: constrained to the schema (vLLM's way)


def _structured_outputs_grammar(options: Any) -> tuple[str, str]:
    if not isinstance(options, dict):
        raise _bad("structured_outputs", f"must be an object with one of {', '.join(STRUCTURED_FORMS)}")
    unknown = sorted(set(options) - set(STRUCTURED_FORMS) - set(STRUCTURED_NEUTRAL))
    if unknown:
        message = f"structured_outputs: {', '.join(unknown)} is not supported; use one of {', '.join(STRUCTURED_FORMS)}"
        raise ApiError(400, message, code="unsupported_value", param="structured_outputs")
    forms = [f for f in STRUCTURED_FORMS if options.get(f) not in (None, False)]
    if len(forms) != 1:
        raise _bad("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_FORMS)}, got {len(forms)}")
    param = f"structured_outputs.{forms[0]}"
    return _form_grammar(forms[0], options[forms[0]], param), param


FORM_PARAMS = ("response_format", "structured_outputs", *LEGACY_FORMS)


def requested_grammar(options: object) -> tuple[str, str] | None:
    """The request's grammar and the parameter it came from, or None when it asks for none; a 400 where two
    forms are given or one has the wrong type. ``options``: the parsed request (its `FORM_PARAMS` attributes)."""
    body = {name: getattr(options, name, None) for name in FORM_PARAMS}
    asked = [name for name in FORM_PARAMS if body[name] is not None]
    if "response_format" in asked and _response_format_grammar(body["response_format"]) is None:
        asked.remove("response_format")  # {"type": "text"}: no constraint
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(asked)} both constrain the output; give one", param=asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _response_format_grammar(body[name]) or "", name
    if name == "structured_outputs":
        return _structured_outputs_grammar(body[name])
    return _form_grammar(LEGACY_FORMS[name], body[name], name), name


class GrammarChecker:
    """Checks grammars against the served tokenizer (built for llguidance once, on first use, off the loop)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # grammar -> its error ("": it compiles)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer)  # (about a second)
            return self._tokenizer

    def error(self, grammar: str) -> str:
        """Why ``grammar`` cannot be matched ("" when it can); blocking: compiles it on a cache miss."""
        verdict = self._verdicts.get(grammar)
        if verdict is None:
            verdict = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer()) or self._spelled_tokens(grammar)
            with self._lock:
                self._verdicts[grammar] = verdict
                while len(self._verdicts) > CHECKED_GRAMMARS:
                    self._verdicts.popitem(last=False)
        return verdict

    def _spelled_tokens(self, grammar: str) -> str:
        """Why a regex or Lark grammar that spells out an added token's text (Qwen's ``<tool_call>``) is refused:
        the model emits such a token whole, and llguidance's mask can allow it where its matcher then rejects it
        (the request would fail mid-answer). Named by id (``<[151657]>``) the token matches as the model emits it."""
        texts = grammar  # (a grammar is llguidance's JSON, or Lark text as it is)
        if grammar.lstrip().startswith("{"):
            entries = json.loads(grammar).get("grammars", [])
            texts = " ".join(str(entry.get("lark_grammar") or "") for entry in entries)
        texts = texts.replace("\\", "")  # (a regex escapes the token's | and [ characters)
        added = self.hf_tokenizer.added_tokens_decoder
        spelled = [
            f"{token.content} (<[{i}]>)"
            for i, token in added.items()
            if len(token.content) > 1 and token.content in texts
        ]
        if not spelled:
            return ""
        return (
            f"it spells out {', '.join(spelled[:4])}, which the model emits as single tokens: name them by id in a "
            "Lark grammar, e.g. <[id]>"
        )

    async def grammar(self, options: object) -> str:
        """The checked grammar the request asks for ("" for none); a 400 naming the parameter otherwise."""
        found = requested_grammar(options)
        if found is None:
            return ""
        grammar, param = found
        if grammar in self._verdicts:
            error = self._verdicts[grammar]
        else:  # a compile can take long for a large schema, and the first one builds the tokenizer
            error = await asyncio.get_running_loop().run_in_executor(None, self.error, grammar)
        if error:
            raise _bad(param, f"cannot be compiled: {error.strip()}")
        return grammar
