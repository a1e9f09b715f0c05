"""Our Qwen2-VL model code against transformers' implementation, on tiny fp32 CPU checkpoints.

Three checkpoints cover the layouts we must read: a hub-layout one (flat config, ``model.layers.*`` /
``visual.*`` keys, eos list in generation_config.json), a transformers-5 module-layout one
(``model.language_model.*`` keys, nested config, sharded, tied embeddings), and the project's own
synthetic checkpoint when ``workers.models.synth`` is available.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

from tests.unit import hf_reference as hf
from workers.models.frame_attention import (
    FrameRun,
    PaddedFrames,
    SegmentFrames,
    frame_bucket,
    frame_chunks,
    frame_runs,
    grouped_item_order,
    segment_attention,
    segment_attention_reference,
)
from workers.models.language import (
    KVCache,
    LanguageModel,
    attention,
    attention_reference,
    merge_media_embeddings,
    rms_norm,
)
from workers.models.mrope import decode_positions, expand_media_placeholders, rope_positions
from workers.models.spec import ModelSpec
from workers.models.vision import VisionTower, cu_seqlens_from_grid, vision_rotary_cos_sin, vision_rotary_positions
from workers.models.weights import CheckpointWeights, canonical_key, load_language_state, load_vision_state

IM_START = 151644
NEWLINE = 198
Grid = tuple[int, int, int]


# --- checkpoints ------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path
    reference: hf.Qwen2VLForConditionalGeneration
    spec: ModelSpec
    vision: VisionTower
    language: LanguageModel


def _open(path: Path) -> Checkpoint:
    spec = ModelSpec.from_dir(path)
    return Checkpoint(
        path=path,
        reference=hf.load_reference(path),
        spec=spec,
        vision=VisionTower.from_checkpoint(path, dtype=torch.float32),
        language=LanguageModel.from_checkpoint(path, dtype=torch.float32),
    )


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = hf.save_hub_layout(hf.build_tiny_model(seed=0), tmp_path_factory.mktemp("hub"))
    return _open(path)


@pytest.fixture(scope="module")
def v5_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    model = hf.build_tiny_model(seed=1, tie_word_embeddings=True)
    path = hf.save_transformers5_layout(model, tmp_path_factory.mktemp("v5"))
    return _open(path)


@pytest.fixture(scope="module")
def synth_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    synth = pytest.importorskip("workers.models.synth")
    return _open(synth.generate_checkpoint(tmp_path_factory.mktemp("synth") / "tiny", size="tiny", seed=0))


@pytest.fixture(params=["hub", "v5", "synth"])
def checkpoint(request: pytest.FixtureRequest) -> Checkpoint:
    return request.getfixturevalue(f"{request.param}_checkpoint")


# --- prompts ----------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """An expanded prompt plus the pixels of its media, images and videos each in prompt order."""

    ids: list[int]
    image_grids: list[Grid] = field(default_factory=list)
    video_grids: list[Grid] = field(default_factory=list)
    image_pixels: torch.Tensor | None = None
    video_pixels: torch.Tensor | None = None

    def hf_images(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.image_pixels is None else (self.image_pixels, torch.tensor(self.image_grids))

    def hf_videos(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.video_pixels is None else (self.video_pixels, torch.tensor(self.video_grids))


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, hf.BOS_TOKEN_ID) for _ in range(n)]


def make_prompt(spec: ModelSpec, media: Sequence[tuple[str, Grid]], seed: int, assistant: bool = True) -> Prompt:
    """A chat-shaped user turn: text, then each media item wrapped in vision start/end, then text."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ids = [IM_START, *_text(rng, 5)]
    for kind, _ in media:
        pad = spec.image_token_id if kind == "image" else spec.video_token_id
        ids += [spec.vision_start_token_id, pad, hf.VISION_END_TOKEN_ID, *_text(rng, 3)]
    ids += [*_text(rng, 4), hf.IM_END_TOKEN_ID, NEWLINE]
    if assistant:
        ids += [IM_START, *_text(rng, 2)]
    prompt = Prompt(ids=expand_media_placeholders(ids, media, spec))
    prompt.image_grids = [g for kind, g in media if kind == "image"]
    prompt.video_grids = [g for kind, g in media if kind == "video"]
    patch_dim = spec.vision.patch_dim
    if prompt.image_grids:
        n = sum(t * h * w for t, h, w in prompt.image_grids)
        prompt.image_pixels = torch.randn(n, patch_dim, generator=gen)
    if prompt.video_grids:
        n = sum(t * h * w for t, h, w in prompt.video_grids)
        prompt.video_pixels = torch.randn(n, patch_dim, generator=gen)
    return prompt


MEDIA_CASES: dict[str, list[tuple[str, Grid]]] = {
    "text": [],
    "one_image": [("image", (1, 4, 6))],
    "two_images": [("image", (1, 6, 4)), ("image", (1, 2, 8))],
    "video": [("video", (2, 4, 4))],
    "image_and_video": [("image", (1, 4, 4)), ("video", (2, 6, 4))],
}


# --- our pipeline -----------------------------------------------------------------------------------


def embed_prompt(ckpt: Checkpoint, prompt: Prompt) -> torch.Tensor:
    """Token embeddings with the vision tower's rows scattered into the placeholders."""
    embeds = ckpt.language.embed(prompt.ids)
    spec = ckpt.spec
    if prompt.image_pixels is not None:
        rows = ckpt.vision(prompt.image_pixels, torch.tensor(prompt.image_grids))
        embeds = merge_media_embeddings(embeds, prompt.ids, rows, [spec.image_token_id])
    if prompt.video_pixels is not None:
        rows = ckpt.vision(prompt.video_pixels, torch.tensor(prompt.video_grids))
        embeds = merge_media_embeddings(embeds, prompt.ids, rows, [spec.video_token_id])
    return embeds


@dataclass
class Session:
    """One conversation's decoder state: the KV cache and the M-RoPE delta."""

    cache: KVCache
    delta: int = 0


def prefill(ckpt: Checkpoint, session: Session, prompt: Prompt, all_logits: bool = False) -> torch.Tensor:
    positions, session.delta = rope_positions(
        prompt.ids,
        prompt.image_grids,
        prompt.video_grids,
        ckpt.spec,
        past_length=session.cache.length,
        past_delta=session.delta,
    )
    return ckpt.language(embed_prompt(ckpt, prompt), positions, session.cache, all_logits=all_logits)


def decode(ckpt: Checkpoint, session: Session, token: int) -> torch.Tensor:
    positions = decode_positions(session.cache.length, 1, session.delta)
    return ckpt.language(ckpt.language.embed([token]), positions, session.cache)


def greedy(ckpt: Checkpoint, session: Session, prompt: Prompt, max_new_tokens: int = 32) -> list[int]:
    """Prefill then decode token by token; the last generated token is *not* fed (as in HF)."""
    logits = prefill(ckpt, session, prompt)
    out: list[int] = []
    while True:
        token = int(logits.argmax())
        out.append(token)
        if token in ckpt.spec.eos_token_ids or len(out) == max_new_tokens:
            return out
        logits = decode(ckpt, session, token)


# --- spec -------------------------------------------------------------------------------------------


def test_spec_reads_hub_layout(hub_checkpoint: Checkpoint) -> None:
    spec = hub_checkpoint.spec
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers) == (64, 128, 2)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert spec.mrope_section == (2, 3, 3)
    assert spec.rope_theta == 10000.0 and spec.rms_norm_eps == 1e-6
    assert spec.vocab_size == hf.VOCAB_SIZE and not spec.tie_word_embeddings
    assert spec.vision.depth == 2 and spec.vision.embed_dim == 32 and spec.vision.num_heads == 2
    assert spec.vision.in_chans == 3 and spec.vision.out_hidden_size == 64
    assert spec.vision.patch_dim == 3 * 2 * 14 * 14
    assert spec.image_token_id == hf.IMAGE_TOKEN_ID and spec.video_token_id == hf.VIDEO_TOKEN_ID
    assert spec.vision_start_token_id == hf.VISION_START_TOKEN_ID
    # generation_config.json wins over config.json's single eos id.
    assert spec.eos_token_ids == (hf.IM_END_TOKEN_ID, hf.BOS_TOKEN_ID)
    assert spec.dtype == torch.float32


def test_spec_reads_transformers5_layout(v5_checkpoint: Checkpoint, hub_checkpoint: Checkpoint) -> None:
    config = json.loads((v5_checkpoint.path / "config.json").read_text())
    assert "text_config" in config and "rope_parameters" in config["text_config"]
    spec = v5_checkpoint.spec
    assert spec.tie_word_embeddings
    assert spec.eos_token_ids == (hf.IM_END_TOKEN_ID,)
    same = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mrope_section", "vision")
    for name in same:
        assert getattr(spec, name) == getattr(hub_checkpoint.spec, name), name


def test_spec_token_ids_come_from_files(hub_checkpoint: Checkpoint) -> None:
    config = json.loads((hub_checkpoint.path / "config.json").read_text())
    config["image_token_id"] = 7
    config["vision_start_token_id"] = 8
    spec = ModelSpec.from_config(config, {"eos_token_id": 9})
    assert (spec.image_token_id, spec.vision_start_token_id, spec.eos_token_ids) == (7, 8, (9,))
    del config["image_token_id"]
    with pytest.raises(ValueError, match="image_token_id"):
        ModelSpec.from_config(config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llava"}, "model_type .llava. in config.json is not supported"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]}}, "mrope_section"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "yarn", "mrope_section": [2, 3, 3]}}, "rope type"),
        ({"rope_scaling": None}, r"mrope_section \[16, 24, 24\] must have 3 entries summing to head_dim"),
        ({"rope_scaling": [16, 24, 24]}, "must be a mapping"),
    ],
)
def test_spec_rejects_bad_configs(hub_checkpoint: Checkpoint, change: dict, message: str) -> None:
    config = json.loads((hub_checkpoint.path / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_config(config)


def test_spec_without_mrope_section_takes_transformers_default(hub_checkpoint: Checkpoint) -> None:
    config = json.loads((hub_checkpoint.path / "config.json").read_text())
    config |= {"head_dim": 128, "rope_scaling": None}
    assert ModelSpec.from_config(config).mrope_section == (16, 24, 24)


def test_spec_from_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelSpec.from_dir(tmp_path)


# --- weights ----------------------------------------------------------------------------------------


def test_key_normalisation() -> None:
    assert canonical_key("model.language_model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert canonical_key("model.visual.blocks.0.attn.qkv.bias") == "visual.blocks.0.attn.qkv.bias"
    assert canonical_key("model.layers.0.input_layernorm.weight") == "model.layers.0.input_layernorm.weight"
    assert canonical_key("visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert canonical_key("lm_head.weight") == "lm_head.weight"


def test_both_layouts_index_the_same_names(hub_checkpoint: Checkpoint, v5_checkpoint: Checkpoint) -> None:
    assert (v5_checkpoint.path / "model.safetensors.index.json").is_file()  # sharded
    hub = CheckpointWeights(hub_checkpoint.path)
    v5 = CheckpointWeights(v5_checkpoint.path)
    # The tied checkpoint stores no lm_head.weight; everything else lines up name for name.
    assert set(hub.keys()) - {"lm_head.weight"} == set(v5.keys()) - {"lm_head.weight"}
    assert "lm_head.weight" in hub


def test_prefix_loading_reads_only_its_part(v5_checkpoint: Checkpoint) -> None:
    weights = CheckpointWeights(v5_checkpoint.path)
    vision = load_vision_state(weights)
    assert vision and all(not k.startswith(("visual.", "model.", "lm_head")) for k in vision)
    assert "blocks.0.attn.qkv.weight" in vision and "embed_tokens.weight" not in vision
    language = load_language_state(weights, tie_word_embeddings=True, dtype=torch.bfloat16)
    assert not any(k.startswith("visual") or ".visual." in k for k in language)
    assert language["lm_head.weight"] is language["embed_tokens.weight"]
    assert language["norm.weight"].dtype == torch.bfloat16


def test_tied_lm_head_shares_storage(v5_checkpoint: Checkpoint) -> None:
    lm = v5_checkpoint.language
    assert lm.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()
    ref = v5_checkpoint.reference
    assert torch.equal(lm.lm_head.weight, ref.lm_head.weight)


def test_missing_tensor_is_a_value_error(hub_checkpoint: Checkpoint) -> None:
    weights = CheckpointWeights(hub_checkpoint.path)
    with pytest.raises(ValueError, match="not found"):
        weights.load(["visual.nope.weight"])
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        CheckpointWeights(hub_checkpoint.path / "..")


# --- vision tower -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],
        [(1, 6, 4), (1, 2, 2), (1, 8, 10)],
        [(3, 4, 4)],
        [(1, 4, 4), (2, 2, 6)],
        # Frames of one length apart (24 patches as 4x6 and 6x4, 4 as 2x2): the tower groups them, then
        # puts its rows back in the items' order.
        [(1, 4, 6), (1, 2, 2), (1, 6, 4), (2, 2, 2), (1, 4, 6), (1, 8, 10), (1, 2, 2)],
    ],
    ids=["one_image", "three_images", "video", "image_and_video", "sizes_interleaved"],
)
def test_vision_tower_matches_transformers(checkpoint: Checkpoint, grids: list[Grid]) -> None:
    spec = checkpoint.spec.vision
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(dim=1).sum()), spec.patch_dim, generator=torch.Generator().manual_seed(3))
    ours = checkpoint.vision(pixels, grid)
    ref = hf.vision_output(checkpoint.reference, pixels, grid)
    assert ours.shape == (pixels.shape[0] // spec.spatial_merge_size**2, spec.out_hidden_size)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_vision_tower_validates_inputs(hub_checkpoint: Checkpoint) -> None:
    tower = hub_checkpoint.vision
    patch_dim = hub_checkpoint.spec.vision.patch_dim
    with pytest.raises(ValueError, match="covers"):
        tower(torch.randn(10, patch_dim), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="divisible"):
        tower(torch.randn(6, patch_dim), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="pixel_values"):
        tower(torch.randn(4, patch_dim + 1), torch.tensor([[1, 2, 2]]))


def test_patch_embed_as_linear_equals_the_conv(hub_checkpoint: Checkpoint) -> None:
    """CUDA runs the patch embedding as a matmul over each flattened patch row (the conv's kernel was slow):
    the same map as the reference's Conv3d, to rounding, here in float64 on the CPU."""
    embed = hub_checkpoint.vision.patch_embed
    rows = torch.randn(12, hub_checkpoint.spec.vision.patch_dim, generator=torch.Generator().manual_seed(5))
    original = embed.proj.weight
    try:
        embed.proj.weight = torch.nn.Parameter(original.double(), requires_grad=False)
        torch.testing.assert_close(embed.as_linear(rows.double()), embed.as_conv(rows.double()), rtol=1e-12, atol=1e-12)
    finally:
        embed.proj.weight = original


@pytest.mark.parametrize(
    "grid",
    [[[2, 2, 4], [1, 4, 2], [3, 2, 2]], [[1, 2, 4], [2, 4, 2], [1, 2, 2], [1, 2, 2], [1, 4, 4]]],
    ids=["lengths_differ", "runs_of_one_length"],
)
def test_segment_attention_matches_block_diagonal_reference(grid: list[list[int]]) -> None:
    grid = torch.tensor(grid)
    n = int(grid.prod(dim=1).sum())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(
        segment_attention(q, k, v, grid), segment_attention_reference(q, k, v, cu_seqlens_from_grid(grid))
    )


@pytest.mark.parametrize("head_dim", [8, 80])
def test_padded_frames_attend_as_the_unpadded(head_dim: int) -> None:
    """The cuDNN path pads frames to bucket lengths and masks the padded keys through an extra coordinate;
    the real rows must come out as without padding, rotary included. Frames of 4 and 312 patches (padded),
    256 (a bucket already, two images in one call), an 11-frame video with an image of its frames' length
    (12 frames: batches of 8 and 4), and one of 2,112 (above CUDNN_MIN_FRAME: no kernel restriction). Here
    the CPU's reference rotary writes the padded layout; tests/unit/test_kernels.py checks the Triton kernel
    writes the same."""
    grid = torch.tensor([[1, 2, 2], [1, 12, 26], [1, 16, 16], [1, 16, 16], [11, 2, 4], [1, 4, 2], [1, 32, 66]])
    heads, n = 2, int(grid.prod(dim=1).sum())
    qkv = torch.randn(n, 3 * heads * head_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4
    cos, sin = (t.to(torch.float64) for t in vision_rotary_cos_sin(vision_rotary_positions(grid, 2), head_dim, 1e4))
    padded = PaddedFrames.plan(grid, heads, head_dim, qkv)
    assert padded.qkv.shape[1] == 256 + 512 + 2 * 256 + 12 * 256 + 2304  # the frames' buckets
    assert [c.frames for c in padded.chunks] == [1, 1, 2, 8, 4, 1]
    got = padded(qkv, cos, sin, heads)
    torch.testing.assert_close(got, SegmentFrames(grid)(qkv, cos, sin, heads), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(padded(qkv, cos, sin, heads), got, rtol=0, atol=0)  # reusable by every block


def test_frame_buckets_are_few_and_waste_little() -> None:
    buckets = {frame_bucket(n) for n in range(1, 16385)}
    assert len(buckets) <= 16 * 6 + 1  # 16 per octave above 256 patches
    for n in range(1, 16385):
        bucket = frame_bucket(n)
        assert bucket >= n and bucket % 256 == 0
        assert n < 4096 or bucket <= n * 1.0625  # large frames, where attention's cost is, waste <= 6.25%
    assert frame_bucket(3996) == 4096 and frame_bucket(4784) == 4864  # 768x1024, 1280x720


def test_frame_runs_join_neighbours_of_one_length() -> None:
    grid = torch.tensor([[1, 2, 4], [2, 4, 2], [1, 2, 2], [1, 2, 2], [1, 4, 4]])  # lengths 8, 8, 4, 4, 16
    assert frame_runs(grid) == [FrameRun(0, 3, 8), FrameRun(24, 2, 4), FrameRun(32, 1, 16)]
    assert grouped_item_order(grid) is None  # already side by side
    apart = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4], [2, 2, 2], [1, 8, 8]])  # 24, 4, 24, 4, 64
    assert grouped_item_order(apart) == [0, 2, 1, 3, 4]
    assert len(frame_runs(apart[grouped_item_order(apart)])) == 3


def test_frame_chunks_are_powers_of_two_up_to_eight() -> None:
    for frames in range(1, 40):
        chunks = frame_chunks(frames)
        assert sum(chunks) == frames
        assert all(c in (1, 2, 4, 8) for c in chunks)
    assert frame_chunks(11) == [8, 2, 1]


# --- M-RoPE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_rope_positions_match_get_rope_index(hub_checkpoint: Checkpoint, case: str) -> None:
    prompt = make_prompt(hub_checkpoint.spec, MEDIA_CASES[case], seed=1)
    ours, delta = rope_positions(prompt.ids, prompt.image_grids, prompt.video_grids, hub_checkpoint.spec)
    ref, ref_delta = hf.rope_index(hub_checkpoint.reference, prompt.ids, prompt.image_grids, prompt.video_grids)
    assert torch.equal(ours, ref)
    assert delta == ref_delta
    if case == "text":
        assert delta == 0


def test_rope_positions_by_hand(hub_checkpoint: Checkpoint) -> None:
    spec = hub_checkpoint.spec
    img = spec.image_token_id
    ids = [1, 2, img, img, img, img, img, img, 3]  # one (1, 4, 6) image = 2 x 3 merged tokens
    positions, delta = rope_positions(ids, [(1, 4, 6)], [], spec)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert delta == 6 - 9
    assert decode_positions(9, 2, delta).tolist() == [[6, 7]] * 3


def test_rope_text_after_long_video_matches_transformers(hub_checkpoint: Checkpoint) -> None:
    """A video with more frame groups than spatial rows: text resumes after the spatial extent
    (``start + max(h, w) // merge``) as transformers 5 does, and decoding after the largest id."""
    spec = hub_checkpoint.spec
    vid = spec.video_token_id
    ids = [1, vid, vid, vid, vid, 2, 3]  # (4, 2, 2) video = 4 frame groups of 1 merged token
    positions, delta = rope_positions(ids, [], [(4, 2, 2)], spec)
    assert positions.tolist() == [
        [0, 1, 2, 3, 4, 2, 3],
        [0, 1, 1, 1, 1, 2, 3],
        [0, 1, 1, 1, 1, 2, 3],
    ]
    assert delta == 5 - 7
    ref, ref_delta = hf.rope_index(hub_checkpoint.reference, ids, [], [(4, 2, 2)])
    assert torch.equal(positions, ref) and delta == ref_delta


@pytest.mark.parametrize("split_after", ["image", "turn"])
def test_rope_positions_continue_across_chunks(hub_checkpoint: Checkpoint, split_after: str) -> None:
    spec = hub_checkpoint.spec
    first = make_prompt(spec, [("image", (1, 4, 6))], seed=2)
    second = make_prompt(spec, [("image", (1, 2, 4)), ("video", (2, 4, 4))], seed=3)
    ids = first.ids + second.ids
    images = first.image_grids + second.image_grids
    full, full_delta = rope_positions(ids, images, second.video_grids, spec)
    # Either right after the first image's placeholders, or at the end of the first turn.
    image_end = max(i for i, t in enumerate(first.ids) if t == spec.image_token_id) + 1
    cut = image_end if split_after == "image" else len(first.ids)
    head, head_delta = rope_positions(ids[:cut], first.image_grids, [], spec)
    tail, tail_delta = rope_positions(
        ids[cut:], second.image_grids, second.video_grids, spec, past_length=cut, past_delta=head_delta
    )
    assert torch.equal(torch.cat([head, tail], dim=1), full)
    assert tail_delta == full_delta


def test_expand_media_placeholders(hub_checkpoint: Checkpoint) -> None:
    spec = hub_checkpoint.spec
    img, vid = spec.image_token_id, spec.video_token_id
    ids = [5, img, 6, vid, img]
    media = [("image", (1, 4, 4)), ("video", (2, 4, 6)), ("image", (1, 2, 2))]
    assert expand_media_placeholders(ids, media, spec) == [5, *[img] * 4, 6, *[vid] * 12, img]
    with pytest.raises(ValueError, match="do not match"):
        expand_media_placeholders(ids, media[:2], spec)
    with pytest.raises(ValueError, match="do not match"):
        expand_media_placeholders(ids, [media[1], media[0], media[2]], spec)
    with pytest.raises(ValueError, match="divisible"):
        expand_media_placeholders([img], [("image", (1, 3, 4))], spec)


def test_rope_positions_reject_unexpanded_prompts(hub_checkpoint: Checkpoint) -> None:
    spec = hub_checkpoint.spec
    with pytest.raises(ValueError, match="expanded"):
        rope_positions([1, spec.image_token_id, 2], [(1, 4, 4)], [], spec)
    with pytest.raises(ValueError, match="more image grids"):
        rope_positions([1, 2], [(1, 4, 4)], [], spec)


# --- decoder math -----------------------------------------------------------------------------------


def test_rms_norm_matches_transformers() -> None:
    ref = Qwen2VLRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    x = torch.randn(5, 64)
    torch.testing.assert_close(rms_norm(x, ref.weight, 1e-6), ref(x))


@pytest.mark.parametrize(("past", "new"), [(0, 7), (5, 1), (5, 4)])
def test_attention_matches_reference(past: int, new: int) -> None:
    gen = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(4, new, 16, generator=gen)
    k, v = (torch.randn(2, past + new, 16, generator=gen) for _ in range(2))
    torch.testing.assert_close(attention(q, k, v, past), attention_reference(q, k, v, past))


def test_kv_cache_growth_does_not_change_results(hub_checkpoint: Checkpoint) -> None:
    lm, spec = hub_checkpoint.language, hub_checkpoint.spec
    prompt = make_prompt(spec, [], seed=4)
    positions, _ = rope_positions(prompt.ids, [], [], spec)
    small = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity=2)
    big = lm.new_cache(capacity=1024)
    embeds = lm.embed(prompt.ids)
    for i in range(len(prompt.ids)):  # one token at a time forces several regrowths
        a = lm(embeds[i : i + 1], positions[:, i : i + 1], small)
    b = lm(embeds, positions, big)
    assert small.length == big.length == len(prompt.ids) and small.capacity >= len(prompt.ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_language_model_validates_inputs(hub_checkpoint: Checkpoint) -> None:
    lm = hub_checkpoint.language
    cache = lm.new_cache()
    with pytest.raises(ValueError, match="position_ids"):
        lm(torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), cache)
    with pytest.raises(ValueError, match="inputs_embeds"):
        lm(torch.zeros(3, 65), torch.zeros(3, 3, dtype=torch.int64), cache)
    with pytest.raises(ValueError, match="token ids"):
        lm.embed([hf.VOCAB_SIZE])
    assert cache.length == 0


# --- end to end against transformers -----------------------------------------------------------------


@pytest.mark.parametrize("case", ["text", "two_images", "image_and_video"])
def test_logits_match_transformers(checkpoint: Checkpoint, case: str) -> None:
    prompt = make_prompt(checkpoint.spec, MEDIA_CASES[case], seed=5)
    ref = hf.logits(checkpoint.reference, prompt.ids, prompt.hf_images(), prompt.hf_videos())

    session = Session(checkpoint.language.new_cache())
    ours = prefill(checkpoint, session, prompt, all_logits=True)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)  # (fp32 sums: wider heads round ~1e-5 relative)

    # Same logits when the last tokens arrive one at a time through the decode path.
    tail = 4
    head = Prompt(prompt.ids[:-tail], prompt.image_grids, prompt.video_grids, prompt.image_pixels, prompt.video_pixels)
    session = Session(checkpoint.language.new_cache())
    steps = [prefill(checkpoint, session, head)]
    steps += [decode(checkpoint, session, token) for token in prompt.ids[-tail:]]
    torch.testing.assert_close(
        torch.stack(steps), ref[-tail - 1 :], atol=1e-4, rtol=1e-5
    )  # (fp32 sums: wider heads round ~1e-5 relative)


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_greedy_generation_matches_transformers(checkpoint: Checkpoint, case: str) -> None:
    prompt = make_prompt(checkpoint.spec, MEDIA_CASES[case], seed=6)
    expected = hf.greedy_generate(checkpoint.reference, prompt.ids, prompt.hf_images(), prompt.hf_videos())
    ours = greedy(checkpoint, Session(checkpoint.language.new_cache()), prompt)
    assert len(expected) == 32 or expected[-1] in checkpoint.spec.eos_token_ids
    assert ours == expected


@pytest.mark.parametrize("new_image", [False, True], ids=["text_turn", "image_turn"])
def test_continued_conversation_matches_transformers(checkpoint: Checkpoint, new_image: bool) -> None:
    """Turn 2 reuses turn 1's KV cache; HF regenerates from the whole transcript."""
    spec = checkpoint.spec
    first = make_prompt(spec, [("image", (1, 4, 6))], seed=7)
    session = Session(checkpoint.language.new_cache())
    reply = greedy(checkpoint, session, first)
    assert reply == hf.greedy_generate(checkpoint.reference, first.ids, first.hf_images())

    # The reply's last token was sampled but never fed; it leads the next chunk.
    media = [("image", (1, 2, 4))] if new_image else []
    turn = make_prompt(spec, media, seed=8)
    chunk = Prompt([reply[-1], NEWLINE, *turn.ids], turn.image_grids, [], turn.image_pixels)
    assert session.cache.length == len(first.ids) + len(reply) - 1
    ours = greedy(checkpoint, session, chunk)

    transcript = first.ids + reply + chunk.ids[1:]
    images = first.hf_images()
    if new_image:
        images = (
            torch.cat([first.image_pixels, turn.image_pixels]),
            torch.tensor(first.image_grids + turn.image_grids),
        )
    assert ours == hf.greedy_generate(checkpoint.reference, transcript, images)


# --- CUDA bf16 ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_matches_transformers(hub_checkpoint: Checkpoint) -> None:
    """bf16 on CUDA. We issue the same kernels as transformers (same SDPA layouts and scale, CPU-computed
    rotary frequencies), so results agree far below bf16 noise; tolerances only guard kernel choice."""
    path, device = hub_checkpoint.path, torch.device("cuda")
    reference = hf.Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ckpt = Checkpoint(
        path=path,
        reference=reference,
        spec=hub_checkpoint.spec,
        vision=VisionTower.from_checkpoint(path, device, torch.bfloat16),
        language=LanguageModel.from_checkpoint(path, device, torch.bfloat16),
    )
    assert ckpt.language.lm_head.weight.dtype == torch.bfloat16
    prompt = make_prompt(ckpt.spec, MEDIA_CASES["image_and_video"], seed=9)
    grid = torch.tensor(prompt.image_grids)
    ours_vision = ckpt.vision(prompt.image_pixels.to(device), grid)
    ref_vision = hf.vision_output(reference, prompt.image_pixels.to(device, torch.bfloat16), grid.to(device))
    torch.testing.assert_close(ours_vision, ref_vision, atol=2e-2, rtol=2e-2)

    images = (prompt.image_pixels.to(device, torch.bfloat16), grid.to(device))
    videos = (prompt.video_pixels.to(device, torch.bfloat16), torch.tensor(prompt.video_grids).to(device))
    ref_logits = hf.logits(reference, prompt.ids, images, videos)
    ours_logits = prefill(ckpt, Session(KVCache.for_model(ckpt.language)), prompt, all_logits=True)
    assert ours_logits.device.type == "cuda"
    torch.testing.assert_close(ours_logits, ref_logits, atol=5e-2, rtol=5e-2)

    ours = greedy(ckpt, Session(KVCache.for_model(ckpt.language)), prompt, max_new_tokens=16)
    assert ours == hf.greedy_generate(reference, prompt.ids, images, videos, max_new_tokens=16)
