"""Tensor-parallel decoder ranks: how they find each other, and the step every rank runs.

Rank 0 is the decoder worker (scheduling, sampling, the sockets); ranks 1..w-1 are ``python -m
workers.decoder --rank K`` processes that hold their shard of the model and KV cache and run whatever
step rank 0 broadcasts. Start-up: each rank K sends `TPJoin` to rank 0's ``decoder-tp`` socket; once all
have joined, rank 0 answers `TPSetup` (a rendezvous file named after its own incarnation, so a restarted
rank 0 never meets a stale group, and the KV cache size) and every rank enters the process group (gloo
on CPU, NCCL on GPUs). A rank that dies breaks the group: the others' collectives fail, they exit, and
supervisord starts them again into a new one.

Each step crosses as up to four tensor broadcasts — a header of sizes, the integers (token ids, media mask,
positions, lengths, block tables, logits rows), the media rows, their DeepStack sets (Qwen3-VL) — so no Python
object is pickled.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from common.config import Config, decoder_hub, decoder_name
from common.protocol import TPJoin, TPSetup
from common.topology import vision_replicas
from common.transport import Transport
from workers.decoder.config import EngineConfig
from workers.decoder.graphs import StepGraphs, StepInputs, engine_graphs
from workers.models.language import LanguageModel
from workers.models.paged import (
    BatchLayout,
    FusedLayer,
    PagedAttention,
    PagedKVCache,
    StepDeepStack,
    fuse_layers,
    kv_cache_dtype,
    paged_forward,
)
from workers.models.registry import read_spec
from workers.models.runtime import claim_device, resolve_dtype, upload
from workers.models.tensor_parallel import TensorParallel, load_shard

log = logging.getLogger(__name__)

STEP, STOP = 1, 2
# kind, mode, tokens, sequences, logits rows, media rows, block-table width, device ids that follow, DeepStack sets
HEADER = 9


EAGER, DECODE_GRAPH, MIXED_GRAPH = 0, 1, 2  # how a step runs: every rank takes the same path


@dataclass
class StepPayload:
    """One forward's inputs, as every rank needs them (sequence after sequence, like `BatchLayout`)."""

    mode: int  # EAGER, DECODE_GRAPH or MIXED_GRAPH
    ids: torch.Tensor  # int64 [T]; media placeholder ids where media_mask is set
    media_mask: torch.Tensor  # bool [T]
    media_rows: torch.Tensor  # [M, hidden], M = media_mask.sum()
    positions: torch.Tensor  # int64 [3, T]
    slots: torch.Tensor  # int64 [T]: where each token's k/v goes
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    rows: list[int]  # flat token indices whose logits are wanted (a decode graph gives every row)
    # A step staged before rank 0 read the input ids of its first rows (decodes, one token each: overlap):
    # those ids follow as a device tensor (zeros stand in for them in ``ids``).
    device_ids: torch.Tensor | None = None
    # [K, M, hidden]: the DeepStack sets of the media rows (Qwen3-VL), set k added after decoder layer k; None
    # where the step has no media rows or the model no DeepStack
    deepstack: torch.Tensor | None = None

    def step_deepstack(self, device: torch.device) -> StepDeepStack | None:
        """The DeepStack input `paged_forward` takes: the media rows' flat indices and their sets."""
        if self.deepstack is None or not self.media_rows.shape[0]:
            return None
        return StepDeepStack(self.media_mask.nonzero().squeeze(1).to(device), self.deepstack.to(device))

    def step_inputs(self) -> StepInputs:
        return StepInputs(
            self.positions.numpy(), self.slots.numpy(), self.query_lens, self.context_lens, self.block_tables, self.rows
        )


@dataclass
class RankForward:
    """What one rank runs for a step: its shard of the model and cache, and its graphs if any."""

    model: LanguageModel
    kv: PagedKVCache
    attention: PagedAttention
    tp: TensorParallel
    fused: Sequence[FusedLayer] | None = None
    graphs: StepGraphs | None = None

    def __call__(self, payload: StepPayload) -> torch.Tensor:
        """The logits of ``payload.rows`` (of every row for a decode graph), the same on every rank."""
        if payload.mode == DECODE_GRAPH:
            assert self.graphs is not None  # rank 0 picks a graph mode only when it has graphs, as we do
            return self.graphs.decode(payload.step_inputs(), payload.ids.tolist(), payload.device_ids)
        device = self.model.device
        ids = upload(payload.ids, device)  # (a plain copy would wait for the step before: overlap)
        if payload.device_ids is not None:
            ids = torch.cat([payload.device_ids.to(device), ids[payload.device_ids.shape[0] :]])
        embeds = self.tp.embed(self.model.embed_tokens.weight, ids)
        if payload.media_rows.shape[0]:
            embeds[payload.media_mask.to(device)] = payload.media_rows.to(device, embeds.dtype)
        deepstack = payload.step_deepstack(device)
        if payload.mode == MIXED_GRAPH:
            assert self.graphs is not None
            return self.graphs.mixed(payload.step_inputs(), embeds, deepstack)
        kv = self.kv
        layout = BatchLayout.build(
            payload.query_lens, payload.context_lens, payload.block_tables, kv.block_size, device, kv.num_blocks
        )
        return paged_forward(
            self.model,
            embeds,
            payload.positions,
            layout,
            kv,
            payload.rows,
            self.attention,
            self.fused,
            self.tp,
            deepstack,
        )


class StepBroadcast:
    """Rank 0 sends steps, the other ranks receive them."""

    def __init__(self, tp: TensorParallel, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tp, self.hidden, self.dtype = tp, hidden, dtype
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def send(self, payload: StepPayload) -> None:
        t, s, r, m = payload.ids.shape[0], len(payload.query_lens), len(payload.rows), payload.media_rows.shape[0]
        width = max(len(table) for table in payload.block_tables)
        follow = 0 if payload.device_ids is None else payload.device_ids.shape[0]
        deepstack = payload.deepstack if m else None
        sets = 0 if deepstack is None else deepstack.shape[0]
        self._broadcast(torch.tensor([STEP, payload.mode, t, s, r, m, width, follow, sets], dtype=torch.int64))
        tables = [table + [-1] * (width - len(table)) for table in payload.block_tables]
        ints = torch.cat(
            [
                payload.ids.to(torch.int64),
                payload.media_mask.to(torch.int64),
                payload.positions.reshape(-1).to(torch.int64),
                payload.slots.to(torch.int64),
                torch.tensor([*payload.query_lens, *payload.context_lens], dtype=torch.int64),
                torch.tensor(tables, dtype=torch.int64).reshape(-1),
                torch.tensor(payload.rows, dtype=torch.int64),
            ]
        )
        self._broadcast(ints)
        if m:
            self._broadcast(payload.media_rows.to(self.dtype))
        if deepstack is not None:
            self._broadcast(deepstack.to(self.dtype))
        if payload.device_ids is not None:
            self._broadcast(payload.device_ids)  # in stream order after the sampling that makes them

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64))

    def receive(self) -> StepPayload | None:
        header = self._broadcast(torch.empty(HEADER, dtype=torch.int64)).tolist()
        kind, mode, t, s, r, m, width, follow, sets = header
        if kind == STOP:
            return None
        ints = self._broadcast(torch.empty(6 * t + 2 * s + s * width + r, dtype=torch.int64)).cpu()
        ids, mask, positions, slots, lens, tables, rows = ints.split([t, t, 3 * t, t, 2 * s, s * width, r])
        media = torch.empty((m, self.hidden), dtype=self.dtype)
        if m:
            media = self._broadcast(media)
        deepstack = self._broadcast(torch.empty((sets, m, self.hidden), dtype=self.dtype)) if sets else None
        table_rows = tables.view(s, width).tolist()
        device_ids = self._broadcast(torch.empty(follow, dtype=torch.int64)) if follow else None
        return StepPayload(
            device_ids=device_ids,
            mode=mode,
            ids=ids,
            media_mask=mask.bool(),
            media_rows=media,
            positions=positions.view(3, t),
            slots=slots,
            query_lens=lens[:s].tolist(),
            context_lens=lens[s:].tolist(),
            block_tables=[[b for b in row if b >= 0] for row in table_rows],
            rows=rows.tolist(),
            deepstack=deepstack,
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        # Contiguous: gloo reads the storage from the first element on, so a strided view (such as one item's rows
        # of every DeepStack set) would cross as the wrong rows.
        tensor = tensor.to(self.device).contiguous()
        dist.broadcast(tensor, src=0, group=self.tp.group)
        return tensor


# --------------------------------------------------------------------------- start-up


def init_group(cfg: Config, store_path: str, rank: int, world: int, device: torch.device) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
    # The ranks share one host: their sockets (gloo's pairs, NCCL's bootstrap) stay on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    if device.type == "cuda":
        # NCCL puts a rank's communicator on the *current* device: without this every rank but 0 would
        # sit on cuda:0 beside rank 0 (NCCL refuses two ranks on one GPU). device_id also makes the
        # communicator now, not at the first collective, which may come inside a CUDA graph capture.
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.decoder.tp_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def leader_rendezvous(cfg: Config, replica: int, incarnation: str, num_blocks: int, device: torch.device) -> None:
    """Rank 0 of ``replica``: wait for every other rank's `TPJoin`, answer each with `TPSetup`, enter the
    group."""
    world = cfg.decoder.tensor_parallel
    run, name = cfg.run_path, decoder_name(replica)
    # Groups of this replica's earlier incarnations, not the other replicas' ("tp-decoder.*" is not a prefix
    # of "tp-decoder-1.*"; an incarnation has no dot).
    for stale in run.glob(f"tp-{name}.*.store"):
        stale.unlink(missing_ok=True)
    store_path = str(run / f"tp-{name}.{incarnation}.store")
    transport = Transport(cfg, "decoder")
    channel = transport.channel(zmq.ROUTER, decoder_hub(replica, "decoder-tp"), bind=True)
    try:
        joined: dict[int, bytes] = {}
        deadline = time.monotonic() + cfg.decoder.tp_timeout_s
        while len(joined) < world - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not channel.sock.poll(int(left * 1000)):
                missing = sorted(set(range(1, world)) - set(joined))
                raise RuntimeError(
                    f"decoder ranks {missing} did not join within {cfg.decoder.tp_timeout_s}s: each runs as "
                    "`python -m workers.decoder --rank K`, which the supervisord config that ./ops/serve renders "
                    "(python -m ops.deploy) starts and the static ops/vlm.conf does not"
                )
            peer, msg = channel.recv()
            if isinstance(msg, TPJoin) and 1 <= msg.rank < world:
                joined[msg.rank] = peer
        for peer in joined.values():
            channel.send_to(peer, TPSetup(store_path, world, num_blocks, incarnation))
    finally:
        channel.close()
        transport.close()
    init_group(cfg, store_path, 0, world, device)
    log.info("tensor parallel group of %d ranks formed (%s)", world, store_path)


def follower_rendezvous(cfg: Config, replica: int, rank: int, incarnation: str, device: torch.device) -> TPSetup:
    """Rank K of ``replica``: announce itself to its rank 0, wait for `TPSetup`, enter the group."""
    transport = Transport(cfg, "decoder")
    channel = transport.channel(zmq.DEALER, decoder_hub(replica, "decoder-tp"), bind=False)
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
        transport.close()
    init_group(cfg, msg.store_path, rank, msg.world, device)
    return msg


LEAVE_TIMEOUT_S = 5.0  # below supervisord's stopwaitsecs (10), so a stuck rank says so before it is killed


def leave_group(graphs: StepGraphs | None) -> None:
    """Leave the tensor-parallel group at shutdown. Both ranks hung in ``destroy_process_group``: NCCL's destroy
    waits until every CUDA graph that captured one of the communicator's collectives is destroyed (it counts them;
    pytorch/pytorch#115388, vllm-project/vllm#39846), and ours still existed. So the graphs go first.
    A destroy that still does not return ends the process with an error."""
    if graphs is not None:
        graphs.release()
    watchdog = threading.Timer(LEAVE_TIMEOUT_S, _stuck_leaving)
    watchdog.daemon = True
    watchdog.start()
    dist.destroy_process_group()
    watchdog.cancel()


def _stuck_leaving() -> None:
    log.error("leaving the tensor-parallel group took over %.0fs; exiting without it", LEAVE_TIMEOUT_S)
    logging.shutdown()
    os._exit(1)


class DecoderRank:
    """A decoder rank K >= 1: its shard of the model and KV cache (and graphs, as rank 0 has them),
    running rank 0's steps until told to stop."""

    def __init__(self, cfg: Config, replica: int, rank: int) -> None:
        incarnation = f"{os.getpid()}-{time.time_ns() % 10**9}"
        device = claim_device(cfg, cfg.decoder_gpu(replica, rank), vision=replica in vision_replicas(cfg))
        spec = read_spec(cfg.model_path(), cfg.model.quantization)
        tp = TensorParallel(rank, cfg.decoder.tensor_parallel, spec.vocab_size)
        model = load_shard(cfg.model_path(), spec, tp, device, resolve_dtype(cfg, device))
        setup = follower_rendezvous(cfg, replica, rank, incarnation, device)
        # rank 0's options: the same kernels, graphs exactly when it has them
        max_len = cfg.decoder.max_model_len or spec.max_position_embeddings
        config = EngineConfig.from_settings(cfg.decoder, device, setup.num_blocks, max_len)
        graphs = config.graphs != "off"
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        kv = PagedKVCache.for_model(model, setup.num_blocks + graphs, cfg.decoder.block_size, cache_dtype)
        fused = fuse_layers(model) if config.fuse else None
        step_graphs = engine_graphs(model, kv, config, fused, tp) if graphs else None
        self.forward = RankForward(model, kv, config.attention, tp, fused, step_graphs)
        self.steps = StepBroadcast(tp, spec.hidden_size, model.dtype, device)
        log.info("decoder rank %d of %d ready on %s (rank 0: %s)", rank, setup.world, device, setup.leader)

    def run(self) -> None:
        while (payload := self.steps.receive()) is not None:
            self.forward(payload)
        log.info("rank 0 said stop")
        leave_group(self.forward.graphs)
