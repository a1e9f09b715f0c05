"""Qwen3-VL as the server runs it, on the tiny synthetic checkpoint (CPU, fp32): the registry and spec, the fetcher's
image processing against transformers' image processor of the checkpoint, and the decoder's paged engine with
DeepStack (chunked prefill, prefix-cache hits) against the one-sequence reference model."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from common.config import DecoderConfig
from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
from workers.decoder.batch import Sequence, positions, step_deepstack, step_embeddings
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.graphs import StepGraphs, StepInputs
from workers.fetcher.image import ImageProcessorSpec, decode_image, preprocess_image
from workers.models.language import merge_media_embeddings
from workers.models.mrope import decode_positions
from workers.models.paged import BatchLayout, PagedKVCache, fuse_layers, paged_attention_reference, paged_forward
from workers.models.qwen3_vl_text import DeepStack, Qwen3LanguageModel
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint

Parts = tuple[Qwen3LanguageModel, ModelSpec]
IMAGE_TOKENS = 12  # a [1, 6, 8] grid: 48 patches, 12 merged tokens


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("qwen3_vl_serving") / "tiny", "tiny", 0, family="qwen3_vl")


@pytest.fixture(scope="module")
def parts(tiny_path: Path) -> Parts:
    spec = read_spec(tiny_path)
    model = checkpoint_family(tiny_path).language_model(tiny_path, dtype=torch.float32, spec=spec)
    assert isinstance(model, Qwen3LanguageModel)
    return model, spec


# --- registry and spec ----------------------------------------------------------------------------------------


def test_spec_reads_the_text_model_and_deepstack_fields(parts: Parts) -> None:
    _, spec = parts
    assert spec.model_type == "qwen3_vl" and spec.qk_norm and spec.mrope_interleaved
    assert spec.vision.patch_size == 16 and spec.vision.deepstack_visual_indexes == (0, 1)
    assert spec.num_deepstack == 2 and spec.embedding_sets == 3
    assert spec.mrope_section == (4, 2, 2) and spec.rope_theta == 5_000_000.0 and spec.rms_norm_eps == 1e-6


def test_served_tower_stacks_the_merged_output_and_deepstack_sets(tiny_path: Path) -> None:
    tower = checkpoint_family(tiny_path).vision_tower(tiny_path, dtype=torch.float32)
    grid = torch.tensor([[1, 6, 8], [1, 4, 4]])
    pixels = torch.randn(int(grid.prod(dim=1).sum()), tower.spec.patch_dim, generator=torch.Generator().manual_seed(0))
    stacked = tower(pixels, grid)
    features = super(type(tower), tower).forward(pixels, grid)
    assert tuple(stacked.shape) == (3, IMAGE_TOKENS + 4, 64)
    torch.testing.assert_close(stacked, torch.stack([features.merged, *features.deepstack]), rtol=0, atol=0)


def test_the_gpu_fast_paths() -> None:
    settings = DecoderConfig(kernels="triton", cuda_graphs=True)
    config = EngineConfig.from_settings(settings, torch.device("cuda"), 64, 4096)
    assert config.fuse and config.graphs == "cuda"


# --- the fetcher's image processing -----------------------------------------------------------------------------


def _image_bytes(width: int, height: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels, mode)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    ("width", "height", "mode"),
    [(150, 100, "RGB"), (37, 45, "RGB"), (1200, 900, "RGB"), (150, 100, "L"), (90, 140, "RGBA"), (512, 20, "RGB")],
)
def test_pixel_values_and_grids_match_transformers(tiny_path: Path, width: int, height: int, mode: str) -> None:
    # transformers maps qwen3_vl's image processor to Qwen2VLImageProcessor (its PIL variant without torchvision);
    # read from the checkpoint's preprocessor_config.json: patch 16, merge 2, mean/std 0.5, size's pixel limits.
    reference = AutoImageProcessor.from_pretrained(tiny_path)
    spec = ImageProcessorSpec.from_dir(tiny_path)
    assert (spec.patch_size, spec.merge_size, spec.min_pixels, spec.max_pixels) == (
        16,
        2,
        reference.size["shortest_edge"],
        reference.size["longest_edge"],
    )
    data = _image_bytes(width, height, mode, seed=width)
    values, grid = preprocess_image(decode_image(data, 10**8), spec)
    expected = reference(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert grid == tuple(int(v) for v in expected["image_grid_thw"][0])
    assert values.shape == expected["pixel_values"].shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert np.array_equal(values, expected["pixel_values"])


# --- DeepStack in the paged engine ------------------------------------------------------------------------------


def _image_request(
    rid: str, spec: ModelSpec, content_hash: str, prefix: list[int], suffix: list[int]
) -> PreparedRequest:
    media = PreparedMedia("image", content_hash, [1, 6, 8], IMAGE_TOKENS)
    ids = [*prefix, spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id, *suffix]
    return PreparedRequest(rid, ids, [media], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


def _features(spec: ModelSpec, seed: int) -> torch.Tensor:
    """An image's cache entry: [1 + K, tokens, hidden], scaled so that the DeepStack adds move the tokens."""
    generator = torch.Generator().manual_seed(seed)
    return 4 * torch.randn(spec.embedding_sets, IMAGE_TOKENS, spec.hidden_size, generator=generator)


def _engine(parts: Parts, **overrides: object) -> Engine:
    model, spec = parts
    options: dict[str, object] = {
        "max_model_len": 4096,
        "max_running": 8,
        "prefill_budget": 4096,
        "num_blocks": 256,
        "block_size": 4,
    }
    options.update(overrides)
    return Engine(model, spec, EngineConfig(**options))  # type: ignore[arg-type]


def _prepare(engine: Engine, req: PreparedRequest, sets: torch.Tensor) -> Sequence:
    seq = engine.prepare(req)
    seq.media_embeds, seq.deepstack_embeds = sets[0], sets[1:]
    return seq


def _run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return tokens


def _reference_tokens(parts: Parts, seq: Sequence, sets: torch.Tensor, count: int) -> list[int]:
    """The one-sequence model: the prompt in one prefill with its DeepStack, then one token a step."""
    model, spec = parts
    ids = seq.prompt_ids
    embeds = merge_media_embeddings(model.embed(ids), ids, sets[0], [spec.image_token_id])
    deepstack = DeepStack.at_placeholders(ids, [spec.image_token_id], list(sets[1:]))
    cache = model.new_cache()
    out = [int(model(embeds, seq.positions, cache, deepstack).argmax())]
    while len(out) < count:
        step = model(model.embed([out[-1]]), decode_positions(len(ids) + len(out) - 1, 1, seq.delta), cache)
        out.append(int(step.argmax()))
    return out


SYSTEM = [(11 * i) % 900 + 20 for i in range(10)]


def test_engine_with_deepstack_equals_the_reference_model(parts: Parts) -> None:
    _, spec = parts
    sets = _features(spec, 1)
    req = _image_request("one", spec, "hash-A", SYSTEM, [31, 32, 33])
    engine = _engine(parts, prefix_cache=False)
    seq = _prepare(engine, req, sets)
    engine.add(seq)
    ours = _run(engine)["one"]
    assert ours == _reference_tokens(parts, seq, sets, 6)
    # and the adds matter: without the DeepStack sets the tokens differ
    plain = _engine(parts, prefix_cache=False)
    bare = plain.prepare(req)
    bare.media_embeds = sets[0]
    plain.add(bare)
    assert _run(plain)["one"] != ours


@pytest.mark.parametrize("budget", [5, 7, 16])
def test_chunked_prefill_slices_the_sets_with_the_prompt(parts: Parts, budget: int) -> None:
    # Chunks of 5 and 7 tokens cut the image's 12 rows at different places, beside another sequence's chunks.
    _, spec = parts
    requests = [
        (_image_request("a", spec, "hash-A", SYSTEM, [31, 32, 33]), _features(spec, 1)),
        (_image_request("b", spec, "hash-B", SYSTEM[:3], [41, 42]), _features(spec, 2)),
    ]
    engine = _engine(parts, prefill_budget=budget, prefix_cache=False)
    seqs = [_prepare(engine, req, sets) for req, sets in requests]
    for seq in seqs:
        engine.add(seq)
    tokens = _run(engine)
    for seq, (req, sets) in zip(seqs, requests, strict=True):
        assert tokens[req.request_id] == _reference_tokens(parts, seq, sets, 6)


def test_a_prefix_hit_past_image_rows_does_not_read_their_sets(parts: Parts) -> None:
    _, spec = parts
    sets = _features(spec, 1)
    engine = _engine(parts)
    first = _image_request("first", spec, "hash-A", SYSTEM, [31, 32, 33, 34, 35, 36, 37, 38])
    engine.add(_prepare(engine, first, sets))
    _run(engine)
    second = _image_request("second", spec, "hash-A", SYSTEM, [31, 32, 33, 34, 35, 36, 41, 42])
    before = engine.scheduler.blocks.counters["prefix_hit_tokens"]
    # The cached rows' sets are poisoned: a step that read them would not give the reference's tokens.
    poisoned = sets.clone()
    seq = _prepare(engine, second, poisoned)
    image_start = seq.prompt_ids.index(spec.image_token_id)
    hit = (len(seq.prompt_ids) - 3) // 4 * 4  # every full block before the first differing token
    poisoned[1:, : hit - image_start] = float("nan")
    engine.add(seq)
    tokens = _run(engine)["second"]
    assert engine.scheduler.blocks.counters["prefix_hit_tokens"] - before == hit > image_start + IMAGE_TOKENS // 2
    assert tokens == _reference_tokens(parts, seq, sets, 6)


def test_step_deepstack_rows_and_sets_of_each_span(parts: Parts) -> None:
    engine = _engine(parts)
    _, spec = parts
    sets = _features(spec, 3)
    seq = _prepare(engine, _image_request("s", spec, "hash-S", SYSTEM[:2], [50, 51]), sets)
    start = seq.prompt_ids.index(spec.image_token_id)  # 3: two text tokens and vision_start first
    text = _prepare(engine, PreparedRequest("t", [60, 61, 62], [], SamplingParams(max_tokens=1)), sets[:, :0])
    text.deepstack_embeds = None
    # A text span first (3 rows), then the image sequence's tokens [5, 10): image rows 2..6 at step rows 3..7.
    found = step_deepstack([(text, 0, 3), (seq, start + 2, start + 7)])
    assert found is not None
    assert found.rows.tolist() == [3, 4, 5, 6, 7]
    torch.testing.assert_close(found.features, sets[1:, 2:7], rtol=0, atol=0)
    assert step_deepstack([(seq, 0, start)]) is None  # before the image
    assert step_deepstack([(seq, start + IMAGE_TOKENS, start + IMAGE_TOKENS + 3)]) is None  # past it
    assert step_deepstack([(text, 0, 3)]) is None


# --- the fast path: fused layers (q/k norm + rotary in one pass) and the graphs' static buffers ---------------


@pytest.fixture(scope="module")
def fused_parts(tiny_path: Path) -> Parts:
    """A model of its own: `fuse_layers` points its parameters at the concatenated weights."""
    spec = read_spec(tiny_path)
    model = checkpoint_family(tiny_path).language_model(tiny_path, dtype=torch.float32, spec=spec)
    assert isinstance(model, Qwen3LanguageModel)
    return model, spec


FAST_FP32 = {"rtol": 1e-5, "atol": 1e-5}  # the same math; only the fused GEMMs' and adds' roundings differ
BLOCKS = {"a": list(range(0, 16)), "b": list(range(16, 32))}  # each sequence's block table (block size 4)


def _two_image_sequences(parts: Parts) -> tuple[Sequence, Sequence]:
    """Two image prompts (27 and 19 tokens) with their sets, and the tokens each will have decoded."""
    _, spec = parts
    engine = _engine(parts)
    a = _prepare(engine, _image_request("a", spec, "hash-A", SYSTEM, [31, 32, 33]), _features(spec, 1))
    b = _prepare(engine, _image_request("b", spec, "hash-B", SYSTEM[:3], [41, 42]), _features(spec, 2))
    a.output_ids, b.output_ids = [78], [77, 79]
    return a, b


def _steps(a: Sequence, b: Sequence) -> list[list[tuple[Sequence, int, int]]]:
    """Step 1: a's first chunk (visual rows at its end) beside b's whole prompt (an image); step 2: a's second
    chunk (the rest of its image) beside b's first decode; step 3: both decode (no visual row)."""
    la, lb = len(a.prompt_ids), len(b.prompt_ids)
    return [[(a, 0, 16), (b, 0, lb)], [(a, 16, la), (b, lb, lb + 1)], [(a, la, la + 1), (b, lb + 1, lb + 2)]]


def _layout(spans: list[tuple[Sequence, int, int]]) -> BatchLayout:
    return BatchLayout.build(
        [end - start for _, start, end in spans],
        [end for _, _, end in spans],
        [BLOCKS[s.request_id] for s, _, _ in spans],
        4,
    )


def _paged_logits(model: Qwen3LanguageModel, steps: list, fused: bool) -> list[torch.Tensor]:
    """Every token's logits of each step through `paged_forward`, eager layers or fused ones."""
    kv = PagedKVCache.for_model(model, 32, 4)  # type: ignore[arg-type]
    layers = fuse_layers(model) if fused else None
    out = []
    for spans in steps:
        embeds = step_embeddings(model, spans)  # type: ignore[arg-type]
        step_positions = torch.cat([positions(seq, start, end) for seq, start, end in spans], dim=1)
        rows = list(range(embeds.shape[0]))
        deepstack = step_deepstack(spans)
        out.append(
            paged_forward(model, embeds, step_positions, _layout(spans), kv, rows, fused=layers, deepstack=deepstack)
        )  # type: ignore[arg-type]
    return out


def test_fused_layers_equal_the_eager_layers_with_deepstack(parts: Parts, fused_parts: Parts) -> None:
    a, b = _two_image_sequences(parts)
    steps = _steps(a, b)
    assert [step_deepstack(spans) is not None for spans in steps] == [True, True, False]
    eager = _paged_logits(parts[0], steps, fused=False)
    fused = _paged_logits(fused_parts[0], steps, fused=True)
    for ours, expected in zip(fused, eager, strict=True):
        torch.testing.assert_close(ours, expected, **FAST_FP32)


def test_static_graphs_add_deepstack_on_mixed_steps_only_where_rows_are(parts: Parts, fused_parts: Parts) -> None:
    """The mixed graphs' dense DeepStack buffer: step 2's visual rows (a's image, rows 0..6 of the step) are
    zeroed again before step 3, whose decodes run in the same mixed graph (a stale row would move them)."""
    model = fused_parts[0]
    a, b = _two_image_sequences(parts)
    steps = _steps(a, b)
    eager = _paged_logits(parts[0], steps, fused=False)
    kv = PagedKVCache.for_model(model, 33, 4)  # type: ignore[arg-type]
    graphs = StepGraphs(
        model,  # type: ignore[arg-type]
        kv,
        max_seqs=4,
        max_tokens=64,
        max_context=64,
        scratch_block=32,
        attention=paged_attention_reference,
        fused=fuse_layers(model),
        capture=False,
    )
    assert graphs.deepstack is not None and tuple(graphs.deepstack.shape) == (2, 64, 64)
    for spans, expected in zip(steps, eager, strict=True):
        layout = _layout(spans)
        last = [int(i) for i in layout.last_token_indices]
        inputs = StepInputs(
            positions=torch.cat([positions(seq, start, end) for seq, start, end in spans], dim=1).numpy(),
            slots=layout.slot_mapping.numpy(),
            query_lens=[end - start for _, start, end in spans],
            context_lens=[end for _, _, end in spans],
            block_tables=[BLOCKS[s.request_id] for s, _, _ in spans],
            rows=last,
        )
        logits = graphs.mixed(inputs, step_embeddings(model, spans), step_deepstack(spans))  # type: ignore[arg-type]
        torch.testing.assert_close(logits, expected[last], **FAST_FP32)
    assert sorted(graphs.mixed_runs) == [(2, 32), (12, 32), (35, 64)]


def test_engine_with_static_graphs_and_fused_layers_equals_the_eager_engine(parts: Parts, fused_parts: Parts) -> None:
    """Greedy tokens of image prompts (DeepStack) in chunks of 16 beside other sequences' decodes, all in the
    mixed graphs, then decodes in the decode graphs; then a text prompt, whose prefill follows steps that filled
    the DeepStack buffer. Each equals the eager engine's and the one-sequence reference's."""
    _, spec = parts
    images = [
        (_image_request("a", spec, "hash-A", SYSTEM, [31, 32, 33]), _features(spec, 1)),
        (_image_request("b", spec, "hash-B", SYSTEM[:3], [41, 42]), _features(spec, 2)),
    ]
    text = PreparedRequest("t", [60, 61, 62, 63, 64, 65, 66, 67], [], SamplingParams(max_tokens=6, temperature=0.0))

    def tokens(engine: Engine) -> dict[str, list[int]]:
        for req, sets in images:
            engine.add(_prepare(engine, req, sets))
        out = _run(engine)
        engine.add(engine.prepare(text))
        return {**out, **_run(engine)}

    eager = tokens(_engine(parts, prefill_budget=16, prefix_cache=False))
    fast = _engine(fused_parts, prefill_budget=16, prefix_cache=False, fuse=True, graphs="static", graph_tokens=48)
    ours = tokens(fast)
    graphs = fast.runner.graphs
    assert graphs is not None and graphs.mixed_runs and graphs.runs
    assert fast.counters["graph_steps"] == fast.counters["steps"]
    assert ours == eager
    for req, sets in images:
        seq = _prepare(_engine(parts), req, sets)
        assert ours[req.request_id] == _reference_tokens(parts, seq, sets, 6)
