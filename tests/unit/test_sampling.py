"""Batched sampling: greedy, bans, penalties, temperature and filters, seeded streams, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from workers.decoder.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingRow,
    mix64,
    noise_key,
    sample_batch,
    seeded_uniforms,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def greedy(logits: list[float], **options: object) -> int:
    return sample_batch(torch.tensor([logits]), [SamplingRow(0.0, **options)]).token_ids[0]  # type: ignore[arg-type]


def draws(logits: torch.Tensor, n: int, **options: object) -> list[int]:
    """``n`` draws from one logits row: the first half seeded (seeds 0..), the rest from the torch RNG."""
    rows = [SamplingRow(**{"temperature": 1.0, **options}, seed=i if i < n // 2 else None) for i in range(n)]  # type: ignore[arg-type]
    return sample_batch(logits.repeat(n, 1), rows).token_ids


def chi_square(observed: list[int], probs: list[float]) -> float:
    counts, n = Counter(observed), len(observed)
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))


# Chi-square with 3 degrees of freedom exceeds 25 with probability ~1.6e-5; with a fixed seed the
# tests are deterministic anyway, so this only has to hold for the draws the seed gives.
CHI2_BOUND = 25.0


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    torch.manual_seed(1234)


# --------------------------------------------------------------------------- greedy and bans


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -3.0, -1.0, -2.0]])
    rows = [SamplingRow(0.0), SamplingRow(1e-6), SamplingRow(0.0)]
    state = torch.get_rng_state()
    assert sample_batch(logits, rows).token_ids == [1, 0, 0]
    assert torch.equal(torch.get_rng_state(), state)  # greedy rows draw no randomness


def test_greedy_matches_argmax_on_random_logits() -> None:
    logits = torch.randn(16, 1000)
    assert sample_batch(logits, [SamplingRow(0.0)] * 16).token_ids == logits.argmax(-1).tolist()


def test_greedy_bf16_logits() -> None:
    logits = torch.randn(8, 300).bfloat16()
    assert sample_batch(logits, [SamplingRow(0.0)] * 8).token_ids == logits.float().argmax(-1).tolist()


def test_banned_argmax_is_never_chosen_greedily() -> None:
    assert greedy([1.0, 9.0, 8.0, 8.5], banned=(1,)) == 3
    assert greedy([1.0, 9.0, 8.0, 8.5], banned=(1, 3)) == 2
    assert greedy([1.0, 9.0, 8.0], banned=(-1, 3, 10**9)) == 1  # ids outside the vocabulary are ignored


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(8)
    logits[0] = 5.0  # the banned favourite
    seen = Counter(draws(logits, 2000, banned=(0, 3)))
    assert set(seen) == {1, 2, 4, 5, 6, 7}


# --------------------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    ("logits", "options", "expected"),
    [
        # repetition divides a positive logit: 2.0 / 1.1 = 1.818 > 1.8, 2.0 / 1.12 = 1.786 < 1.8 ...
        ([2.0, 1.8], {"repetition_penalty": 1.1, "prompt_ids": [0]}, 0),
        ([2.0, 1.8], {"repetition_penalty": 1.12, "prompt_ids": [0]}, 1),
        ([2.0, 1.8], {"repetition_penalty": 1.12, "output_ids": [0]}, 1),  # generated tokens count too
        # ... and multiplies a negative one: -1.0 * 1.05 = -1.05 > -1.08, -1.0 * 1.1 = -1.1 < -1.08
        ([-1.0, -1.08], {"repetition_penalty": 1.05, "prompt_ids": [0]}, 0),
        ([-1.0, -1.08], {"repetition_penalty": 1.1, "prompt_ids": [0]}, 1),
        ([2.0, 1.8], {"repetition_penalty": 0.5, "prompt_ids": [1]}, 1),  # < 1 encourages: 1.8 / 0.5
        # frequency scales with the count: token 0 (twice) 3 - 2f, token 1 (once) 2.5 - f; they cross at f = 0.5
        ([3.0, 2.5, 1.0], {"frequency_penalty": 0.45, "output_ids": [0, 1, 0]}, 0),
        ([3.0, 2.5, 1.0], {"frequency_penalty": 0.55, "output_ids": [0, 1, 0]}, 1),
        # presence does not: 3 - p and 2.5 - p keep their order, both fall below 1.0 once p > 2
        ([3.0, 2.5, 1.0], {"presence_penalty": 1.9, "output_ids": [0, 1, 0]}, 0),
        ([3.0, 2.5, 1.0], {"presence_penalty": 2.1, "output_ids": [0, 1, 0]}, 2),
        ([1.0, 2.0], {"presence_penalty": -1.5, "output_ids": [0]}, 0),  # negative encourages
        # frequency and presence look at generated tokens only
        ([3.0, 2.5], {"frequency_penalty": 9.0, "presence_penalty": 9.0, "prompt_ids": [0]}, 0),
        # both at once: 3 - 0.3 * 2 - 0.2 = 2.2 < 2.25 = 2.5 - 0.3 * 0 ... token 1 not generated
        ([3.0, 2.25], {"frequency_penalty": 0.3, "presence_penalty": 0.2, "output_ids": [0, 0]}, 1),
        ([3.0, 2.15], {"frequency_penalty": 0.3, "presence_penalty": 0.2, "output_ids": [0, 0]}, 0),
    ],
)
def test_penalty_formulas(logits: list[float], options: dict[str, object], expected: int) -> None:
    assert greedy(logits, **options) == expected


def test_penalties_apply_before_bans_and_leave_other_rows_alone() -> None:
    logits = torch.tensor([[2.0, 1.8, 1.2], [2.0, 1.8, 1.2]])
    rows = [
        SamplingRow(0.0, repetition_penalty=2.0, prompt_ids=[0], banned=(1,)),
        SamplingRow(0.0, prompt_ids=[0], output_ids=[0]),
    ]
    assert sample_batch(logits, rows).token_ids == [2, 0]


def test_neutral_penalties_change_nothing() -> None:
    logits = torch.randn(64, 200) * 3
    history = {"prompt_ids": list(range(0, 200, 3)), "output_ids": list(range(0, 200, 7)) * 2}
    neutral = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    plain = [SamplingRow(1.0, seed=i, top_p=0.9) for i in range(64)]
    with_history = [SamplingRow(1.0, seed=i, top_p=0.9, **history, **neutral) for i in range(64)]  # type: ignore[arg-type]
    assert sample_batch(logits, plain).token_ids == sample_batch(logits, with_history).token_ids
    # a neighbour with real penalties sends the whole batch through the copy-and-adjust path
    mixed = [*with_history, SamplingRow(1.0, seed=0, repetition_penalty=1.3, frequency_penalty=0.5, **history)]  # type: ignore[arg-type]
    extended = torch.cat([logits, logits[:1]])
    assert sample_batch(extended, mixed).token_ids[:64] == sample_batch(logits, plain).token_ids


# --------------------------------------------------------------------------- logit bias


def test_logit_bias_is_added_to_the_logits() -> None:
    assert greedy([1.0, 9.0, 8.0, 8.5], logit_bias=((1, -0.6),)) == 3  # 8.4 < 8.5
    assert greedy([1.0, 9.0, 8.0, 8.5], logit_bias=((1, -0.4),)) == 1  # 8.6 > 8.5
    assert greedy([1.0, 9.0, 8.0], logit_bias=((0, 100.0),)) == 0
    assert greedy([1.0, 9.0, 8.0], logit_bias=((2, 0.6), (2, 0.6))) == 2  # named twice: both count
    assert greedy([1.0, 9.0, 8.0], logit_bias=((-1, 50.0), (3, 50.0), (10**9, 50.0))) == 1  # outside: ignored


def test_logit_bias_comes_after_penalties_and_before_bans() -> None:
    # penalty first: 4 / 2 + 1.5 = 3.5 > 3 picks token 0; the bias first would give (4 + 1.5) / 2 = 2.75 < 3
    assert greedy([4.0, 3.0], repetition_penalty=2.0, prompt_ids=[0], logit_bias=((0, 1.5),)) == 0
    assert greedy([4.0, 3.0], repetition_penalty=2.0, prompt_ids=[0], logit_bias=((0, 0.9),)) == 1
    assert greedy([4.0, 3.0, 0.0], logit_bias=((2, 100.0),), banned=(2,)) == 0  # a ban wins over any bias


def test_logit_bias_shapes_sampling_and_leaves_other_rows_alone() -> None:
    logits = torch.zeros(6)
    forbidden = tuple((t, -100.0) for t in (0, 1, 2))
    seen = Counter(draws(logits, 600, logit_bias=forbidden))
    assert set(seen) == {3, 4, 5}
    rows = [SamplingRow(1.0, seed=7, logit_bias=((4, 100.0),)), SamplingRow(1.0, seed=7)]
    both = sample_batch(torch.zeros(2, 6), rows).token_ids
    assert both[0] == 4
    assert both[1] == sample_batch(torch.zeros(1, 6), [SamplingRow(1.0, seed=7)]).token_ids[0]


def test_logit_bias_leaves_logprobs_raw() -> None:
    logits = logits_of(PROBS).unsqueeze(0)
    result = sample_batch(logits, [SamplingRow(0.0, logit_bias=((3, 100.0),), top_logprobs=1)])
    assert result.token_ids == [3]
    assert result.logprobs[0] == pytest.approx(math.log(PROBS[3]), abs=1e-5)
    assert result.top_logprobs[0][0][0] == 0  # the raw distribution's favourite


# --------------------------------------------------------------------------- temperature


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, -2.0])
    share_of_top = []
    for temperature in (0.5, 1.0, 2.0):
        observed = draws(logits, 8000, temperature=temperature)
        expected = torch.softmax(logits / temperature, -1).tolist()
        assert chi_square(observed, expected) < CHI2_BOUND, temperature
        share_of_top.append(observed.count(0) / len(observed))
    assert share_of_top[0] > share_of_top[1] + 0.1 > share_of_top[2] + 0.2


# --------------------------------------------------------------------------- top-k, top-p, min-p


def kept(probs: list[float], n: int = 3000, **options: object) -> set[int]:
    return set(draws(logits_of(probs), n, **options))


@pytest.mark.parametrize(
    ("probs", "options", "expected"),
    [
        (PROBS, {"top_k": 1}, {0}),
        (PROBS, {"top_k": 2}, {0, 1}),
        (PROBS, {"top_k": 100}, {0, 1, 2, 3}),  # more than the vocabulary: no filter
        ([0.4, 0.25, 0.25, 0.1], {"top_k": 2}, {0, 1, 2}),  # ties with the k-th are kept
        (PROBS, {"top_p": 0.79}, {0, 1}),
        (PROBS, {"top_p": 0.81}, {0, 1, 2}),
        (PROBS, {"top_p": 1e-6}, {0}),  # the top token always stays
        (PROBS, {"top_p": 1.0}, {0, 1, 2, 3}),
        ([0.4, 0.2, 0.2, 0.2], {"top_p": 0.5}, {0, 1, 2, 3}),  # prefix {0, 1} reaches 0.5; 2 and 3 tie with 1
        ([0.4, 0.3, 0.2, 0.1], {"top_p": 0.5}, {0, 1}),
        ([0.4, 0.3, 0.2, 0.1], {"top_p": 0.5, "top_k": 2}, {0}),  # top-p sees top-k's renormalised 4/7, 3/7
        (PROBS, {"min_p": 0.35}, {0, 1}),  # keeps p >= 0.175
        (PROBS, {"min_p": 0.2}, {0, 1, 2}),  # keeps p >= 0.1
        (PROBS, {"min_p": 1.0}, {0}),
        ([0.3, 0.3, 0.2, 0.2], {"min_p": 1.0}, {0, 1}),
        (PROBS, {"min_p": 0.5, "temperature": 2.0}, {0, 1, 2}),  # after temperature: sqrt(0.15 / 0.5) = 0.55
        (PROBS, {"min_p": 0.2, "top_k": 2}, {0, 1}),
        (PROBS, {"min_p": 0.35, "top_p": 0.95}, {0, 1}),
    ],
)
def test_filters_keep_the_right_set(probs: list[float], options: dict[str, object], expected: set[int]) -> None:
    assert kept(probs, **options) == expected


def reference_kept(logits: torch.Tensor, row: SamplingRow) -> set[int]:
    """The surviving tokens, computed the slow, obvious way (ties kept by value)."""
    scaled = logits.double() / row.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if row.top_k:
        keep &= scaled >= scaled.sort(descending=True).values[min(row.top_k, len(scaled)) - 1]
    if row.top_p < 1:
        probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), -1)
        order = probs.argsort(descending=True, stable=True)
        mass, last = 0.0, None
        for i in order.tolist():
            last = i
            mass += float(probs[i])
            if mass >= row.top_p:
                break
        keep &= scaled >= scaled[last]
    if row.min_p:
        probs = torch.softmax(scaled, -1)
        keep &= probs >= row.min_p * probs.max()
    return set(torch.nonzero(keep).flatten().tolist())


FILTER_CASES = [
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.7, "top_p": 0.6},
    {"temperature": 1.5, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 1.5, "min_p": 0.2},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.3},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.5, "top_p": 0.6, "min_p": 0.02},
]


@pytest.mark.parametrize("options", FILTER_CASES)
def test_filtered_tokens_are_never_returned(options: dict[str, float]) -> None:
    logits = torch.randn(60, generator=torch.Generator().manual_seed(5)) * 2
    allowed = reference_kept(logits, SamplingRow(**options))  # type: ignore[arg-type]
    seen = set(draws(logits, 1000, **options))
    assert seen <= allowed
    assert len(allowed) < 60  # each case filters something


# --------------------------------------------------------------------------- seeded streams


def test_splitmix_tensor_matches_python_reference() -> None:
    keys = [noise_key(s, t) for s, t in [(0, 0), (1, 0), (0, 1), (2**63 + 5, 7), (-3, 10**6)]]
    signed = torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys])
    uniforms = seeded_uniforms(signed, 50)
    gamma, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    for row, key in enumerate(keys):
        for token in (0, 1, 17, 49):
            bits = mix64((key + (token + 1) * gamma) & mask)
            assert uniforms[row, token].item() == ((bits >> 11) + 0.5) * 2.0**-53
    assert uniforms.min() > 0 and uniforms.max() < 1


def test_same_seed_and_step_give_the_same_token_whatever_the_global_rng() -> None:
    logits = torch.randn(1, 1000)
    rows = [SamplingRow(1.0, seed=42, step=3, top_p=0.95)]
    torch.manual_seed(1)
    first = sample_batch(logits, rows).token_ids
    torch.manual_seed(2)
    torch.rand(100)
    assert sample_batch(logits, rows).token_ids == first


def test_seeded_choice_ignores_batch_composition() -> None:
    generator = torch.Generator().manual_seed(9)
    vocab = 500
    logits = torch.randn(40, vocab, generator=generator) * 2
    rows = [
        SamplingRow(
            temperature=0.8 + 0.05 * (i % 5),
            seed=1000 + i,
            step=i % 7,
            top_k=(0, 10)[i % 2],  # top-k alone takes the topk path when alone, the sort path in the batch
            min_p=(0.0, 0.02)[i % 3 == 0],
            banned=(int(logits[i].argmax()),) if i % 4 == 0 else (),
            repetition_penalty=1.2 if i % 5 == 0 else 1.0,
            prompt_ids=list(range(0, vocab, 11)),
            output_ids=list(range(3, vocab, 13)),
        )
        for i in range(40)
    ]
    alone = [sample_batch(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(40)]
    # interleave greedy, unseeded and top-p neighbours; the seeded rows move to other indices
    others = [SamplingRow(0.0), SamplingRow(1.0), SamplingRow(0.7, top_p=0.5, seed=3, frequency_penalty=1.0)]
    batch_rows, batch_logits, where = [], [], []
    for i in reversed(range(40)):
        other = others[i % 3]
        batch_rows += [other, rows[i]]
        batch_logits += [torch.randn(vocab, generator=generator), logits[i]]
        where.append(len(batch_rows) - 1)
    together = sample_batch(torch.stack(batch_logits), batch_rows).token_ids
    assert [together[where[39 - i]] for i in range(40)] == alone


def test_steps_of_one_seed_follow_the_distribution() -> None:
    logits = logits_of(PROBS).repeat(4000, 1)
    by_step = sample_batch(logits, [SamplingRow(1.0, seed=7, step=s) for s in range(4000)]).token_ids
    by_seed = sample_batch(logits, [SamplingRow(1.0, seed=s, step=5) for s in range(4000)]).token_ids
    other_seed = sample_batch(logits, [SamplingRow(1.0, seed=8, step=s) for s in range(4000)]).token_ids
    assert chi_square(by_step, PROBS) < CHI2_BOUND
    assert chi_square(by_seed, PROBS) < CHI2_BOUND
    # Two independent streams agree with probability sum(p^2) = 0.365 (sd 0.008 over 4000 steps).
    agreement = sum(a == b for a, b in zip(by_step, other_seed, strict=True)) / 4000
    assert abs(agreement - sum(p * p for p in PROBS)) < 0.04


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_those_of_the_raw_logits() -> None:
    logits = torch.randn(6, 300) * 3
    raw = torch.log_softmax(logits, -1)
    rows = [
        SamplingRow(0.0, top_logprobs=0),
        SamplingRow(0.5, top_k=5, top_logprobs=3, seed=1),
        SamplingRow(1.3, top_p=0.8, repetition_penalty=1.5, prompt_ids=[1, 2], top_logprobs=MAX_TOP_LOGPROBS),
        SamplingRow(1.0, top_logprobs=-1),
        SamplingRow(0.0, banned=(int(logits[4].argmax()),), top_logprobs=1),  # chosen is not the top one
        SamplingRow(2.0, min_p=0.1, presence_penalty=1.0, output_ids=[0, 5], top_logprobs=2),
    ]
    out = sample_batch(logits, rows)
    for i, row in enumerate(rows):
        if row.top_logprobs < 0:
            assert out.logprobs[i] is None and out.top_logprobs[i] == []
            continue
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        best = raw[i].topk(row.top_logprobs)
        assert [t for t, _ in out.top_logprobs[i]] == best.indices.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert out.top_logprobs[4][0][0] != out.token_ids[4]
    assert out.logprobs[4] < out.top_logprobs[4][0][1]


def test_top_logprobs_ties_list_lower_ids_first_and_bf16_is_upcast() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]]).bfloat16()
    out = sample_batch(logits, [SamplingRow(0.0, top_logprobs=4)])
    raw = torch.log_softmax(logits.float(), -1)[0]
    assert [t for t, _ in out.top_logprobs[0]] == [1, 3, 2, 4]
    assert out.logprobs[0] == pytest.approx(raw[1].item(), abs=1e-6)


def test_empty_batch() -> None:
    out = sample_batch(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == [] and out.top_logprobs == []


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_p": 1.01},
        {"temperature": 1.0, "top_k": -1},
        {"temperature": 1.0, "min_p": -0.1},
        {"temperature": 1.0, "min_p": 1.1},
        {"temperature": 1.0, "repetition_penalty": 0.0},
        {"temperature": 1.0, "repetition_penalty": -1.0},
        {"temperature": 1.0, "frequency_penalty": math.inf},
        {"temperature": 1.0, "top_logprobs": MAX_TOP_LOGPROBS + 1},
        {"temperature": 1.0, "top_logprobs": -2},
        {"temperature": 1.0, "logit_bias": ((1, math.nan),)},
    ],
)
def test_invalid_options_raise(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingRow(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "logits", [torch.zeros(3, 10), torch.zeros(2, 10, 1), torch.zeros(10), torch.zeros(2, 10, dtype=torch.long)]
)
def test_logits_shape_must_match_rows(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        sample_batch(logits, [SamplingRow(0.0), SamplingRow(1.0)])


# --------------------------------------------------------------------------- CPU / CUDA


@pytest.mark.gpu
@CUDA
def test_seeded_choices_agree_on_cpu_and_cuda() -> None:
    generator = torch.Generator().manual_seed(11)
    vocab, n = 152064, 64
    logits = torch.randn(n, vocab, generator=generator) * 4
    history = list(range(0, vocab, 997))
    rows = [
        SamplingRow(
            temperature=0.0 if i % 8 == 0 else 0.6 + 0.1 * (i % 6),
            seed=i * 31 + 1,
            step=i,
            top_k=(0, 50, 2000)[i % 3],
            top_p=(1.0, 0.9, 0.5, 0.99)[i % 4],
            min_p=(0.0, 0.05)[i % 2],
            repetition_penalty=1.1 if i % 5 == 0 else 1.0,
            frequency_penalty=0.5 if i % 6 == 0 else 0.0,
            banned=(int(logits[i].argmax()),) if i % 7 == 0 else (),
            top_logprobs=i % 4 - 1,
            prompt_ids=history,
            output_ids=history[::3],
        )
        for i in range(n)
    ]
    on_cpu = sample_batch(logits, rows)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = on_cpu if dtype == torch.float32 else sample_batch(logits.to(dtype), rows)
        cuda = sample_batch(logits.to(dtype).cuda(), rows)
        assert cuda.token_ids == cpu.token_ids
        for a, b in zip(cuda.logprobs, cpu.logprobs, strict=True):
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-4))
    unseeded = [SamplingRow(1.0, top_p=0.9, top_logprobs=5)] * n
    out = sample_batch(logits.cuda(), unseeded)
    assert all(0 <= t < vocab for t in out.token_ids) and all(len(t) == 5 for t in out.top_logprobs)
