"""Choosing the next token for every sequence of a decode step in one batched pass.

``sample_batch(logits, rows)`` takes the ``[batch, vocab]`` logits of the sequences that sample
this step and one ``SamplingRow`` each. All tensor work stays on the logits' device; Python loops
run over the batch only, to build small index and parameter tensors, and the results come back
in one device-to-host copy.

Per row, in this order:

0. a grammar's allowed-token bitmask, for the rows that have one (structured outputs): forbidden tokens to
   -inf, on the device, in a copy of the logits; rows without one are copied unchanged, and with no
   constrained row the logits are not touched at all;
1. penalties on the raw logits: repetition (HF/vLLM: ``l > 0 ? l / p : l * p`` over prompt and
   generated tokens), then frequency and presence (OpenAI: ``l -= f * count``, ``l -= p * (count > 0)``
   over generated tokens only) — the order and arithmetic of vLLM, in float32;
2. ``logit_bias`` added (OpenAI's: a value per token id, e.g. -100 to all but forbid it);
3. ``banned`` tokens set to -inf;
4. greedy rows (temperature < ``GREEDY_BELOW``) take the argmax, the lowest id among ties;
5. other rows: ``logits / temperature``, then top-k, top-p (on the distribution left by top-k) and
   min-p, then one draw by the Gumbel-max trick.

Filters act as a per-row *cutoff value*: a token survives if its scaled logit is >= the cutoff.
Hence ties at a boundary are all kept (top_k=2 over logits [3, 2, 2] keeps three tokens; top_p
keeps every token tied with the last one its prefix needs), so the kept set never depends on how
a sort orders equal values. Top-p keeps the smallest most-probable prefix whose mass reaches
``top_p`` — at least the top token. Min-p keeps ``p >= min_p * p_max``, which is
``l >= l_max + log(min_p)``: a ratio unaffected by the renormalisation after top-k/top-p.

Randomness. A row with a ``seed`` draws from counter-based noise: each token's Gumbel noise is a
SplitMix64 hash of (seed, step, token id) computed with int64 tensor arithmetic, so its choice does
not depend on the other rows, on its place in the batch, on the torch RNG or on the device: the
hash is bit-exact on CPU and CUDA, and the noise is added in float64, so CPU and CUDA agree unless
two candidates tie to ~1e-15 or the float32 softmax/cumsum of top-p rounds differently at the exact
top-p boundary. Rows without a seed use the global torch RNG of the logits' device. (float64
excludes Apple MPS, which is not a target.)

Logprobs are those of the model's raw distribution — ``log_softmax`` in float32 of the logits as
given, before penalties, bans, temperature and filters — as vLLM reports by default. For a constrained row
that distribution is taken after its grammar mask (the tokens the grammar allows, renormalised), as vLLM's are:
it applies the bitmask to the logits before its sampler reads them. If every token
of a row is banned, the row's result is token 0 (no error: detecting it would need a device sync).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams
from workers.models.runtime import upload

GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20
# Past this many candidates one full sort costs about what topk does.
TOPK_SORT_ABOVE = 1024

# --------------------------------------------------------------------------- the request side


@dataclass(frozen=True)
class SamplingRow:
    """One sequence's options and history for this step; constructing it validates the options."""

    temperature: float  # < GREEDY_BELOW: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # [0, 1]
    presence_penalty: float = 0.0  # over generated tokens only
    frequency_penalty: float = 0.0  # over generated tokens only
    repetition_penalty: float = 1.0  # over prompt + generated tokens
    seed: int | None = None  # same seed + same history => same token, whatever else is in the batch
    step: int = 0  # index of the token being sampled within this sequence's output
    banned: tuple[int, ...] = ()  # e.g. EOS/stop ids before min_tokens; ids outside the vocabulary are ignored
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); ids outside are ignored
    top_logprobs: int = -1  # -1: none; 0: the chosen token's only; k > 0: also the k most likely
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        # `not (x >= lo)` rather than `x < lo` so that NaN is rejected too.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not all(math.isfinite(bias) for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be finite")
        if not -1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must lie in [-1, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sampling_row(
    params: SamplingParams, prompt_ids: list[int], output_ids: list[int], banned: Sequence[int] = ()
) -> SamplingRow:
    """One sequence's options and history for this step; raises ValueError on bad options."""
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seed=params.seed,
        step=len(output_ids),
        banned=tuple(banned),
        logit_bias=tuple(zip(params.logit_bias_ids, params.logit_bias_values, strict=True)),
        top_logprobs=params.top_logprobs,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def stop_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The tokens that end a sequence: its stop ids, and the model's EOS unless ``ignore_eos``."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    return stops


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's raw logprob; None where top_logprobs == -1
    top_logprobs: list[list[tuple[int, float]]]  # per row, most likely first (lower id first on ties)


# --------------------------------------------------------------------------- counter-based noise

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's stream increment
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed64(x: int) -> int:
    """The int64 with the same bits, since torch takes no Python int >= 2**63."""
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (the reference the tensor version must match)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _MUL1) & _M64
    x = ((x ^ (x >> 27)) * _MUL2) & _M64
    return x ^ (x >> 31)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """``mix64`` in place on int64 bits: multiplication wraps mod 2**64 on CPU and CUDA alike, and
    ``>>`` is arithmetic on int64, so each shift is masked into a logical one."""
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        z ^= (z >> shift) & ((1 << (64 - shift)) - 1)
        if mul is not None:
            z *= _signed64(mul)
    return z


def noise_key(seed: int, step: int) -> int:
    """The key of one (seed, step) stream; a stream's token noise is ``mix64(key + (id + 1) * GAMMA)``.
    Two keys are both hashes, so their streams overlap only with probability ~vocab / 2**64."""
    return mix64(mix64(seed + _GAMMA) + (step + 1) * _GAMMA)


def seeded_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[len(keys), vocab]`` float64 uniforms in (0, 1), never 0 or 1, from int64 ``keys``."""
    offsets = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _signed64(_GAMMA)
    bits = _mix64_(keys[:, None] + offsets)
    top53 = (bits >> 11) & ((1 << 53) - 1)
    return top53.to(torch.float64).add_(0.5).mul_(2.0**-53)


def _gumbel(keys: list[int], unseeded: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel noise, float64: the seeded rows' (hashed) first, then ``unseeded`` rows from the torch RNG."""
    exponentials = []  # Exp(1) draws; Gumbel = -log(Exp(1))
    if keys:
        key_t = upload(torch.tensor([_signed64(k) for k in keys], dtype=torch.int64), device)
        exponentials.append(seeded_uniforms(key_t, vocab).log_().neg_())
    if unseeded:
        draws = torch.empty(unseeded, vocab, dtype=torch.float64, device=device).exponential_()
        exponentials.append(draws.clamp_min_(torch.finfo(torch.float64).tiny))  # a 0 would give +inf noise
    noise = exponentials[0] if len(exponentials) == 1 else torch.cat(exponentials)
    return noise.log_().neg_()


# --------------------------------------------------------------------------- penalties and bans


def _pairs(columns: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[len(columns), n]`` int64 on ``device`` (row, token, ...), dropping tokens outside the vocabulary."""
    if not columns[0]:
        return None
    table = torch.tensor(columns, dtype=torch.int64)
    tokens = table[1]
    table = table[:, (tokens >= 0) & (tokens < vocab)]  # filtered here, on the CPU, to avoid a device sync
    return upload(table, device) if table.shape[1] else None


def _needs_changes(rows: Sequence[SamplingRow]) -> bool:
    return any(
        r.banned
        or r.logit_bias
        or (r.repetition_penalty != 1.0 and (r.prompt_ids or r.output_ids))
        or ((r.frequency_penalty or r.presence_penalty) and r.output_ids)
        for r in rows
    )


def _apply_repetition(scores: torch.Tensor, rows: Sequence[SamplingRow], factors: torch.Tensor) -> None:
    rows_col: list[int] = []
    tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.repetition_penalty != 1.0:
            seen = set(row.prompt_ids)
            seen.update(row.output_ids)
            tokens.extend(seen)
            rows_col.extend([i] * len(seen))
    pairs = _pairs([rows_col, tokens], scores.shape[1], scores.device)
    if pairs is None:
        return
    r, t = pairs
    values, factor = scores[r, t], factors[r]
    scores[r, t] = torch.where(values > 0, values / factor, values * factor)


def _apply_frequency_presence(
    scores: torch.Tensor, rows: Sequence[SamplingRow], frequency: torch.Tensor, presence: torch.Tensor
) -> None:
    rows_col: list[int] = []
    tokens: list[int] = []
    counts: list[int] = []
    for i, row in enumerate(rows):
        if (row.frequency_penalty or row.presence_penalty) and row.output_ids:
            counted = Counter(row.output_ids)  # unique tokens, so each is written once below
            tokens.extend(counted.keys())
            counts.extend(counted.values())
            rows_col.extend([i] * len(counted))
    table = _pairs([rows_col, tokens, counts], scores.shape[1], scores.device)
    if table is None:
        return
    r, t, c = table
    # Two subtractions, as vLLM does them: l - f * count, then - p for every token present.
    scores[r, t] = scores[r, t] - frequency[r] * c.to(scores.dtype) - presence[r]


def _apply_logit_bias(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    pairs = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.logit_bias]
    if not pairs:
        return
    index = torch.tensor([[i for i, _, _ in pairs], [t for _, t, _ in pairs]], dtype=torch.int64)
    bias = torch.tensor([b for _, _, b in pairs], dtype=torch.float32)
    inside = (index[1] >= 0) & (index[1] < scores.shape[1])  # on the CPU, so no device sync
    if bool(inside.any()):
        r, t = upload(index[:, inside], scores.device)
        # accumulate: a token named twice gets both biases, in any order, the same sum
        scores.index_put_((r, t), upload(bias[inside], scores.device), accumulate=True)


def _apply_bans(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    rows_col = [i for i, row in enumerate(rows) for _ in row.banned]
    tokens = [t for row in rows for t in row.banned]
    pairs = _pairs([rows_col, tokens], scores.shape[1], scores.device)
    if pairs is not None:
        scores[pairs[0], pairs[1]] = float("-inf")


def _adjust_(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalties, logit biases, then bans, in place on float32 ``scores`` (row i belongs to ``rows[i]``)."""
    if any(r.repetition_penalty != 1.0 or r.frequency_penalty or r.presence_penalty for r in rows):
        params = torch.tensor(
            [[r.repetition_penalty, r.frequency_penalty, r.presence_penalty] for r in rows], dtype=torch.float32
        )
        params = upload(params, scores.device)
        _apply_repetition(scores, rows, params[:, 0])
        _apply_frequency_presence(scores, rows, params[:, 1], params[:, 2])
    _apply_logit_bias(scores, rows)
    _apply_bans(scores, rows)


# --------------------------------------------------------------------------- filters and the draw


def _kth_largest(descending: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per row the k-th value of ``descending`` (-inf where k == 0, i.e. top-k is off)."""
    index = top_k.clamp(1, descending.shape[1]).sub(1).unsqueeze(1)
    kth = descending.gather(1, index).squeeze(1)
    return torch.where(top_k > 0, kth, float("-inf"))


def _top_p_cutoff(descending: torch.Tensor, top_k_cutoff: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Per row the smallest value in the shortest prefix (of what top-k left) whose mass reaches top_p."""
    kept = descending if top_k_cutoff is None else descending.masked_fill(descending < top_k_cutoff[:, None], -math.inf)
    probs = kept.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # mass_before[0] == 0 < top_p, so the top token is always kept; top_p == 1 is passed as 2 (keep all),
    # lest cumsum rounding past 1 drop the tail. A masked min, not a count, as cumsum need not be monotone.
    in_prefix = mass_before < top_p[:, None]
    return torch.where(in_prefix, descending, math.inf).amin(dim=-1)


def _cutoffs(scaled: torch.Tensor, rows: Sequence[SamplingRow], params: torch.Tensor) -> torch.Tensor | None:
    """Per row the lowest scaled logit that survives top-k, top-p and min-p (None: nothing filtered)."""
    top_k, top_p, log_min_p = params[:, 1].long(), params[:, 2], params[:, 3]
    max_k = max(min(r.top_k, scaled.shape[1]) for r in rows)
    any_p = any(r.top_p < 1.0 for r in rows)
    cutoffs: list[torch.Tensor] = []
    if any_p or max_k > TOPK_SORT_ABOVE:
        descending = scaled.sort(dim=-1, descending=True).values
        top_k_cutoff = _kth_largest(descending, top_k) if max_k else None
        if any_p:
            cutoffs.append(_top_p_cutoff(descending, top_k_cutoff, top_p))
        if top_k_cutoff is not None:
            cutoffs.append(top_k_cutoff)
    elif max_k:
        cutoffs.append(_kth_largest(scaled.topk(max_k, dim=-1).values, top_k))
    if any(r.min_p > 0 for r in rows):
        cutoffs.append(scaled.amax(dim=-1) + log_min_p)
    if not cutoffs:
        return None
    result = cutoffs[0]
    for c in cutoffs[1:]:
        result = torch.maximum(result, c)
    return result


def _draw(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row by Gumbel-max; ``rows`` has the seeded rows first."""
    params = torch.tensor(
        [
            [
                r.temperature,
                min(r.top_k, scores.shape[1]),
                r.top_p if r.top_p < 1.0 else 2.0,
                math.log(r.min_p) if r.min_p > 0 else -math.inf,
            ]
            for r in rows
        ],
        dtype=torch.float32,
    )
    params = upload(params, scores.device)
    scaled = scores / params[:, :1]  # promotes bf16/fp16 to float32, as vLLM divides in float32
    if scaled.dtype != torch.float32:
        scaled = scaled.float()
    cutoff = _cutoffs(scaled, rows, params)
    keys = [noise_key(r.seed, r.step) for r in rows if r.seed is not None]
    perturbed = _gumbel(keys, len(rows) - len(keys), scores.shape[1], scores.device).add_(scaled)
    if cutoff is not None:
        perturbed.masked_fill_(scaled < cutoff[:, None], -math.inf)
    return perturbed.argmax(dim=-1)


# --------------------------------------------------------------------------- the batch


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(ids, dtype=torch.int64), device)


def _choose(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Token ids ``[batch]`` on the logits' device."""
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    seeded = [i for i, r in enumerate(rows) if not r.greedy and r.seed is not None]
    unseeded = [i for i, r in enumerate(rows) if not r.greedy and r.seed is None]
    # Rows regrouped (greedy, seeded, unseeded) so that each group is a contiguous slice of one copy.
    order = greedy + seeded + unseeded
    identity = order == list(range(len(rows)))
    order_t = None if identity else _index(order, logits.device)
    ordered_rows = [rows[i] for i in order]
    if _needs_changes(rows):
        scores = logits.to(torch.float32, copy=True) if order_t is None else logits.index_select(0, order_t).float()
        _adjust_(scores, ordered_rows)
    else:
        scores = logits if order_t is None else logits.index_select(0, order_t)  # read only from here on
    parts = []
    if greedy:
        parts.append(scores[: len(greedy)].argmax(dim=-1))  # argmax returns the first maximal index
    if seeded or unseeded:
        parts.append(_draw(scores[len(greedy) :], ordered_rows[len(greedy) :]))
    chosen = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order_t is None:
        return chosen
    return torch.empty_like(chosen).index_copy_(0, order_t, chosen)


def _logprob_table(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int], top: int) -> torch.Tensor:
    """``[len(wanted), 1 + 2 * top]`` float64: chosen logprob, ``top`` best logprobs, their ids."""
    if len(wanted) == logits.shape[0]:
        raw, chosen = logits, tokens
    else:
        index = _index(wanted, logits.device)
        raw, chosen = logits.index_select(0, index), tokens.index_select(0, index)
    logprobs = torch.log_softmax(raw, dim=-1, dtype=torch.float32)
    columns = [logprobs.gather(1, chosen.unsqueeze(1))]
    if top:
        best = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        columns += [best.values, best.indices.to(torch.float32)]  # ids < 2**24 are exact in float32
    return torch.cat(columns, dim=1).double()


@dataclass
class TokenMask:
    """The allowed tokens of some rows of a batch: ``bitmask`` (int32 ``[len(rows), words]``, on the host) has
    bit ``t % 32`` of word ``t // 32`` set where token t is allowed; tokens past ``32 * words`` are forbidden."""

    rows: list[int]
    bitmask: torch.Tensor


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """A copy of ``logits`` with the tokens ``mask`` forbids at -inf in its rows (the other rows unchanged)."""
    vocab = logits.shape[1]
    words = upload(mask.bitmask, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbidden = ~allowed[:, :vocab]
    if mask.rows == list(range(logits.shape[0])):
        return logits.masked_fill(forbidden, float("-inf"))
    index = _index(mask.rows, logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))


def sample_batch(logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None) -> Sampled:
    """The next token of each row of ``logits`` ``[batch, vocab]`` under ``rows[i]``; see the module doc."""
    return sample_async(logits, rows, mask).result()


def sample_async(logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None) -> SampleFuture:
    """`sample_batch` launched on the device; the host waits only when the result is read."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [{len(rows)}, vocab] tensor, got {tuple(logits.shape)}")
    if mask is not None and mask.rows:
        logits = apply_token_bitmask(logits, mask)
    if not rows:
        return SampleFuture(torch.empty(0, dtype=torch.int64, device=logits.device), rows, [])
    tokens = _choose(logits, rows)
    wanted = [i for i, r in enumerate(rows) if r.top_logprobs >= 0]
    if not wanted:
        return SampleFuture(tokens, rows, wanted)
    top = max(rows[i].top_logprobs for i in wanted)
    return SampleFuture(tokens, rows, wanted, _logprob_table(logits, tokens, wanted, top))


class SampleFuture:
    """Sampled ids on the device (``tokens``, e.g. the next step's input) and their copy on its way to the
    host: one asynchronous device-to-host copy, waited for by `result`."""

    def __init__(
        self,
        tokens: torch.Tensor,
        rows: Sequence[SamplingRow],
        wanted: list[int],
        table: torch.Tensor | None = None,
    ) -> None:
        self.tokens = tokens
        self.rows, self.wanted = rows, wanted
        flat = tokens if table is None else torch.cat([tokens.double(), table.flatten()])
        self.event: torch.cuda.Event | None = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat

    def result(self) -> Sampled:
        if self.event is not None:
            self.event.synchronize()
        flat = self.host.tolist()
        n, rows = len(self.rows), self.rows
        token_ids = [int(t) for t in flat[:n]]
        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        width = (len(flat) - n) // len(self.wanted) if self.wanted else 0  # 1 + 2 * top (capped by the vocab)
        width_top = (width - 1) // 2
        for j, i in enumerate(self.wanted):
            line = flat[n + j * width : n + (j + 1) * width]
            logprobs[i] = line[0]
            k = min(rows[i].top_logprobs, width_top)
            pairs = zip(line[1 + width_top : 1 + width_top + k], line[1 : 1 + k], strict=True)
            # topk's order among equal values is unspecified; lower id first makes it deterministic.
            tops[i] = sorted(((int(t), v) for t, v in pairs), key=lambda p: (-p[1], p[0]))
        return Sampled(token_ids, logprobs, tops)
