"""Tensor-parallel decoder ranks: how they find each other, and the step every rank runs.

Rank 0 is the decoder worker (scheduling, sampling, the sockets); ranks 1..w-1 are ``python -m
workers.decoder --rank K`` processes that hold their shard of the model and KV cache and run whatever
step rank 0 broadcasts. Start-up: each rank K sends `TPJoin` to rank 0's ``decoder-tp`` socket; once all
have joined, rank 0 answers `TPSetup` (a rendezvous file named after its own incarnation, so a restarted
rank 0 never meets a stale group, and the KV cache size) and every rank enters the process group (gloo
on CPU, NCCL on GPUs). A rank that dies breaks the group: the others' collectives fail, they exit, and
supervisord starts them again into a new one.

Each step crosses as three tensor broadcasts — a header of sizes, the integers (token ids, media mask,
positions, lengths, block tables, logits rows), the media rows — so no Python object is pickled.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from common.config import Config
from common.protocol import TPJoin, TPSetup
from common.transport import Channel
from workers.models.language import LanguageModel
from workers.models.paged import BatchLayout, FusedLayer, PagedAttention, PagedKVCache, fuse_layers, paged_forward
from workers.models.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

STEP, STOP = 1, 2
HEADER = 6  # kind, tokens, sequences, logits rows, media rows, block-table width


@dataclass
class StepPayload:
    """One forward's inputs, as every rank needs them (sequence after sequence, like `BatchLayout`)."""

    ids: torch.Tensor  # int64 [T]; media placeholder ids where media_mask is set
    media_mask: torch.Tensor  # bool [T]
    media_rows: torch.Tensor  # [M, hidden], M = media_mask.sum()
    positions: torch.Tensor  # int64 [3, T]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    rows: list[int]  # flat token indices whose logits are wanted


def run_step(
    model: LanguageModel,
    kv: PagedKVCache,
    attention: PagedAttention,
    tp: TensorParallel,
    payload: StepPayload,
    fused: Sequence[FusedLayer] | None = None,
) -> torch.Tensor:
    """The forward of one step on this rank; every rank gets the full logits of ``payload.rows``."""
    device = model.device
    embeds = tp.embed(model.embed_tokens.weight, payload.ids.to(device))
    if payload.media_rows.shape[0]:
        embeds[payload.media_mask.to(device)] = payload.media_rows.to(device, embeds.dtype)
    layout = BatchLayout.build(
        payload.query_lens, payload.context_lens, payload.block_tables, kv.block_size, device, kv.num_blocks
    )
    return paged_forward(model, embeds, payload.positions, layout, kv, payload.rows, attention, fused, tp)


class StepBroadcast:
    """Rank 0 sends steps, the other ranks receive them."""

    def __init__(self, tp: TensorParallel, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tp, self.hidden, self.dtype = tp, hidden, dtype
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def send(self, payload: StepPayload) -> None:
        t, s, r, m = payload.ids.shape[0], len(payload.query_lens), len(payload.rows), payload.media_rows.shape[0]
        width = max(len(table) for table in payload.block_tables)
        self._broadcast(torch.tensor([STEP, t, s, r, m, width], dtype=torch.int64))
        tables = [table + [-1] * (width - len(table)) for table in payload.block_tables]
        ints = torch.cat(
            [
                payload.ids.to(torch.int64),
                payload.media_mask.to(torch.int64),
                payload.positions.reshape(-1).to(torch.int64),
                torch.tensor([*payload.query_lens, *payload.context_lens], dtype=torch.int64),
                torch.tensor(tables, dtype=torch.int64).reshape(-1),
                torch.tensor(payload.rows, dtype=torch.int64),
            ]
        )
        self._broadcast(ints)
        if m:
            self._broadcast(payload.media_rows.to(self.dtype))

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.int64))

    def receive(self) -> StepPayload | None:
        header = self._broadcast(torch.empty(HEADER, dtype=torch.int64)).tolist()
        kind, t, s, r, m, width = header
        if kind == STOP:
            return None
        ints = self._broadcast(torch.empty(5 * t + 2 * s + s * width + r, dtype=torch.int64)).cpu()
        ids, mask, positions, lens, tables, rows = ints.split([t, t, 3 * t, 2 * s, s * width, r])
        media = torch.empty((m, self.hidden), dtype=self.dtype)
        if m:
            media = self._broadcast(media)
        table_rows = tables.view(s, width).tolist()
        return StepPayload(
            ids=ids,
            media_mask=mask.bool(),
            media_rows=media,
            positions=positions.view(3, t),
            query_lens=lens[:s].tolist(),
            context_lens=lens[s:].tolist(),
            block_tables=[[b for b in row if b >= 0] for row in table_rows],
            rows=rows.tolist(),
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        dist.broadcast(tensor, src=0, group=self.tp.group)
        return tensor


# --------------------------------------------------------------------------- start-up


def init_group(cfg: Config, store_path: str, rank: int, world: int, device: torch.device) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
    # The ranks share one host: their sockets (gloo's pairs, NCCL's bootstrap) stay on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.decoder.tp_timeout_s),
    )


def leader_rendezvous(cfg: Config, incarnation: str, num_blocks: int, device: torch.device) -> None:
    """Rank 0: wait for every other rank's `TPJoin`, answer each with `TPSetup`, enter the group."""
    world = cfg.decoder.tensor_parallel
    run = cfg.run_path
    for stale in run.glob("tp-*.store"):
        stale.unlink(missing_ok=True)  # groups of earlier incarnations
    store_path = str(run / f"tp-{incarnation}.store")
    ctx = zmq.Context.instance()
    channel = Channel(ctx, zmq.ROUTER, cfg.endpoint("decoder-tp"), bind=True)
    try:
        joined: dict[int, bytes] = {}
        deadline = time.monotonic() + cfg.decoder.tp_timeout_s
        while len(joined) < world - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not channel.sock.poll(int(left * 1000)):
                missing = sorted(set(range(1, world)) - set(joined))
                raise RuntimeError(f"decoder ranks {missing} did not join within {cfg.decoder.tp_timeout_s}s")
            peer, msg = channel.recv()
            if isinstance(msg, TPJoin) and 1 <= msg.rank < world:
                joined[msg.rank] = peer
        for peer in joined.values():
            channel.send_to(peer, TPSetup(store_path, world, num_blocks, incarnation))
    finally:
        channel.close()
    init_group(cfg, store_path, 0, world, device)
    log.info("tensor parallel group of %d ranks formed (%s)", world, store_path)


def follower_rendezvous(cfg: Config, rank: int, incarnation: str, device: torch.device) -> TPSetup:
    """Rank K: announce itself to rank 0, wait for `TPSetup`, enter the group."""
    ctx = zmq.Context.instance()
    channel = Channel(ctx, zmq.DEALER, cfg.endpoint("decoder-tp"), bind=False)
    try:
        channel.send(TPJoin(rank, incarnation))
        deadline = time.monotonic() + cfg.decoder.tp_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not channel.sock.poll(int(left * 1000)):
                raise RuntimeError(f"rank 0 did not answer within {cfg.decoder.tp_timeout_s}s")
            _, msg = channel.recv()
            if isinstance(msg, TPSetup):
                break
    finally:
        channel.close()
    init_group(cfg, msg.store_path, rank, msg.world, device)
    return msg


class DecoderRank:
    """A decoder rank K >= 1: its shard of the model and KV cache, running rank 0's steps until told to stop."""

    def __init__(self, cfg: Config, rank: int) -> None:
        from workers.models.runtime import resolve_device, resolve_dtype
        from workers.models.spec import ModelSpec
        from workers.models.tensor_parallel import load_shard

        incarnation = f"{os.getpid()}-{time.time_ns() % 10**9}"
        self.cfg = cfg
        self.device = resolve_device(cfg, rank)
        spec = ModelSpec.from_dir(cfg.model_path())
        self.tp = TensorParallel(rank, cfg.decoder.tensor_parallel, spec.vocab_size)
        self.model = load_shard(cfg.model_path(), spec, self.tp, self.device, resolve_dtype(cfg, self.device))
        setup = follower_rendezvous(cfg, rank, incarnation, self.device)
        self.kv = PagedKVCache.for_model(self.model, setup.num_blocks, cfg.decoder.block_size)
        self.steps = StepBroadcast(self.tp, spec.hidden_size, self.model.dtype, self.device)
        log.info("decoder rank %d of %d ready on %s (rank 0: %s)", rank, setup.world, self.device, setup.leader)

    def run(self) -> None:
        from workers.kernels import paged_attention, paged_attention_reference

        triton = self.cfg.decoder.kernels == "triton" and self.device.type == "cuda"
        attention = paged_attention if triton else paged_attention_reference  # as rank 0's `runner_options`
        fused = fuse_layers(self.model) if triton else None
        while (payload := self.steps.receive()) is not None:
            run_step(self.model, self.kv, attention, self.tp, payload, fused)
        log.info("rank 0 said stop")
        dist.destroy_process_group()
