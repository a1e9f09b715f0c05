"""Tool calling: the request's ``tools`` and ``tool_choice`` checked, the tools handed to the chat template, and the
answer turned into OpenAI's ``tool_calls`` (whole, or as ``delta.tool_calls`` pieces when streaming).

``tool_choice`` named or ``required``: the answer is constrained by a JSON-schema grammar (the function's
parameters; or an array of ``{"name", "parameters"}``), as vLLM does it, so it works with any chat template.
``auto``: the template renders the tools and the model's own ``<tool_call>{...}</tool_call>`` blocks (Qwen's
format, Hermes' too) are parsed out of its answer. ``none``: the tools are left out of the prompt (a template
that renders them tells the model to call them) and the answer is text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import jsonschema
import llguidance
from pydantic import BaseModel, ConfigDict

from gateway import structured
from gateway.errors import ApiError

# OpenAI's rule for a function's name
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's own limit
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

ChoiceKind = Literal["none", "auto", "required", "named"]


class FunctionCall(BaseModel):
    """An assistant message's call in the history, as OpenAI's clients send it back."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolRequest(Protocol):
    """What of a chat request the tools read (gateway.schema's ChatCompletionRequest; that module imports this
    one, so it is named by its shape)."""

    tools: list[Any] | None
    tool_choice: Any
    parallel_tool_calls: bool | None
    response_format: dict[str, Any] | None


class HistoryMessage(Protocol):
    """What of a chat message the tools read (gateway.schema's ChatMessage)."""

    role: str
    tool_calls: list[ToolCall] | None
    tool_call_id: str | None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def template_form(self) -> dict[str, Any]:
        """As transformers' templates take a tool: ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """What the call's arguments must match: the parameters, always an object (no parameters: an empty one)."""
        parameters = self.parameters if self.parameters is not None else {"properties": {}}
        return parameters if "type" in parameters else {**parameters, "type": "object"}


# ---------------------------------------------------------------------------------------------- request side


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def parse_tools(raw: Any) -> list[Tool]:
    """``tools``: each a function with a valid name, unique, and parameters that are a JSON schema of an object."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    if len(raw) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools, got {len(raw)}", "tools")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        tool = _parse_tool(entry, f"tools.{i}")
        if any(t.name == tool.name for t in tools):
            raise _bad(f"tools.{i}.function.name: {tool.name!r} is offered twice; names must be unique",
                       f"tools.{i}.function.name")  # fmt: skip
        tools.append(tool)
    return tools


def _parse_tool(entry: Any, at: str) -> Tool:
    if not isinstance(entry, dict) or entry.get("type", "function") != "function":
        raise _bad(f"{at}: a tool is {{'type': 'function', 'function': {{'name': ...}}}}", f"{at}.type")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{at}.function: missing; a tool is {{'type': 'function', 'function': {{...}}}}", f"{at}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        got = "missing" if name is None else repr(name)
        raise _bad(f"{at}.function.name: {got}; a function's name is 1 to 64 of a-z, A-Z, 0-9, _ and -",
                   f"{at}.function.name")  # fmt: skip
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{at}.function.description: must be a string", f"{at}.function.description")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_parameters(parameters, f"{at}.function.parameters")
    return Tool(name, description, parameters)


def _check_parameters(parameters: Any, at: str) -> None:
    if not isinstance(parameters, dict):
        raise _bad(f"{at}: must be a JSON schema (an object), got {type(parameters).__name__}", at)
    if parameters.get("type", "object") != "object":
        raise _bad(f"{at}: the arguments are a JSON object: the schema's type must be 'object', "
                   f"got {parameters['type']!r}", at)  # fmt: skip
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise _bad(f"{at}: not a valid JSON schema{' at ' + where if where else ''}: {exc.message}", at) from exc


def parse_tool_choice(raw: Any, tools: list[Tool]) -> tuple[ChoiceKind, str | None]:
    """``tool_choice`` as (kind, the named function's name); absent: ``auto`` with tools, ``none`` without."""
    if raw is None:
        return ("auto", None) if tools else ("none", None)
    if raw == "none":
        return "none", None
    if raw in ("auto", "required"):
        if not tools:
            raise _bad(f"tool_choice {raw!r} needs tools: offer at least one function in tools", "tool_choice")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                   "tool_choice")  # fmt: skip
    if not any(t.name == name for t in tools):
        offered = ", ".join(repr(t.name) for t in tools) or "none"
        raise _bad(f"tool_choice names function {name!r}, which tools does not offer (offered: {offered})",
                   "tool_choice.function.name")  # fmt: skip
    return "named", name


def check_history(messages: Sequence[HistoryMessage]) -> None:
    """Tool messages answer a call by its id; an assistant's calls carry their arguments as a JSON object."""
    for i, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise _bad(f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                       f"messages.{i}.tool_call_id")  # fmt: skip
        if message.tool_calls and message.role != "assistant":
            raise _bad(f"messages.{i}.tool_calls: only assistant messages carry tool calls", f"messages.{i}.tool_calls")
        for j, call in enumerate(message.tool_calls or []):
            at = f"messages.{i}.tool_calls.{j}.function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise _bad(f"{at}: not JSON ({exc})", at) from exc
            if not isinstance(arguments, dict):
                raise _bad(f"{at}: the arguments are a JSON object, got {type(arguments).__name__}", at)


def history_fields(message: HistoryMessage) -> dict[str, Any]:
    """A message's tool fields as the chat templates read them: a call's arguments as a mapping (Qwen2.5's
    template applies ``tojson`` to them; Qwen3's takes a string or a mapping; transformers' convention is the
    mapping), a tool message's ``tool_call_id``."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        fields["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of a call's JSON (`structured.json_schema_grammar`: compact JSON), checked to compile."""
    grammar = structured.json_schema_grammar(schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError("; ".join(messages))
    return grammar


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """``required``: a JSON array of calls, each ``{"name": <one of the tools>, "parameters": <its arguments>}``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.arguments_schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,  # (a call is these two keys: nothing may follow the arguments)
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its answer."""

    kind: ChoiceKind
    tools: list[Tool]
    named: str | None = None
    grammar: str = ""  # llguidance's serialized grammar; "" unconstrained

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the template: none for ``none``, nor for a grammar-made call (the grammar, not the
        template's instructions, shapes its answer: vLLM renders them there too, but a template that has no tools
        section must give the same prompt as one that has, so that named calls behave alike on every checkpoint)."""
        return [t.template_form() for t in self.tools] if self.kind == "auto" else None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer as OpenAI's assistant message, and the finish reason it goes out with."""
        calls, content = self._calls(text, finish_reason)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [c.whole() for c in calls]}
        return message, ("tool_calls" if finish_reason == "stop" else finish_reason)

    def _calls(self, text: str, finish_reason: str | None) -> tuple[list[_Call], str | None]:
        if self.kind == "named" and self.named is not None:
            return [_Call(self.named, text)], None
        if self.kind == "required":
            return _required_calls(text), None
        if self.kind == "auto":
            return parse_tool_calls(text, {t.name for t in self.tools})
        return [], text

    def stream(self) -> ToolStream | None:
        """A per-choice assembler of ``delta.tool_calls``; None where the answer is plain text."""
        if self.kind == "none":
            return None
        return ToolStream(self.kind, self.named, {t.name for t in self.tools})


def plan_tools(request: ToolRequest, renders_tools: Callable[[], bool]) -> ToolPlan:
    """The request's tools checked and planned; every refusal is a 400 before any work is queued.
    ``renders_tools``: whether the checkpoint's chat template renders tools (which ``auto`` needs)."""
    tools = parse_tools(request.tools)
    kind, named = parse_tool_choice(request.tool_choice, tools)
    if kind == "auto" and not renders_tools():
        raise ApiError(
            400,
            "tool_choice 'auto' (the default when tools are given) needs a chat template that renders tools, and "
            "this checkpoint's does not: send tool_choice 'required' or {'type': 'function', 'function': "
            "{'name': ...}} (the call is then made by a grammar), or leave tools out",
            code="unsupported_value",
            param="tool_choice",
        )
    if kind in ("named", "required") and (request.response_format or {}).get("type", "text") != "text":
        raise _bad(f"tool_choice {kind!r} constrains the answer to a call; leave response_format out",
                   "response_format")  # fmt: skip
    if kind == "named":
        tool = next(t for t in tools if t.name == named)
        schema, param = tool.arguments_schema, f"tools.{tools.index(tool)}.function.parameters"
    elif kind == "required":
        schema, param = required_schema(tools, request.parallel_tool_calls is not False), "tools"
    else:
        return ToolPlan(kind, tools)
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as exc:
        raise _bad(f"{param}: the schema cannot be made into a grammar: {exc}", param) from exc
    return ToolPlan(kind, tools, named, grammar)


# ---------------------------------------------------------------------------------------------- answer side


@dataclass
class _Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def whole(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def opening(self, index: int) -> dict[str, Any]:
        """The first streamed piece: index, id, type and name; the arguments follow in later pieces."""
        return {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}


def _arguments_piece(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def _required_calls(text: str) -> list[_Call]:
    """``required``'s array of ``{"name", "parameters"}``; none where it does not parse (cut short)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    calls = [_call_of(item, "parameters") for item in items] if isinstance(items, list) else []
    return [c for c in calls if c is not None]


def _call_of(item: Any, arguments_key: str, names: set[str] | None = None) -> _Call | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, {})
    if not isinstance(arguments, dict) or (names is not None and item["name"] not in names):
        return None
    return _Call(item["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_block(body: str, names: set[str]) -> _Call | None:
    """One ``<tool_call>`` block's JSON; None where it is not a call of an offered function (the client can run
    only those; the text then stays in the content)."""
    try:
        item = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(item, "arguments", names)


def parse_tool_calls(text: str, names: set[str]) -> tuple[list[_Call], str | None]:
    """Qwen's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (any number; the last may be
    left open at the end) as calls, and the text around them as the content (None where there is none). A block
    that does not parse stays in the content as written."""
    calls: list[_Call] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1), names)
        if call is None:
            continue
        kept.append(text[end : match.start()])
        calls.append(call)
        end = match.end()
    kept.append(text[end:])
    content = "".join(kept).strip() if calls else text
    return calls, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """How many of the text's last characters could begin ``tag`` (held back until the next text tells)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolStream:
    """One choice's streamed text turned into OpenAI's deltas: ``{"content": ...}`` and ``{"tool_calls": [piece]}``
    pieces (the first of a call with its index, id, type and name; its arguments in later ones)."""

    kind: ChoiceKind
    named: str | None
    names: set[str]
    pending: str = ""  # text not yet sent: a tag may be starting, or a call is not yet whole
    inside: bool = False  # (auto) within a <tool_call> block
    calls: int = 0  # calls sent so far
    out: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas this text gives, and the finish reason to send (``tool_calls`` for a finished answer that
        made calls)."""
        self.out = []
        final = finish_reason is not None
        if self.kind == "named":
            self._named(text)
        elif self.kind == "required":
            self._required(text)
        else:
            self._auto(text, final)
        if final and self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return self.out, finish_reason

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.out and "content" in self.out[-1]:
            self.out[-1]["content"] += text
        else:
            self.out.append({"content": text})

    def _send(self, call: _Call) -> None:
        self.out.append({"tool_calls": [call.opening(self.calls)]})
        if call.arguments:
            self.out.append({"tool_calls": [_arguments_piece(self.calls, call.arguments)]})
        self.calls += 1

    def _named(self, text: str) -> None:
        if not self.calls and self.named is not None:
            self._send(_Call(self.named, ""))
        if text:
            self.out.append({"tool_calls": [_arguments_piece(0, text)]})

    def _required(self, text: str) -> None:
        """Each call of the array is sent once its object is whole."""
        self.pending += text
        decoder = json.JSONDecoder()
        while True:
            at = len(self.pending) - len(self.pending.lstrip(" \t\r\n[,"))
            if at == len(self.pending):
                return
            try:
                item, end = decoder.raw_decode(self.pending, at)
            except json.JSONDecodeError:
                return  # not whole yet (or the closing bracket)
            self.pending = self.pending[end:]
            call = _call_of(item, "parameters")
            if call is not None:
                self._send(call)

    def _auto(self, text: str, final: bool) -> None:
        self.pending += text
        while True:
            tag = CLOSE if self.inside else OPEN
            at = self.pending.find(tag)
            if at < 0:
                break
            before, self.pending = self.pending[:at], self.pending[at + len(tag) :]
            if self.inside:
                self._block(before, closed=True)
            else:
                self._content(before)
            self.inside = not self.inside
        if self.inside:
            if final:
                self._block(self.pending, closed=False)
                self.pending = ""
            return
        keep = 0 if final else _partial_suffix(self.pending, OPEN)
        self._content(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep :]

    def _block(self, body: str, closed: bool) -> None:
        call = _parse_block(body, self.names)
        if call is None:
            self._content(OPEN + body + (CLOSE if closed else ""))
        else:
            self._send(call)
