"""The OpenAI chat-completions request, validated; anything we cannot honour is refused by name."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import ApiError
from gateway.tools import ToolCall, check_history

# Every integer crosses a socket as msgpack, which holds 64 bits: larger ones are refused here, by name,
# rather than failing to encode (an HTTP 500) after validation.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


def _null_means_unset(model: type[BaseModel], body: Any) -> Any:
    """OpenAI's options are nullable: a client passing None for one (the official client sends it as null)
    means "not set", so the default applies. Fields where null means something (``max_tokens``) keep it."""
    if not isinstance(body, dict):
        return body
    fields = model.model_fields
    return {k: v for k, v in body.items() if v is not None or k not in fields or _takes_none(fields[k].annotation)}


def _takes_none(annotation: Any) -> bool:
    return annotation is None or type(None) in getattr(annotation, "__args__", ())


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str
    detail: str | None = None
    min_pixels: int | None = Field(default=None, gt=0, le=INT64_MAX)
    max_pixels: int | None = Field(default=None, gt=0, le=INT64_MAX)


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(BaseModel):
    """The non-OpenAI ``video_url`` part (as vLLM and Qwen's own servers accept it)."""

    model_config = ConfigDict(extra="allow")
    url: str
    fps: float | None = Field(default=None, gt=0, le=60, allow_inf_nan=False)
    min_pixels: int | None = Field(default=None, gt=0, le=INT64_MAX)
    max_pixels: int | None = Field(default=None, gt=0, le=INT64_MAX)


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: VideoUrl


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


_PART_TAGS = ("text", "image_url", "video_url")
_PART_TYPE_ERRORS = {
    "union_tag_not_found": "a content part needs a type: 'text', 'image_url' or 'video_url'",
}


def _spelled_out(part: Any) -> Any:
    """A part as the schema reads it, from the shorter forms vLLM also takes: no ``type`` (``{"image_url": ...}``,
    which OpenAI's own clients once sent) and a media URL given as a bare string."""
    if not isinstance(part, dict):
        return part
    if "type" not in part:
        tag = next((t for t in _PART_TAGS if t in part), None)
        part = {"type": tag, **part} if tag else part
    kind = part.get("type")
    if kind in ("image_url", "video_url") and isinstance(part.get(kind), str):
        part = {**part, kind: {"url": part[kind]}}
    return part


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # (an assistant's)
    tool_call_id: str | None = None  # (a tool's: the call it answers)

    @field_validator("content", mode="before")
    @classmethod
    def _short_parts(cls, content: Any) -> Any:
        return [_spelled_out(p) for p in content] if isinstance(content, list) else content


COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI answers it
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (OpenAI's own limit is lower)
_TOKEN_ID = re.compile(r"[0-9]{1,9}")


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationOptions(BaseModel):
    """What chat and text completions share: sampling, stopping, streaming."""

    # The OpenAI API ignores fields it does not know; Python's JSON parser takes NaN and Infinity, which are
    # not numbers any option can mean.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)  # 0: the top token only (OpenAI takes 0)
    top_k: int = Field(default=0, ge=0, le=INT64_MAX)
    seed: Int64 | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=8)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    stop_token_ids: list[Int64] = Field(default_factory=list)
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False  # (vLLM's)
    skip_special_tokens: bool = True  # (vLLM's)
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # structured outputs, vLLM's forms (gateway/structured.py turns them into a grammar and checks it)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, body: Any) -> Any:
        return _null_means_unset(cls, body)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for key in bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys are token ids (decimal integers as strings), got {key!r}")
        return bias

    @property
    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        return [(int(key), value) for key, value in (self.logit_bias or {}).items()]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_asked(self) -> int:
        """-1: no logprobs; 0: the chosen token's; k: also the k most likely."""
        return -1


class ChatCompletionRequest(GenerationOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None  # (gateway/structured.py)
    # Read only to refuse them: each would change the answer, so ignoring it would mislead the client.
    # tools: checked by gateway.tools.plan_tools
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    # vLLM's chat-template options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_asked(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionRequest(GenerationOptions):
    """The legacy ``/v1/completions``: a text prompt, no chat template, no images."""

    # one prompt (text or token ids) or a batch of them, as OpenAI and vLLM take it (lm-eval sends [[ids]])
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    # OpenAI's (and vLLM's) default for this endpoint: a client that leaves it out expects a short answer,
    # not one running to the context's end. null: the checkpoint's limit (generation_config.json), else the
    # context's.
    max_tokens: int | None = Field(default=COMPLETIONS_MAX_TOKENS, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @property
    def top_logprobs_asked(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


MAX_CHOICES = 64  # prompts of a batch times n: each is a request in flight


def _validate(model: type[GenerationOptions], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    where = _unpaired_surrogate(body, "")
    if where is not None:
        raise ApiError(
            400,
            f"{where or 'the body'} holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), which is "
            "not text: escape characters outside the BMP as a surrogate pair, or send them as UTF-8",
            code="invalid_value",
            param=where or None,
        )
    _refuse_extensions_we_cannot_honour(body)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        # The deepest error is the specific one (a union of str | list reports both branches).
        worst = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(p) for p in _client_path(worst["loc"]))
        message = _PART_TYPE_ERRORS.get(worst["type"], worst["msg"])
        raise ApiError(400, f"invalid request: {where}: {message}", code="invalid_value", param=where) from exc
    if request.stop == "":
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return request


# vLLM's request extensions that would change the answer, with why they cannot be honoured here; each is
# refused unless it is at the value that changes nothing (null, false, empty), never silently ignored.
_EXTENSIONS_REFUSED = {
    "echo": "the answer does not repeat the prompt here",
    "prompt_logprobs": "logprobs are given for generated tokens only",
    "use_beam_search": "beam search is not implemented; sample n choices instead",
    "truncate_prompt_tokens": "prompts are not truncated: shorten the messages",
    "allowed_token_ids": "use logit_bias to steer tokens",
    "bad_words": "use logit_bias to steer tokens",
    "logits_processors": "custom logits processors are not loaded",
    "mm_processor_kwargs": "set min_pixels / max_pixels inside each image_url or video_url",
    "documents": "Qwen2-VL's chat template has no documents",
}


def _refuse_extensions_we_cannot_honour(body: dict[str, Any]) -> None:
    for name, why in _EXTENSIONS_REFUSED.items():
        value = body.get(name)
        if not (value is None or value is False or value in ([], {}, "")):  # (0 is a value: prompt_logprobs 0)
            raise ApiError(400, f"{name} is not supported: {why}; leave it out", code="unsupported_value", param=name)
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "best_of is not supported; use n", code="unsupported_value", param="best_of")
    if body.get("length_penalty") not in (None, 1, 1.0):
        raise ApiError(400, "length_penalty needs beam search, which is not implemented", param="length_penalty")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unpaired_surrogate(body: Any, where: str) -> str | None:
    """The path of the first string with a lone surrogate (JSON's "\\ud800" decodes to one, and no tokenizer
    or encoder takes it), or None. A walk with its own stack: a body may nest as deep as the JSON parser
    allows, deeper than Python's recursion limit leaves room for here."""
    stack: list[tuple[Any, str]] = [(body, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            # isascii() reads a flag CPython keeps: a large base64 image is not scanned
            if not value.isascii() and _SURROGATE.search(value):
                return at
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):  # (reversed: the first bad string is the one named)
            if isinstance(key, str) and _SURROGATE.search(key):
                return f"{at}.<key>" if at else "<key>"
            stack.append((item, f"{at}.{key}" if at else str(key)))
    return None


def parse_completion_request(body: Any) -> CompletionRequest:
    request: CompletionRequest = _validate(CompletionRequest, body)
    prompts = request.prompts
    for i, prompt in enumerate(prompts):
        if prompt in ("", []):
            raise ApiError(400, "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty", param="prompt")
    if len(prompts) * request.n > MAX_CHOICES:
        raise ApiError(
            400,
            f"{len(prompts)} prompts times n = {request.n} is {len(prompts) * request.n} choices; at most "
            f"{MAX_CHOICES} per request: send the batch in parts",
            param="prompt",
        )
    if request.suffix:
        raise ApiError(400, "suffix is not supported (Qwen2-VL has no fill-in-the-middle)", param="suffix")
    return request


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    request: ChatCompletionRequest = _validate(ChatCompletionRequest, body)
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if request.add_generation_prompt and request.continue_final_message:
        raise ApiError(400, "continue_final_message needs add_generation_prompt: false", param="add_generation_prompt")
    _refuse_what_we_cannot_honour(request)
    return request


def _refuse_what_we_cannot_honour(request: ChatCompletionRequest) -> None:
    if (request.functions and request.function_call != "none") or request.function_call not in (None, "none", "auto"):
        raise ApiError(
            400,
            "legacy function calling (functions, function_call) is not supported: send the functions as tools "
            "([{'type': 'function', 'function': {...}}]) and function_call as tool_choice",
            code="unsupported_value",
            param="functions" if request.functions else "function_call",
        )
    check_history(request.messages)
    if request.audio is not None or any(m != "text" for m in request.modalities or []):
        raise ApiError(400, "only text output is supported: leave out audio and modalities other than 'text'",
                       code="unsupported_value", param="modalities")  # fmt: skip


def _client_path(loc: tuple[Any, ...]) -> list[Any]:
    """An error's location as the client wrote it: without pydantic's union branch names, nor the part type
    it names after a content index (``content.0.image_url.image_url.url`` is ``content.0.image_url.url``)."""
    path = [p for p in loc if not _is_branch_name(p)]
    return [p for i, p in enumerate(path) if not (p in _PART_TAGS and i and isinstance(path[i - 1], int))]


def _is_branch_name(part: object) -> bool:
    """pydantic names union branches in error paths (``str``, ``list[...]``); clients never wrote those."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)
