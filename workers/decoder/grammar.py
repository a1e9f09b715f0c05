"""Grammar-constrained decoding on the decoder's side: one llguidance matcher per constrained sequence.

The gateway turned the request's output format into a grammar (`SamplingParams.grammar`) and checked that it
compiles. Here:

- `GrammarCompiles` compiles a grammar the process has not seen on a thread, off the worker's step loop,
  holding its requests meanwhile; a compiled matcher is kept per grammar text (`Grammars.store`), and each
  sequence (each of ``n`` choices) takes a deep copy of it when the request is prepared (`Grammars.matcher`,
  from `Scheduler.prepare`), so a grammar is compiled once per process however often it is asked for.
- The matcher lives on the `Sequence`: preemption and re-prefill keep the tokens it has consumed, so it
  resumes where it was.
- `Grammars.bitmask` fills, on the host, the allowed-token bitmask rows of the sequences that sample this
  step (all rows at once on llguidance's thread pool); the sampler applies them on the device
  (`sampling.apply_token_bitmask`). It runs when the step's sampling is launched, which with overlapped steps
  is after the previous step's tokens were read and consumed, so the overlap is kept.
- `Scheduler.postprocess` feeds each sampled token to the matcher; a matcher that has stopped (its grammar
  is complete, or it took an EOS in an accepting state) ends the sequence with finish_reason "stop", whatever
  ``ignore_eos`` says.

The llguidance tokenizer is built once per process from the checkpoint's tokenizer.json, on a background
thread started with the worker (it takes about a second); its vocabulary is the model's, so token ids the
tokenizer does not define (the embedding's padding rows) are always forbidden.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy
import torch

from common.protocol import PreparedRequest
from common.transport import EventLoop, Wakeup
from workers.decoder.sampling import SamplingRow, TokenMask

COMPILED_GRAMMARS = 256  # fresh matchers kept, by grammar text


class GrammarError(ValueError):
    """A grammar the matcher cannot take (the gateway checks grammars first, so this is rare)."""


class Grammars:
    """The process's llguidance tokenizer, its compiled grammars, and the executor that fills bitmasks."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        eos = list(eos_token_ids)
        self._build = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
        self._tokenizer: Future[llguidance.LLTokenizer] = self._build.submit(
            lambda: llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)
        )
        self._build.shutdown(wait=False)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def for_checkpoint(cls, model_dir: Path, vocab_size: int, eos_token_ids: Iterable[int]) -> Grammars | None:
        """None where the checkpoint has no tokenizer.json (constrained requests are then refused)."""
        path = model_dir / "tokenizer.json"
        return cls(path, vocab_size, eos_token_ids) if path.is_file() else None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self._tokenizer.result()

    def is_compiled(self, grammar: str) -> bool:
        return grammar in self._compiled

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """``grammar`` compiled to a fresh matcher; raises `GrammarError`. Touches no cache, so any thread may
        call it (llguidance releases the GIL while it compiles)."""
        fresh = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if fresh.is_error():
            raise GrammarError(f"the grammar does not compile: {fresh.get_error()}")
        return fresh

    def store(self, grammar: str, fresh: llguidance.LLMatcher) -> None:
        """Keep a compiled grammar for the sequences that ask for it (the least recently asked for go first)."""
        self._compiled[grammar] = fresh
        while len(self._compiled) > COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A new matcher of ``grammar`` at its start (compiled here if it is not yet: the worker compiles first,
        off its loop, with `GrammarCompiles`); raises `GrammarError` if the grammar does not compile."""
        if grammar not in self._compiled:
            self.store(grammar, self.compile(grammar))
        self._compiled.move_to_end(grammar)
        return self._compiled[grammar].deep_copy()

    def bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """int32 ``[len(matchers), ceil(vocab / 32)]`` on the host: bit ``t % 32`` of word ``t // 32`` of row i
        is set where ``matchers[i]`` allows token t next."""
        vocab = self.tokenizer.vocab_size
        # Filled through a numpy view of the tensor's memory: llguidance.torch would do the same, but importing it
        # compiles its masking kernel with torch.compile, which loads dynamo and inductor into the process.
        mask = torch.empty(llguidance.numpy.get_bitmask_shape(len(matchers), vocab), dtype=torch.int32)
        words = mask.numpy()
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0], words, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            rows = [(m, i) for i, m in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, words)
        return mask


class GrammarCompiles:
    """Grammars compiled off the worker's step loop. A request whose grammar is not compiled yet waits here while
    a thread compiles it (a large schema takes tens of milliseconds: inline, every running stream would wait that
    long for its next token); the loop gets the request back through ``ready(request, error)``, ``error`` ""
    when the grammar compiled (it is then kept in `Grammars`). Requests asking for a grammar already being
    compiled wait for that compile."""

    def __init__(self, grammars: Grammars, loop: EventLoop, ready: Callable[[PreparedRequest, str], None]) -> None:
        self.grammars, self.ready = grammars, ready
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled = Wakeup(loop, self._on_compiled)
        self._waiting: dict[str, list[PreparedRequest]] = {}  # grammar -> the requests waiting for it

    def needs_compile(self, request: PreparedRequest) -> bool:
        grammar = request.sampling.grammar
        return bool(grammar) and not self.grammars.is_compiled(grammar)

    def wait(self, request: PreparedRequest) -> None:
        """Hold ``request`` until its grammar is compiled (starting the compile if none is under way)."""
        grammar = request.sampling.grammar
        if grammar not in self._waiting:
            self._waiting[grammar] = []
            future = self._pool.submit(self.grammars.compile, grammar)
            future.add_done_callback(lambda done: self._compiled.post((grammar, done)))
        self._waiting[grammar].append(request)

    def holds(self, request_id: str) -> bool:
        return any(r.request_id == request_id for waiting in self._waiting.values() for r in waiting)

    def abort(self, request_id: str) -> None:
        for waiting in self._waiting.values():
            waiting[:] = [r for r in waiting if r.request_id != request_id]

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._waiting.values())

    def _on_compiled(self, item: object) -> None:
        grammar, done = item  # type: ignore[misc]
        error = ""
        try:
            self.grammars.store(grammar, done.result())
        except GrammarError as exc:
            error = str(exc)
        except Exception as exc:  # (a failure inside the library: the requests still get their answer)
            error = f"the grammar could not be compiled: {type(exc).__name__}: {exc}"
        for request in self._waiting.pop(grammar, []):
            self.ready(request, error)


def allows_only(mask_row: torch.Tensor, tokens: Iterable[int]) -> bool:
    """Whether a bitmask row allows no token outside ``tokens`` (e.g. the grammar is complete: only EOS)."""
    rest = mask_row.clone()
    for token in tokens:
        word = token // 32
        if 0 <= word < rest.shape[0]:
            rest[word] &= ~(1 << (token % 32)) if token % 32 < 31 else 0x7FFFFFFF
    return not bool(rest.any())


def consume(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """Feed the sampled ``token`` to the matcher; the matcher's error if it refuses it, else None."""
    if matcher.consume_token(token) and not matcher.is_error():
        return None
    return matcher.get_error() or f"token {token} does not continue the grammar"


def constrain(
    grammars: Grammars | None, matchers: Sequence[llguidance.LLMatcher | None], rows: list[SamplingRow]
) -> tuple[list[SamplingRow], TokenMask | None]:
    """The step's token mask for the rows with a matcher (None: no row has one), and the rows, where a ban
    (the stops below ``min_tokens``) would forbid all the grammar allows, without it: the grammar wins."""
    at = [i for i, m in enumerate(matchers) if m is not None]
    if not at or grammars is None:
        return rows, None
    bitmask = grammars.bitmask([matchers[i] for i in at])  # type: ignore[misc]
    rows = list(rows)
    for j, i in enumerate(at):
        if rows[i].banned and allows_only(bitmask[j], rows[i].banned):
            rows[i] = dataclasses.replace(rows[i], banned=())
    return rows, TokenMask(at, bitmask)
