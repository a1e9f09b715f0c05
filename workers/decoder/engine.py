"""The decoder engine: continuous batching over a paged KV cache with a multimodal prefix cache.

It joins the `Scheduler` (which sequences run, blocks, admission, stops) and the `ModelRunner` (the forward
and its sampling, on the device). One `step()` is schedule -> run -> sample -> postprocess, with one way of
overlapping the host and the device: a step's sampled tokens stay on the device (`Pending`) while the host
schedules and launches the next step, whose decodes take those tokens as input ids, and only then reads them
(stops, finishes, `TokenDelta`s). Without ``overlap`` the same step reads its tokens at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.protocol import PreparedRequest, TokenDelta
from workers.decoder.batch import Scheduled, Sequence
from workers.decoder.config import EngineConfig
from workers.decoder.grammar import Grammars
from workers.decoder.runner import ModelRunner
from workers.decoder.sampling import SampleFuture
from workers.decoder.scheduler import Scheduler
from workers.decoder.tp import StepBroadcast
from workers.models.language import LanguageModel
from workers.models.runtime import upload
from workers.models.spec import ModelSpec

COUNTERS = (
    "prompt_tokens",
    "generated_tokens",
    "requests_finished",
    "preemptions",
    "steps",
    "graph_steps",  # of which steps replayed a graph (decode or mixed)
    "overlapped_steps",  # of which steps were staged while the previous one ran
    "overlapped_mixed_steps",  # of those, steps that also carried prefill chunks or arrivals
    "decode_graph_steps",  # of which steps replayed a decode graph
    "decode_launch_s",  # host time building and launching those steps' forwards
    "other_launch_s",  # and every other step's (prefill chunks, mixed or eager)
    "token_wait_s",  # host time blocked on a step's sampled tokens (near none: the host, not the device, paces)
    "grammar_rows",  # constrained rows sampled (each a grammar bitmask filled on the host)
    "grammar_fill_s",  # host time filling those bitmasks
)


@dataclass
class Pending:
    """A step whose forward and sampling are launched but whose tokens the host has not read: its sequences
    are already advanced (their KV is computed), their new tokens not yet appended. Row i is ``seqs[i]``'s."""

    seqs: list[Sequence]
    sampled: SampleFuture


class Engine:
    def __init__(
        self,
        model: LanguageModel,
        spec: ModelSpec,
        config: EngineConfig,
        tp_steps: StepBroadcast | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``tp_steps``: rank 0 of a tensor-parallel group (each step is broadcast to the other ranks).
        ``grammars``: for structured outputs (None: constrained requests are refused)."""
        self.config = config
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.scheduler = Scheduler(config, spec, self.counters, grammars)
        self.runner = ModelRunner(model, spec, config, self.counters, tp_steps, grammars)
        self.pending: Pending | None = None

    def prepare(self, request: PreparedRequest) -> Sequence:
        return self.scheduler.prepare(request)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def holds(self, request_id: str) -> bool:
        return self.scheduler.holds(request_id)

    def take_failed(self) -> list[tuple[str, str]]:
        """Requests ended by an error since the last call (a matcher refused a token): id and why."""
        return self.scheduler.take_failed()

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.pending)

    # ------------------------------------------------------------------ the step loop
    def step(self) -> list[TokenDelta]:
        """One step; returns the tokens it made known.

        With a step pending, the next one is scheduled beside it (`Scheduler.schedule_ahead`) and launched
        before the host waits for the pending tokens; the host then reads them (stop checks, finishes) while
        the device computes, drops the rows of sequences that finished on them, and launches the new step's
        sampling. Where the next step must wait for the tokens (blocks short, nothing else to run) they are
        read first and the step is scheduled as usual."""
        batch, carried = self.scheduler.schedule_ahead(self.pending.seqs) if self.pending else ([], [])
        deltas: list[TokenDelta] = []
        if batch:
            self.counters["overlapped_steps"] += 1
            self.counters["overlapped_mixed_steps"] += len(batch) > len(carried)
        else:
            deltas = self._read_pending()
            batch = self.scheduler.schedule()
            if not batch:
                return deltas
        logits = self.runner.run(batch, self._carried_ids(carried))
        deltas += self._read_pending()  # (the device runs the new step meanwhile)
        self._launch_sampling(batch, logits)
        if not self.config.overlap:
            deltas += self._read_pending()
        return deltas

    def _carried_ids(self, carried: list[int]) -> torch.Tensor | None:
        """The pending step's sampled ids (on the device) of its ``carried`` rows: the input ids of those
        sequences' decodes in the next step."""
        if not carried or self.pending is None:
            return None
        ids = self.pending.sampled.tokens
        if len(carried) < len(self.pending.seqs):
            ids = ids.index_select(0, upload(torch.tensor(carried, dtype=torch.int64), ids.device))
        return ids

    def _launch_sampling(self, batch: list[Scheduled], logits: torch.Tensor) -> None:
        """Advance the sequences and launch the sampling of those still running (a sequence that finished on
        the token just read has its row dropped); ``logits`` has a row for each item that samples, in order."""
        sampling = [item for item in batch if item.samples]  # (before the sequences advance)
        rows = [i for i, item in enumerate(sampling) if self.scheduler.is_running(item.seq)]
        self.scheduler.advance([item for item in batch if self.scheduler.is_running(item.seq)])
        if len(rows) < len(sampling):  # (not a blocking copy: it would wait for the step just launched)
            logits = logits.index_select(0, upload(torch.tensor(rows, dtype=torch.int64), logits.device))
        live = [sampling[i] for i in rows]
        self.pending = Pending([item.seq for item in live], self.runner.sample(live, logits)) if live else None

    def _read_pending(self) -> list[TokenDelta]:
        """Read the pending step's tokens and emit them (sequences aborted meanwhile are skipped)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        started = time.perf_counter()
        sampled = pending.sampled.result()
        self.counters["token_wait_s"] += time.perf_counter() - started
        return self.scheduler.postprocess(pending.seqs, sampled)

    # ------------------------------------------------------------------ reports
    def stats(self) -> dict[str, float]:
        blocks = self.scheduler.blocks
        used = blocks.num_blocks - blocks.num_free_blocks()
        return {
            **self.counters,
            **blocks.counters,
            "kv_blocks_capacity": float(blocks.num_blocks),
            "kv_blocks_used": float(used),
            "kv_usage": used / max(1, blocks.num_blocks),
        }
