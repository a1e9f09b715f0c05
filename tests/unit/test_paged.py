"""The batched paged-KV forward against the per-sequence `LanguageModel.forward` with a contiguous `KVCache`.

Each scenario runs the same token streams twice: sequence by sequence through the existing path (the
reference), and all together through `paged_forward`, with block tables drawn from a shuffled pool so
that no sequence's blocks are contiguous or in order. On CPU fp32 the logits are bit for bit the same
wherever the two paths issue ops of the same shapes (one sequence per forward), and within 1e-5 of the
logits' magnitude when sequences share a forward; bf16 (CPU, and CUDA where present) within BF16_REL.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from workers.models.language import LanguageModel, attention_reference, merge_media_embeddings
from workers.models.mrope import decode_positions, rope_positions
from workers.models.paged import BatchLayout, PagedKVCache, paged_attention_reference, paged_forward
from workers.models.synth import generate_checkpoint

# CPU GEMMs round a row differently depending on how many rows the matrix has (MKL picks kernels and
# blockings by shape), so a batch of several sequences cannot reproduce the per-sequence bits. Those
# ulp-level differences grow through the layers to ~1.5e-6 of the logits' magnitude (~1.4e-5 absolute on
# logits of about 9); we bound them relative to each row's largest logit. Wherever the ops have the same
# shapes (one sequence per forward) the tests demand the same bits.
FP32_REL = 1e-5
FP32_TOL = {"atol": 1e-5, "rtol": 0.0}  # for tensors of order 1 (attention outputs)
BLOCK_SIZES = [1, 16, 7]  # one token a block, a typical size, and one that is not a power of two
IMAGE_GRID = (1, 6, 8)  # 12 placeholder tokens with spatial merge 2: positions differ on all three axes


# --- model and token streams --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("paged") / "tiny", "tiny", seed=5)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LanguageModel:
    return LanguageModel.from_checkpoint(checkpoint, dtype=torch.float32)


@dataclass
class Stream:
    """One sequence's tokens as the model sees them: ids, embeddings [N, hidden], positions [3, N]."""

    ids: list[int]
    embeds: torch.Tensor
    positions: torch.Tensor
    delta: int  # M-RoPE offset for tokens appended after ``ids``

    def __len__(self) -> int:
        return len(self.ids)

    def chunk(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embeds[start : start + n], self.positions[:, start : start + n]


def text_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 151643) for _ in range(length)]  # regular (non-special) tokens


def text_stream(model: LanguageModel, length: int, seed: int) -> Stream:
    ids = text_ids(length, seed)
    return Stream(ids, model.embed(ids), decode_positions(0, length, 0), 0)


def image_stream(model: LanguageModel, before: int, after: int, seed: int) -> Stream:
    """Text, an image placeholder run with fake vision rows, text: 3-axis M-RoPE positions."""
    spec = model.spec
    count = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // spec.vision.spatial_merge_size**2
    ids = [
        *text_ids(before, seed),
        spec.vision_start_token_id,
        *[spec.image_token_id] * count,
        spec.vision_end_token_id or spec.vision_start_token_id + 1,
        *text_ids(after, seed + 1),
    ]
    generator = torch.Generator().manual_seed(seed)
    media = torch.randn(count, spec.hidden_size, generator=generator).to(model.device, model.dtype)
    embeds = merge_media_embeddings(model.embed(ids), ids, media, (spec.image_token_id,))
    positions, delta = rope_positions(ids, [IMAGE_GRID], [], spec)
    assert not torch.equal(positions[1], positions[2]), "the image run must exercise separate h/w positions"
    return Stream(ids, embeds, positions, delta)


def reference_logits(model: LanguageModel, stream: Stream, chunks: Sequence[int]) -> torch.Tensor:
    """Per-sequence path, fed in ``chunks``: logits [N, vocab] of every token."""
    cache, out, start = model.new_cache(capacity=8), [], 0  # small capacity: growth is exercised too
    for n in chunks:
        out.append(model.forward(*stream.chunk(start, n), cache, all_logits=True))
        start += n
    assert start == len(stream)
    return torch.cat(out)


# --- a minimal paged "engine" -------------------------------------------------------------------------


@dataclass
class PagedRunner:
    """Allocates blocks from a shuffled pool as sequences grow and runs batched forwards."""

    model: LanguageModel
    block_size: int
    num_blocks: int = 512
    seed: int = 0
    kv: PagedKVCache = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict, init=False)
    computed: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.kv = PagedKVCache.for_model(self.model, self.num_blocks, self.block_size)
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def share_prefix(self, source: str, target: str, blocks: int) -> None:
        """``target`` starts with ``source``'s first full blocks, already computed."""
        assert self.computed[source] >= blocks * self.block_size
        self.tables[target] = self.tables[source][:blocks]
        self.computed[target] = blocks * self.block_size

    def step(self, work: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One forward over (name, embeds [n, H], positions [3, n]) items; logits [n, vocab] per name."""
        query_lens, context_lens, tables = [], [], []
        for name, embeds, _ in work:
            context = self.computed.get(name, 0) + embeds.shape[0]
            table = self.tables.setdefault(name, [])
            while len(table) * self.block_size < context:
                table.append(self.free.pop())
            query_lens.append(embeds.shape[0])
            context_lens.append(context)
            tables.append(table)
        layout = BatchLayout.build(query_lens, context_lens, tables, self.block_size, self.model.device)
        embeds = torch.cat([e for _, e, _ in work])
        positions = torch.cat([p for _, _, p in work], dim=1)
        logits = paged_forward(self.model, embeds, positions, layout, self.kv, logits_for=range(layout.num_tokens))
        for (name, _, _), context in zip(work, context_lens, strict=True):
            self.computed[name] = context
        return dict(zip([name for name, _, _ in work], logits.split(query_lens), strict=True))

    def run_schedule(
        self, streams: dict[str, Stream], schedule: dict[str, list[int]], batched: bool = True
    ) -> dict[str, torch.Tensor]:
        """Feed every stream in its chunks, step k batching everyone's k-th chunk; logits [N, vocab] each.

        Unbatched, each chunk gets its own forward, but blocks are still handed out interleaved.
        """
        out: dict[str, list[torch.Tensor]] = {name: [] for name in streams}
        fed = dict.fromkeys(streams, 0)
        for k in range(max(len(chunks) for chunks in schedule.values())):
            work = []
            for name, chunks in schedule.items():
                if k < len(chunks):
                    start, n = fed[name], chunks[k]
                    work.append((name, *streams[name].chunk(start, n)))
                    fed[name] += n
            for batch in [work] if batched else [[item] for item in work]:
                for name, logits in self.step(batch).items():
                    out[name].append(logits)
        return {name: torch.cat(parts) for name, parts in out.items()}


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = FP32_REL) -> None:
    """Every row within ``rel`` times that row's largest |logit|."""
    assert actual.shape == expected.shape
    error = (actual.float() - expected.float()).abs().amax(-1)
    scale = expected.float().abs().amax(-1)
    worst = int((error / scale).argmax())
    assert bool((error <= rel * scale).all()), (
        f"row {worst}: max |diff| {error[worst]:.3g} > {rel:g} x max |logit| {scale[worst]:.3g}"
    )


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def shuffled_tables(context_lens: Sequence[int], block_size: int, num_blocks: int, seed: int) -> list[list[int]]:
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    return [[blocks.pop() for _ in range(-(-n // block_size))] for n in context_lens]


# --- CPU fp32 parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_single_prefill_is_bitwise_identical(model: LanguageModel, block_size: int) -> None:
    """One sequence in one go issues exactly the per-sequence path's ops, so the logits are the same bits."""
    stream = text_stream(model, 37, seed=1)
    paged = PagedRunner(model, block_size).run_schedule({"a": stream}, {"a": [37]})["a"]
    assert torch.equal(paged, reference_logits(model, stream, [37]))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_default_logits_are_each_sequences_last_token(model: LanguageModel, block_size: int) -> None:
    a, b = text_stream(model, 9, seed=2), image_stream(model, 3, 4, seed=3)
    lens = [len(a), len(b)]
    kv = PagedKVCache.for_model(model, 64, block_size)
    layout = BatchLayout.build(lens, lens, shuffled_tables(lens, block_size, 64, seed=block_size), block_size)
    embeds, positions = torch.cat([a.embeds, b.embeds]), torch.cat([a.positions, b.positions], dim=1)
    logits = paged_forward(model, embeds, positions, layout, kv)
    assert logits.shape == (2, model.spec.vocab_size)
    assert_logits_close(logits[0:1], reference_logits(model, a, [len(a)])[-1:])
    assert_logits_close(logits[1:2], reference_logits(model, b, [len(b)])[-1:])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_prefill_across_block_boundaries(model: LanguageModel, block_size: int) -> None:
    stream = image_stream(model, 11, 15, seed=4)  # 40 tokens
    chunks = [5, 11, 3, 13, 1, 7]
    assert sum(chunks) == len(stream)
    paged = PagedRunner(model, block_size, seed=block_size).run_schedule({"a": stream}, {"a": chunks})["a"]
    # Same chunks, same op shapes: the same bits, whatever the blocks.
    assert torch.equal(paged, reference_logits(model, stream, chunks))
    # Chunking itself only changes rounding: also close to computing the prompt at once.
    assert_logits_close(paged, reference_logits(model, stream, [len(stream)]))


def mixed_case(model: LanguageModel) -> tuple[dict[str, Stream], dict[str, list[int]]]:
    """Sequences at different stages sharing forwards: first chunks, later chunks and decode tokens."""
    streams = {
        "long": text_stream(model, 45, seed=10),
        "image": image_stream(model, 6, 9, seed=11),
        "short": text_stream(model, 8, seed=12),
        "one": text_stream(model, 5, seed=13),
        "late": text_stream(model, 20, seed=14),
    }
    schedule = {
        "long": [17, 9, 13, 1, 1, 1, 1, 1, 1],
        "image": [4, 19, 2, 1, 1, 1, 1],  # the image run is split between two chunks
        "short": [3, 1, 1, 1, 1, 1],  # decodes while the others still prefill
        "one": [1, 1, 1, 1, 1],  # a one-token prompt, then decode
        "late": [2, 2, 16],
    }
    return streams, schedule


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_prefill_and_decode_batch(model: LanguageModel, block_size: int) -> None:
    streams, schedule = mixed_case(model)
    paged = PagedRunner(model, block_size, seed=100 + block_size).run_schedule(streams, schedule)
    for name, stream in streams.items():
        assert_logits_close(paged[name], reference_logits(model, stream, schedule[name]))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paging_adds_no_rounding(model: LanguageModel, block_size: int) -> None:
    """The mixed schedule with one sequence per forward: blocks interleaved between sequences, the same bits.

    So in the batched test above, all differences come from the GEMMs' row count, none from paging.
    """
    streams, schedule = mixed_case(model)
    paged = PagedRunner(model, block_size, seed=block_size).run_schedule(streams, schedule, batched=False)
    for name, stream in streams.items():
        assert torch.equal(paged[name], reference_logits(model, stream, schedule[name])), name


@pytest.mark.parametrize("together", [True, False], ids=["one-forward", "own-forwards"])
@pytest.mark.parametrize("block_size", [8, 5])
def test_shared_prefix_blocks_equal_computing_alone(model: LanguageModel, block_size: int, together: bool) -> None:
    """B reuses A's first full blocks (written by A's forwards) and computes only its own suffix."""
    a = text_stream(model, 24, seed=20)  # 23 prompt tokens, then one decode token
    shared = (23 // block_size) * block_size  # full blocks only: A keeps appending to its partial one
    b_ids = a.ids[:shared] + text_ids(9, seed=21)
    b = Stream(b_ids, model.embed(b_ids), decode_positions(0, len(b_ids), 0), 0)

    runner = PagedRunner(model, block_size, seed=7)
    runner.step([("a", *a.chunk(0, 20))])
    runner.step([("a", *a.chunk(20, 3))])
    runner.share_prefix("a", "b", shared // block_size)
    work = [("b", *b.chunk(shared, len(b) - shared)), ("a", *a.chunk(23, 1))]  # A writes its own blocks meanwhile
    out: dict[str, torch.Tensor] = {}
    for batch in [work] if together else [[item] for item in work]:
        out.update(runner.step(batch))

    assert_logits_close(out["b"], reference_logits(model, b, [len(b)])[shared:])
    assert_logits_close(out["a"], reference_logits(model, a, [20, 3, 1])[-1:])
    if not together:  # the same op shapes as B computed alone in two chunks: the same bits
        assert torch.equal(out["b"], reference_logits(model, b, [shared, len(b) - shared])[shared:])
        assert torch.equal(out["a"], reference_logits(model, a, [20, 3, 1])[-1:])


def greedy_alone(model: LanguageModel, stream: Stream, new_tokens: int) -> list[int]:
    cache = model.new_cache()
    token = int(model.forward(stream.embeds, stream.positions, cache).argmax())
    tokens = [token]
    while len(tokens) < new_tokens:
        position = decode_positions(cache.length, 1, stream.delta)
        token = int(model.forward(model.embed([token]), position, cache).argmax())
        tokens.append(token)
    return tokens


def greedy_batched(
    model: LanguageModel, streams: list[Stream], new_tokens: int, block_size: int, prefill_chunk: int
) -> list[list[int]]:
    """Every unfinished sequence in every forward: prompts in chunks, then one decode token each."""
    runner = PagedRunner(model, block_size, seed=3)
    fed = [0] * len(streams)
    tokens: list[list[int]] = [[] for _ in streams]
    while any(len(t) < new_tokens for t in tokens):
        work = []
        for s, stream in enumerate(streams):
            if fed[s] < len(stream):
                n = min(prefill_chunk + s, len(stream) - fed[s])  # chunk sizes differ per sequence
                work.append((str(s), *stream.chunk(fed[s], n)))
                fed[s] += n
            elif len(tokens[s]) < new_tokens:
                position = decode_positions(fed[s], 1, stream.delta)
                work.append((str(s), model.embed([tokens[s][-1]]), position))
                fed[s] += 1
        for name, logits in runner.step(work).items():
            s = int(name)
            if fed[s] >= len(streams[s]):  # the prompt is complete: this forward's last token predicts
                tokens[s].append(int(logits[-1].argmax()))
    return tokens


def generation_streams(model: LanguageModel) -> list[Stream]:
    lengths = [3, 9, 17, 26, 33, 41, 50]
    return [text_stream(model, n, seed=30 + i) for i, n in enumerate(lengths)] + [image_stream(model, 5, 7, seed=40)]


@pytest.mark.parametrize("block_size", [16, 7])
def test_batched_greedy_generation_matches_each_alone(model: LanguageModel, block_size: int) -> None:
    streams = generation_streams(model)
    batched = greedy_batched(model, streams, new_tokens=16, block_size=block_size, prefill_chunk=10)
    for s, stream in enumerate(streams):
        assert batched[s] == greedy_alone(model, stream, 16), f"sequence {s} ({len(stream)} prompt tokens)"


# --- attention reference ------------------------------------------------------------------------------


def test_paged_attention_reference_matches_explicit_math() -> None:
    """Against `language.attention_reference` (explicit mask, fp32 softmax) on each gathered context."""
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 8, 3, 40
    generator = torch.Generator().manual_seed(0)
    kv_k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    kv_v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    query_lens, context_lens = [4, 1, 7, 1], [10, 13, 7, 1]
    tables = shuffled_tables(context_lens, block_size, num_blocks, seed=1)
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size)
    q = torch.randn(sum(query_lens), heads, dim, generator=generator)

    out = paged_attention_reference(q, kv_k, kv_v, layout, dim**-0.5)
    start = 0
    for n, context, table in zip(query_lens, context_lens, tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context)])
        k, v = kv_k[slots].transpose(0, 1), kv_v[slots].transpose(0, 1)
        expected = attention_reference(q[start : start + n].transpose(0, 1), k, v, context - n).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expected, **FP32_TOL)
        start += n


# --- layout and cache ---------------------------------------------------------------------------------


def test_slot_mapping_and_tensors() -> None:
    layout = BatchLayout.build([3, 1, 2], [6, 2, 2], [[7, 2], [5], [0, 9]], 4)
    # seq 0 writes positions 3, 4, 5 (block 7 offset 3, block 2 offsets 0, 1); seq 1 position 1 of block 5.
    assert layout.slot_mapping.tolist() == [31, 8, 9, 21, 0, 1]
    assert layout.context_slots.tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 0, 1]
    assert layout.block_table_tensor.tolist() == [[7, 2], [5, -1], [0, 9]]
    assert layout.query_starts == [0, 3, 4, 6]
    assert layout.last_token_indices == [2, 3, 5]
    assert layout.slot_mapping is layout.slot_mapping  # built once
    assert layout.to("cpu") is layout


def test_layout_is_a_snapshot() -> None:
    table = [3]
    layout = BatchLayout.build([2], [2], [table], 4)
    table.append(5)  # the engine goes on growing its own table
    assert layout.block_tables == [[3]]
    with pytest.raises(AttributeError):
        layout.query_lens = [1]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1], [1, 2], [[0]], 4), "one entry per sequence"),
        (([], [], [], 4), "at least one sequence"),
        (([0], [3], [[0]], 4), "query_len must be >= 1"),
        (([4], [3], [[0]], 4), "smaller than its query_len"),
        (([1], [9], [[0, 1]], 4), "need 3 blocks"),
        (([1], [3], [[-1]], 4), "negative block id"),
        (([1], [6], [[2, 2]], 4), "repeats a block"),
        (([1], [3], [[0]], 0), "block_size must be >= 1"),
        # Two sequences appending into one block, or one appending to a block the other reads.
        (([1, 1], [2, 3], [[0], [0]], 4), "writes block 0, which sequences \\[1\\]"),
        (([1, 1], [5, 4], [[0, 1], [0]], 4), "writes block 0, which sequences \\[0\\]"),
    ],
)
def test_layout_validation(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchLayout.build(*args)


def test_shared_read_only_blocks_are_allowed() -> None:
    # Both read full block 0 and write only their own blocks.
    layout = BatchLayout.build([1, 2], [5, 6], [[0, 1], [0, 2]], 4)
    assert layout.slot_mapping.tolist() == [4, 8, 9]


def test_forward_validation(model: LanguageModel) -> None:
    kv = PagedKVCache.for_model(model, 4, 4)
    embeds, positions = model.embed([1, 2, 3]), decode_positions(0, 3, 0)
    with pytest.raises(ValueError, match="sum\\(query_lens\\)=2"):
        paged_forward(model, embeds, positions, BatchLayout.build([2], [2], [[0]], 4), kv)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_forward(model, embeds, positions, BatchLayout.build([3], [3], [[4]], 4), kv)
    with pytest.raises(ValueError, match="block_size 2 != cache block_size 4"):
        paged_forward(model, embeds, positions, BatchLayout.build([3], [3], [[0, 1]], 2), kv)
    with pytest.raises(ValueError, match="logits_for"):
        paged_forward(model, embeds, positions, BatchLayout.build([3], [3], [[0]], 4), kv, logits_for=[3])
    with pytest.raises(ValueError, match="outside the cache"):
        BatchLayout.build([3], [3], [[9]], 4, num_blocks=4)


def test_cache_shapes_and_block_copy(model: LanguageModel) -> None:
    spec = model.spec
    kv = PagedKVCache.for_model(model, num_blocks=6, block_size=5)
    assert len(kv.keys) == len(kv.values) == spec.num_layers
    assert kv.keys[0].shape == (30, spec.num_kv_heads, spec.head_dim)
    per_block = PagedKVCache.bytes_per_block(spec, 5, torch.float32)
    assert per_block == 2 * spec.num_layers * 5 * spec.num_kv_heads * spec.head_dim * 4
    assert per_block * 6 == sum(t.numel() * t.element_size() for t in kv.keys + kv.values)
    assert PagedKVCache.bytes_per_block(spec, 5, torch.bfloat16) == per_block // 2

    for layer in range(spec.num_layers):
        kv.keys[layer].copy_(torch.randn_like(kv.keys[layer]))
        kv.values[layer].copy_(torch.randn_like(kv.values[layer]))
    before = [t.clone() for t in kv.keys + kv.values]
    kv.copy_blocks([(1, 4), (3, 0)])
    for old, new in zip(before, kv.keys + kv.values, strict=True):
        assert torch.equal(new[20:25], old[5:10]) and torch.equal(new[0:5], old[15:20])
        assert torch.equal(new[5:20], old[5:20]) and torch.equal(new[25:], old[25:])
    with pytest.raises(ValueError, match="block ids"):
        kv.copy_blocks([(0, 6)])


# --- bf16 (CPU, and CUDA where there is one) -------------------------------------------------------------

# Batched and per-sequence bf16 runs may pick different GEMM kernels (the batch has more rows) and so
# round differently. bf16 itself is ~0.4 off fp32 on these logits (|logit| up to ~10, where one bf16 ulp
# is 0.0625), so we allow differences up to 5% of each row's largest logit, and demand that the paged
# batch is no further from fp32 than the existing per-sequence bf16 path, within one ulp at 8 (0.0625).
BF16_REL = 0.05
BF16_ULP_AT_8 = 0.0625
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_bf16_mixed_batch_matches_per_sequence(
    checkpoint: Path, model: LanguageModel, device: str, block_size: int
) -> None:
    bf16 = LanguageModel.from_checkpoint(checkpoint, device, torch.bfloat16)
    streams, schedule = mixed_case(bf16)
    streams32, _ = mixed_case(model)
    paged = PagedRunner(bf16, block_size, seed=block_size).run_schedule(streams, schedule)
    for name, stream in streams.items():
        assert paged[name].device.type == device and paged[name].dtype == torch.bfloat16
        expected = reference_logits(bf16, stream, schedule[name])
        assert_logits_close(paged[name], expected, rel=BF16_REL)
        fp32 = reference_logits(model, streams32[name], schedule[name])
        paged_error = max_abs_diff(paged[name], fp32)
        assert paged_error <= max_abs_diff(expected, fp32) + BF16_ULP_AT_8, name
