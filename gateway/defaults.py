"""Sampling defaults from the checkpoint's ``generation_config.json``, for what a request leaves unset.

Chat checkpoints ship their authors' sampling settings there (Qwen2-VL-Instruct: a low temperature,
top_k 1, repetition_penalty 1.05), and vLLM applies them by default. A request that sets an option
keeps its own value; ``[model] generation_config = "ignore"`` gives OpenAI's defaults instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.schema import GenerationOptions

log = logging.getLogger(__name__)

# generation_config.json key -> request option (the sampling keys vLLM takes from it)
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The request options the checkpoint sets, each checked as a request's would be; a value no request
    could send is left out, with a warning."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    defaults: dict[str, Any] = {}
    for key, option in KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        try:
            GenerationOptions.model_validate({option: value})
        except ValidationError:
            log.warning("ignoring %s = %r in %s: not a valid %s", key, value, path, option)
            continue
        defaults[option] = value
    return defaults


def with_defaults(request: GenerationOptions, defaults: dict[str, Any]) -> GenerationOptions:
    """The request with the checkpoint's defaults for the options it did not set."""
    unset = {k: v for k, v in defaults.items() if k not in request.model_fields_set}
    if "max_tokens" in defaults:  # the limit: the request's own wherever it has one (max_completion_tokens, the
        # same limit under its newer name; /v1/completions' default of 16), else the checkpoint's (null too)
        if request.token_limit is None:
            unset["max_tokens"] = defaults["max_tokens"]
        else:
            unset.pop("max_tokens", None)
    return request.model_copy(update=unset) if unset else request
