"""The OpenAI chat-completions request, validated; anything we cannot honour is refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import ApiError


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str
    detail: str | None = None
    min_pixels: int | None = Field(default=None, gt=0)
    max_pixels: int | None = Field(default=None, gt=0)


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the OpenAI API ignores fields it does not know

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=8)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False
    logprobs: bool = False
    user: str | None = None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        # The deepest error is the specific one (a union of str | list reports both branches).
        worst = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(p) for p in worst["loc"] if not _is_branch_name(p))
        raise ApiError(400, f"invalid request: {where}: {worst['msg']}", code="invalid_value", param=where) from exc
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if request.stop == "":
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return request


def _is_branch_name(part: object) -> bool:
    """pydantic names union branches in error paths (``str``, ``list[...]``); clients never wrote those."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)
