"""Multimodal rotary (M-RoPE) position ids for Qwen2-VL.

Every token gets three position ids (temporal, height, width). Text tokens use the same value on all
three axes, counting up by one. A vision item occupying ``t*h*w / merge**2`` placeholder tokens gets a
3-D grid of ids starting at the current text position; the text after it resumes at
``max(all ids so far) + 1``. That makes positions smaller than sequence indices, so after the prompt
every later token's position is ``sequence index + delta`` with ``delta = max_position + 1 - length``.

Qwen2-VL uses a plain temporal index per frame group. Qwen2.5-VL (``vision.tokens_per_second`` set) puts a
video's temporal ids in absolute time: grid step i is at ``int(i * second_per_grid_t * tokens_per_second)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from workers.models.spec import ModelSpec

Grid = tuple[int, int, int]
MEDIA_KINDS = ("image", "video")


def media_token_count(grid_thw: Sequence[int], spec: ModelSpec) -> int:
    """Number of placeholder tokens (= vision tower output rows) for one item of grid (t, h, w)."""
    t, h, w = (int(x) for x in grid_thw)
    merge = spec.vision.spatial_merge_size
    if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
        raise ValueError(f"invalid grid_thw {(t, h, w)}: must be positive with h, w divisible by {merge}")
    return t * h * w // (merge * merge)


def expand_media_placeholders(
    input_ids: Sequence[int] | torch.Tensor,
    media: Sequence[tuple[str, Sequence[int]]],
    spec: ModelSpec,
    frame_texts: Sequence[Sequence[Sequence[int]] | None] | None = None,
) -> list[int]:
    """Replace each single ``<|image_pad|>`` / ``<|video_pad|>`` with its grid's token count.

    ``media`` lists ``(kind, grid_thw)`` in order of appearance, kind being "image" or "video". ``frame_texts``,
    where given, has an entry per item: for a Qwen3-VL video the token ids of each temporal step's timestamp, and
    the placeholder becomes, per step, ``timestamp <|vision_start|> tokens <|vision_end|>`` (transformers'
    ``Qwen3VLProcessor.replace_video_token``); None for the others.
    """
    ids = _as_list(input_ids)
    pad_of_kind = {"image": spec.image_token_id, "video": spec.video_token_id}
    kind_of_pad = {v: k for k, v in pad_of_kind.items()}
    for kind, _ in media:
        if kind not in pad_of_kind:
            raise ValueError(f"media kind must be one of {MEDIA_KINDS}, got {kind!r}")
    texts = list(frame_texts) if frame_texts is not None else [None] * len(media)
    if len(texts) != len(media):
        raise ValueError(f"{len(texts)} frame text entries for {len(media)} media items")
    placeholders = [kind_of_pad[tok] for tok in ids if tok in kind_of_pad]
    if placeholders != [kind for kind, _ in media]:
        raise ValueError(
            f"placeholder tokens in the prompt ({placeholders}) do not match the media given "
            f"({[kind for kind, _ in media]})"
        )
    out: list[int] = []
    items = iter(zip(media, texts, strict=True))
    for tok in ids:
        if tok in kind_of_pad:
            (_, grid), steps = next(items)
            out.extend([tok] * media_token_count(grid, spec) if steps is None else _timed_steps(tok, grid, steps, spec))
        else:
            out.append(tok)
    return out


def _timed_steps(pad: int, grid: Sequence[int], steps: Sequence[Sequence[int]], spec: ModelSpec) -> list[int]:
    """A video's tokens with each temporal step's timestamp text: ``text <|vision_start|> pads <|vision_end|>``."""
    t = int(grid[0])
    if len(steps) != t:
        raise ValueError(f"a video of {t} temporal steps has {len(steps)} timestamps")
    if spec.vision_end_token_id is None:
        raise ValueError("timestamped videos need vision_end_token_id in config.json")
    per_step = media_token_count(grid, spec) // t
    out: list[int] = []
    for text in steps:
        out.extend([*(int(x) for x in text), spec.vision_start_token_id, *[pad] * per_step, spec.vision_end_token_id])
    return out


def split_video_grids(video_grids: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """Each video grid (t, h, w) as t grids (1, h, w): Qwen3-VL's ``get_rope_index`` (modeling_qwen3_vl.py,
    ``repeat_interleave`` then ``[:, 0] = 1``), whose timestamps make every temporal step its own vision run."""
    return [(1, int(h), int(w)) for t, h, w in video_grids for _ in range(int(t))]


def frame_rope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
    spec: ModelSpec,
    past_length: int = 0,
    past_delta: int = 0,
    video_seconds: Sequence[float | None] | None = None,
) -> tuple[torch.Tensor, int]:
    """Qwen3-VL's M-RoPE ids: `rope_positions` with each video's temporal steps as separate items of one step
    (`split_video_grids`); its video ids are not in absolute time (the timestamps are text), so
    ``video_seconds`` is not read."""
    return rope_positions(input_ids, image_grids, split_video_grids(video_grids), spec, past_length, past_delta)


def vision_positions(
    start: int, grid_thw: Sequence[int], merge: int, time_interval: torch.Tensor | None = None
) -> torch.Tensor:
    """[3, t*h*w/merge**2] (t, h, w) ids of one vision item, offset by ``start``, row-major over (t, h, w).
    ``time_interval``: the temporal ids' step (a float32 scalar, truncated as the reference does), else one."""
    t, h, w = (int(x) for x in grid_thw)
    steps = torch.arange(t) if time_interval is None else (torch.arange(t) * time_interval).long()
    tt, hh, ww = torch.meshgrid(steps, torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def video_time_interval(spec: ModelSpec, second_per_grid_t: float | None) -> torch.Tensor | None:
    """A video's temporal id step where the family counts time (Qwen2.5-VL): tokens_per_second x seconds per
    grid step, in float32 as transformers multiplies them (its processor's seconds, one where none is given)."""
    if not spec.vision.tokens_per_second:
        return None
    seconds = torch.tensor(1.0 if second_per_grid_t is None else second_per_grid_t, dtype=torch.float32)
    return spec.vision.tokens_per_second * seconds


def rope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
    spec: ModelSpec,
    past_length: int = 0,
    past_delta: int = 0,
    video_seconds: Sequence[float | None] | None = None,
) -> tuple[torch.Tensor, int]:
    """M-RoPE position ids [3, len(input_ids)] and the delta for decoding after these tokens.

    ``input_ids`` must already be expanded (see `expand_media_placeholders`). Grids are consumed in
    order as image / video placeholder runs are met. To extend a sequence whose first ``past_length``
    tokens are already in the KV cache (e.g. a new user turn with new images), pass that length and the
    delta returned for it; positions then continue exactly as if the whole sequence were computed at once.
    ``video_seconds``: each video's seconds per temporal grid step (`video_time_interval`), in order.
    """
    ids = _as_list(input_ids)
    merge = spec.vision.spatial_merge_size
    grids: dict[int, Iterator[Sequence[int]]] = {
        spec.image_token_id: iter(image_grids),
        spec.video_token_id: iter(video_grids),
    }
    seconds = iter(video_seconds or [])
    chunks: list[torch.Tensor] = []
    next_pos = past_length + past_delta  # position of the next text token = max position so far + 1
    i = 0
    while i < len(ids):
        tok = ids[i]
        if tok in grids:
            grid = next(grids[tok], None)
            if grid is None:
                raise ValueError(f"more {_kind(tok, spec)} placeholder runs in input_ids than grids given")
            count = media_token_count(grid, spec)
            if ids[i : i + count] != [tok] * count:
                raise ValueError(
                    f"{_kind(tok, spec)} grid {tuple(grid)} needs {count} consecutive placeholder tokens at "
                    f"index {i}; were the placeholders expanded?"
                )
            interval = video_time_interval(spec, next(seconds, None)) if tok == spec.video_token_id else None
            chunk = vision_positions(next_pos, grid, merge, interval)
            # transformers 5 (the reference we are checked against) resumes text after the spatial extent
            # only; for images that is also the largest id, for long videos it is below the last frames'.
            next_pos += max(int(grid[1]), int(grid[2])) // merge
            i += count
        else:
            end = i
            while end < len(ids) and ids[end] not in grids:
                end += 1
            chunk = torch.arange(next_pos, next_pos + end - i).expand(3, -1)
            next_pos += end - i
            i = end
        chunks.append(chunk)
    for tok, rest in grids.items():
        if next(rest, None) is not None:
            raise ValueError(f"more {_kind(tok, spec)} grids given than placeholder runs in input_ids")
    positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.int64)
    # Decoding continues after the largest id on any axis, as transformers' rope deltas do.
    top = max(next_pos, int(positions.max()) + 1) if positions.numel() else next_pos
    delta = top - (past_length + len(ids))
    return positions.to(torch.int64), delta


def decode_positions(
    start_index: int, count: int, delta: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[3, count] positions of text tokens at sequence indices start_index.. (all axes equal)."""
    return (torch.arange(start_index, start_index + count, device=device) + delta).expand(3, -1)


def _as_list(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim != 1:
            raise ValueError(f"input_ids must be 1-D (one sequence), got shape {tuple(input_ids.shape)}")
        return [int(x) for x in input_ids.tolist()]
    return [int(x) for x in input_ids]


def _kind(token_id: int, spec: ModelSpec) -> str:
    return "image" if token_id == spec.image_token_id else "video"
