"""The seed system's workloads as OpenAI chat messages, deterministic from one seed.

Every request is a pure function of (seed, workload stream, index), so the same request is the
same bytes in every run, whatever the concurrency or arrival order, and ``baseline_hf`` can rebuild
exactly what ``serve`` sent.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from benchmarks import media, schemas

WORKLOADS = ("seed3img", "multiturn", "text", "video", "mixed", "structured")

# Independent random streams per purpose, so that adding one request kind never shifts another.
_IMAGES, _TEXT, _VIDEO, _SESSION, _STREAM_TEXT, _STRUCTURED = 11, 12, 13, 14, 15, 16

# Document pages: sizes of letter/A4 scans at ~96 dpi, all at most ~800k pixels.
_DOCUMENT_SIZES = ((800, 1000), (794, 1000), (612, 792), (720, 960), (640, 900))
_PHOTO_ASPECTS = (4 / 3, 16 / 9, 3 / 2, 1.0, 3 / 4)

_INSTRUCTIONS = (
    "Look carefully at the three images above.",
    "You are given three images: some are scanned documents and some are photographs.",
    "The images above come from one customer support ticket.",
    "These pictures were attached to an insurance claim.",
)
_TASKS = (
    "Describe what each image shows, in order, and point out anything they have in common.",
    "Transcribe the headings of any document and summarise the photographs in one sentence each.",
    "Compare the layout of the documents with the content of the photos.",
    "List every object you can identify and say which image it appears in.",
    "Explain which image is the most informative for the question and why.",
)
_STYLES = (
    "Answer in plain prose without bullet points.",
    "Be precise and do not speculate beyond what is visible.",
    "Keep the answer factual; mention uncertainty where the image is unclear.",
    "Write for a colleague who cannot see the images.",
)
_FOLLOWUPS = (
    "Thanks. Now focus on the second image only: what stands out in it?",
    "Which of your observations above are you least sure about, and why?",
    "Summarise your previous answer in three short sentences.",
    "Is there any text in the images? Quote what you can read.",
    "What would you ask the sender to clarify?",
)
# Short common English words: about one token each in Qwen2's BPE, so word count ~ token count.
_WORD_LIST = (
    "the of and to in is was for on that with as it at by from this be are or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three house city water"
)
_WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class WorkloadOptions:
    seed: int = 0
    max_tokens_mean: int | None = None  # None: the workload's own default
    max_tokens_spread: int | None = None
    image_scale: float = 1.0  # < 1 shrinks every image/frame, for CPU runs
    # (width, height): every image a photo of this size, as `vllm bench serve`'s synthetic images are
    # (ANCHORS' vLLM rows: 768x1024); None: documents and photos of the sizes real users send
    image_size: tuple[int, int] | None = None
    repeat_media: bool = False
    media_pool: int = 4
    prompt_tokens: int = 1000
    text_max_tokens: int = 256  # the long text streams of ``mixed``, the unconstrained streams of ``structured``
    json_max_tokens: int = 512  # ``structured``'s constrained answers: a cap only, their grammar ends them
    constrained_share: float = 0.25  # ``structured``: the share of the streams that send a JSON schema
    turns: int = 3
    video_format: str = "avi"  # "avi": one MJPEG AVI data URL; "frames": a list of JPEG data URLs
    video_frames: int = 8
    video_fps: int = 2

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadOptions:
        """The options a command line gave; fields its parser does not define keep their defaults."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


@dataclass
class RequestSpec:
    """One chat request: the messages, its output length and the tags the summary groups by; with a
    ``response_format`` the answer is constrained (and ends with its grammar: no ``ignore_eos``)."""

    messages: list[dict[str, Any]]
    max_tokens: int
    tags: dict[str, Any] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None


@dataclass
class SessionSpec:
    """A multi-turn conversation: turn 1 has the images, later turns only the user's follow-up text."""

    first: RequestSpec
    followups: list[str]
    max_tokens: list[int]  # one per later turn


def _rng(opts: WorkloadOptions, stream: int, *index: int) -> np.random.Generator:
    return np.random.default_rng([opts.seed, stream, *index])


def _max_tokens(rng: np.random.Generator, mean: int, spread: int) -> int:
    return max(1, int(rng.integers(mean - spread, mean + spread + 1)))


def vision_max_tokens(opts: WorkloadOptions, rng: np.random.Generator) -> int:
    mean = 120 if opts.max_tokens_mean is None else opts.max_tokens_mean
    spread = 32 if opts.max_tokens_spread is None else opts.max_tokens_spread
    return _max_tokens(rng, mean, spread)


def _image_part(rng: np.random.Generator, scale: float, size: tuple[int, int] | None = None) -> dict[str, Any]:
    """A document (PNG, as scans are sent) or a photo (JPEG), at a size real users send; with ``size``,
    a photo of that size."""
    seed = int(rng.integers(2**62))
    if size is not None:
        url = media.data_url(media.jpeg_bytes(media.photo(*media.scaled(size, scale), seed)), "image/jpeg")
    elif rng.random() < 0.5:
        size = _DOCUMENT_SIZES[int(rng.integers(len(_DOCUMENT_SIZES)))]
        url = media.data_url(media.png_bytes(media.document(*media.scaled(size, scale), seed)), "image/png")
    else:
        width = int(rng.integers(640, 1921))
        aspect = _PHOTO_ASPECTS[int(rng.integers(len(_PHOTO_ASPECTS)))]
        height = int(np.clip(round(width / aspect), 480, 1080))
        image = media.photo(*media.scaled((width, height), scale), seed)
        url = media.data_url(media.jpeg_bytes(image), "image/jpeg")
    return {"type": "image_url", "image_url": {"url": url}}


def _pick(rng: np.random.Generator, pool: tuple[str, ...]) -> str:
    return pool[int(rng.integers(len(pool)))]


def _vision_prompt(rng: np.random.Generator) -> str:
    return " ".join((_pick(rng, _INSTRUCTIONS), _pick(rng, _TASKS), _pick(rng, _STYLES)))


def _media_index(opts: WorkloadOptions, index: int) -> int:
    """With ``repeat_media`` requests cycle through a small pool, so caches see repeats."""
    return index % max(1, opts.media_pool) if opts.repeat_media else index


def seed3img_request(opts: WorkloadOptions, index: int) -> RequestSpec:
    content_rng = _rng(opts, _IMAGES, _media_index(opts, index))
    parts = [_image_part(content_rng, opts.image_scale, opts.image_size) for _ in range(3)]
    parts.append({"type": "text", "text": _vision_prompt(content_rng)})
    max_tokens = vision_max_tokens(opts, _rng(opts, _IMAGES, index, 1))
    return RequestSpec([{"role": "user", "content": parts}], max_tokens)


def text_prompt(rng: np.random.Generator, words: int) -> str:
    """About ``words`` tokens of sentence-shaped filler, unique per rng so prefix caches cannot help."""
    out: list[str] = []
    while len(out) < words:
        sentence = [_WORDS[int(i)] for i in rng.integers(len(_WORDS), size=int(rng.integers(6, 16)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out[:words])


def _text_words(opts: WorkloadOptions) -> int:
    # Measured with Qwen2's tokenizer: ~1.31 tokens a word (capitals, full stops), and ~32 tokens of
    # chat template and trailing question, so the whole prompt comes out near ``prompt_tokens``.
    return max(1, round((opts.prompt_tokens - 32) / 1.31))


def text_request(opts: WorkloadOptions, index: int) -> RequestSpec:
    rng = _rng(opts, _TEXT, index)
    question = "Continue the text above with a long, detailed story."
    text = text_prompt(rng, _text_words(opts)) + "\n\n" + question
    mean = 256 if opts.max_tokens_mean is None else opts.max_tokens_mean
    spread = 0 if opts.max_tokens_spread is None else opts.max_tokens_spread
    return RequestSpec([{"role": "user", "content": text}], _max_tokens(rng, mean, spread))


def stream_text_request(opts: WorkloadOptions, stream: int, index: int) -> RequestSpec:
    """One request of ``mixed``'s long-running text stream ``stream``."""
    rng = _rng(opts, _STREAM_TEXT, stream, index)
    text = text_prompt(rng, _text_words(opts)) + "\n\nContinue the text above with a long story."
    return RequestSpec([{"role": "user", "content": text}], opts.text_max_tokens, {"stream_kind": "text"})


def constrained_streams(opts: WorkloadOptions, streams: int) -> int:
    """How many of ``structured``'s ``streams`` are constrained: streams 0 .. that - 1 (a quarter of 32: 8)."""
    return min(streams, round(opts.constrained_share * streams))


def structured_request(opts: WorkloadOptions, stream: int, index: int, constrained: bool) -> RequestSpec:
    """Request ``index`` of ``structured``'s stream ``stream``: text and a JSON question, the same whether or
    not the stream is constrained (the control run sends the same prompts). A constrained request carries its
    schema as a strict ``json_schema`` response format; the schemas come in turn (`benchmarks.schemas`)."""
    rng = _rng(opts, _STRUCTURED, stream, index)
    case = schemas.case_for(stream + index)
    question = f"Reply with a JSON object {case.task}"
    text = text_prompt(rng, _text_words(opts)) + "\n\n" + question
    messages = [{"role": "user", "content": text}]
    if not constrained:
        return RequestSpec(messages, opts.text_max_tokens, {"stream_kind": "unconstrained", "schema": case.name})
    tags = {"stream_kind": "constrained", "schema": case.name}
    return RequestSpec(messages, opts.json_max_tokens, tags, schemas.response_format(case))


def video_request(opts: WorkloadOptions, index: int) -> RequestSpec:
    """The seed system's non-standard ``video_url`` part (``fps`` beside ``url``) and a question."""
    rng = _rng(opts, _VIDEO, _media_index(opts, index))
    width, height = media.scaled((640, 360), opts.image_scale)
    frames = [
        media.jpeg_bytes(f) for f in media.video_frames(width, height, opts.video_frames, int(rng.integers(2**62)))
    ]
    if opts.video_format == "frames":
        url: str | list[str] = [media.data_url(f, "image/jpeg") for f in frames]
    else:
        url = media.data_url(media.mjpeg_avi(frames, width, height, opts.video_fps), "video/x-msvideo")
    parts = [
        {"type": "video_url", "video_url": {"url": url, "fps": opts.video_fps}},
        {"type": "text", "text": "Describe what happens in this video, in order. " + _vision_prompt(rng)},
    ]
    max_tokens = vision_max_tokens(opts, _rng(opts, _VIDEO, index, 1))
    return RequestSpec([{"role": "user", "content": parts}], max_tokens)


def multiturn_session(opts: WorkloadOptions, index: int) -> SessionSpec:
    first = seed3img_request(opts, index)
    rng = _rng(opts, _SESSION, index)
    followups = [_FOLLOWUPS[int(i)] for i in rng.choice(len(_FOLLOWUPS), size=opts.turns - 1, replace=False)]
    return SessionSpec(first, followups, [vision_max_tokens(opts, rng) for _ in followups])


def next_turn(messages: list[dict[str, Any]], answer: str, followup: str) -> list[dict[str, Any]]:
    """The conversation so far plus the assistant's actual answer and the user's next question."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": followup}]


def request_for(workload: str, opts: WorkloadOptions, index: int) -> RequestSpec:
    """Request ``index`` of a single-request workload (``mixed``'s vision requests are ``seed3img``'s)."""
    if workload in ("seed3img", "mixed"):
        spec = seed3img_request(opts, index)
        if workload == "mixed":
            spec.tags["stream_kind"] = "vision"
        return spec
    if workload == "text":
        return text_request(opts, index)
    if workload == "video":
        return video_request(opts, index)
    raise ValueError(f"{workload!r} is not a single-request workload")
