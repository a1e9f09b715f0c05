"""The decoder process: joins a request with its media embeddings, then generates its tokens.

Main loop: take messages (prepared requests, aborts, cache answers), run one engine step,
send that step's tokens to the gateway as one ``TokenBatch``. Requests whose embeddings are
not ready wait in ``waiting`` with a deadline; a cache daemon that restarts or goes silent
fails them at once with a 503 ``media_unavailable`` instead of leaving them hanging, which the gateway
answers by fetching and encoding the request again (`gateway.pipeline.MEDIA_REISSUES`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from common.config import Config, decoder_hub, decoder_name
from common.lifecycle import REPORT_EVERY_S, CounterWindow
from common.memory import device_pool_bytes
from common.protocol import (
    Abort,
    CacheAcquire,
    CacheAcquireResult,
    CacheRelease,
    DecoderStats,
    Message,
    PreparedRequest,
    RequestError,
    StatsRequest,
    StatsResult,
    TokenBatch,
    WorkerStatus,
)
from common.tensor_ref import ShmAttachments, TensorRef, gather_rows
from common.topology import vision_replicas
from common.transport import EventLoop, Transport, worker_identity
from workers.decoder.batch import Sequence
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.grammar import GrammarCompiles, Grammars
from workers.decoder.scheduler import PromptError
from workers.decoder.tp import StepBroadcast, leader_rendezvous, leave_group
from workers.models.language import LanguageModel
from workers.models.paged import PagedKVCache, kv_cache_dtype
from workers.models.registry import checkpoint_family, read_spec
from workers.models.runtime import claim_device, resolve_dtype
from workers.models.tensor_parallel import TensorParallel, load_shard

log = logging.getLogger(__name__)


def per_step_ms(counters: dict[str, float], seconds_key: str, steps: float) -> float:
    """Milliseconds of ``counters[seconds_key]`` per step (0 with no steps)."""
    return 1e3 * counters.get(seconds_key, 0.0) / steps if steps else 0.0


def kv_cache_blocks(cfg: Config, model: LanguageModel) -> int:
    """KV blocks from ``[decoder] kv_cache_bytes``, or by default a share of what the GPU has free
    after the weights (the encoder and the embedding pool take the rest), or 256 MiB on a CPU. An FP8 cache's
    block costs a byte an element and its scales, so the same bytes hold about twice the blocks."""
    cache_dtype = kv_cache_dtype(cfg.decoder.kv_cache_dtype, model.dtype)
    per_block = PagedKVCache.bytes_per_block(model.spec, cfg.decoder.block_size, cache_dtype)  # (its heads only)
    budget = cfg.decoder.kv_cache_bytes
    if budget <= 0 and model.device.type == "cuda":
        budget = gpu_kv_budget(cfg, model.device)
    elif budget <= 0:
        budget = 256 * 2**20
    blocks = budget // per_block
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
        blocks,
        cfg.decoder.block_size,
        blocks * per_block / 2**30,
        str(cache_dtype).removeprefix("torch."),
    )
    return int(blocks)


def gpu_kv_budget(cfg: Config, device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_allocated(device)  # (this process's weights, loaded by now)
    gpu = device.index or 0
    pool = device_pool_bytes(cfg.cache.pool_bytes, total).nbytes if cfg.cache.device_pool and gpu == 0 else 0
    return shared_kv_budget(cfg, gpu, torch.cuda.device_count(), free, total, own, pool)


def shared_kv_budget(cfg: Config, gpu: int, visible: int, free: int, total: int, own: int, pool: int = 0) -> int:
    """``gpu_memory_fraction`` of what GPU ``gpu`` has ``free`` after this process's weights. With N decoder
    replicas on it (``replica_gpus``, or more replicas than ``visible`` GPUs: they wrap round, as in
    `resolve_device`) each takes that fraction of the ``total`` over N, less its ``own`` allocations: they start
    at once, so what is free when one asks depends on which came first. The GPU embedding pool's ``pool`` bytes
    (on GPU 0) come out of that fraction first, allocated yet or not (the cache daemon starts beside us)."""
    sharing = sum(gpu in {g % visible for g in cfg.replica_gpu_set(r)} for r in range(cfg.decoder.replicas))
    fraction = cfg.decoder.gpu_memory_fraction
    if sharing <= 1 and not pool:
        return int(free * fraction)
    return max(0, min(int((total * fraction - pool) / max(sharing, 1)) - own, int(free * fraction)))


class RecentAborts:
    """Ids of the requests aborted in the last ``keep_s`` seconds (at most ``limit`` of them). An abort can overtake
    its request (the fetcher may still be handing it over), so the decoder must know a late request was aborted; but
    the gateway aborts every request when it ends, so kept for good (or up to a count alone) they would grow with
    every request served."""

    def __init__(self, keep_s: float, limit: int = 100_000) -> None:
        self.keep_s, self.limit = keep_s, limit
        self._since: OrderedDict[str, float] = OrderedDict()  # request id -> when its abort came, oldest first

    def add(self, request_id: str, now: float) -> None:
        self._since[request_id] = now
        self._since.move_to_end(request_id)
        while self._since and (len(self._since) > self.limit or next(iter(self._since.values())) < now - self.keep_s):
            self._since.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._since

    def __len__(self) -> int:
        return len(self._since)


@dataclass
class Waiting:
    seq: Sequence
    call_id: str
    deadline: float
    since: float = 0.0


class DecoderWorker:
    def __init__(self, cfg: Config, replica: int = 0) -> None:
        self.cfg = cfg
        self.name = decoder_name(replica)
        self.incarnation, _ = worker_identity(self.name)
        path = cfg.model_path()
        self.spec = read_spec(path, cfg.model.quantization)
        device = claim_device(cfg, cfg.decoder_gpu(replica), vision=replica in vision_replicas(cfg))
        started = time.monotonic()
        dtype = resolve_dtype(cfg, device)
        world = cfg.decoder.tensor_parallel
        tp_steps = None
        if world > 1:  # rank 0 of a tensor-parallel group: its shard, then the other ranks join
            tp = TensorParallel(0, world, self.spec.vocab_size)
            model = load_shard(path, self.spec, tp, device, dtype)
            num_blocks = kv_cache_blocks(cfg, model)
            leader_rendezvous(cfg, replica, self.incarnation, num_blocks, device)
            tp_steps = StepBroadcast(tp, self.spec.hidden_size, model.dtype, device)
        else:
            model = checkpoint_family(path).language_model(path, device=device, dtype=dtype, spec=self.spec)
            num_blocks = kv_cache_blocks(cfg, model)
        max_len = cfg.decoder.max_model_len or self.spec.max_position_embeddings
        config = EngineConfig.from_settings(cfg.decoder, device, num_blocks, max_len)
        grammars = Grammars.for_checkpoint(path, self.spec.vocab_size, self.spec.eos_token_ids)
        self.engine = Engine(model, self.spec, config, tp_steps, grammars)
        self.transport = Transport(cfg, "decoder")
        self.inbox = self.transport.channel(zmq.PULL, decoder_hub(replica), bind=True)
        self.results = self.transport.channel(zmq.PUSH, "gateway", bind=False)
        self.cache = self.transport.channel(zmq.DEALER, "cache", bind=False)
        self.pools = ShmAttachments()
        self.waiting: dict[str, Waiting] = {}
        # (a request is never handed over later than its deadline: the gateway has failed it by then)
        self.aborted = RecentAborts(cfg.server.request_timeout_s)
        self.cache_incarnation = ""
        self.cache_seen = time.monotonic()
        self.loop = EventLoop()
        self.loop.exit_if_stalled(cfg.liveness.stall_exit_s, self.name)
        self.compiles = GrammarCompiles(grammars, self.loop, self.on_grammar) if grammars is not None else None
        # wall time inside engine steps, their number, and time spent on requests and on the cache's answers
        self.timing = {"busy_s": 0.0, "steps": 0.0, "inbox_s": 0.0, "cache_s": 0.0}
        self.slowest_step_s = 0.0  # in this report's period
        self.window = CounterWindow(self.timing)
        self.engine_window = CounterWindow(self.engine.counters)
        self.loop.every(REPORT_EVERY_S, self.report)
        self.loop.on_message(self.inbox, self.timed(self.on_inbox, "inbox_s"))
        self.loop.on_message(self.cache, self.timed(self.on_cache, "cache_s"))
        self.loop.every(cfg.liveness.heartbeat_s, self.heartbeat)
        self.heartbeat()
        graphs = self.engine.runner.graphs
        log.info(
            "%s ready on %s in %.1fs: context %d, kernels %s, CUDA graphs %s, overlap %s, at %s",
            self.name,
            device,
            time.monotonic() - started,
            max_len,
            "triton + fused layers" if config.fuse else "torch",
            f"for decode batches {graphs.decode_sizes} and mixed steps of {graphs.token_sizes} tokens"
            if graphs is not None and graphs.graphs
            else "off",
            config.overlap,
            self.inbox.address,
        )

    def run(self) -> None:
        try:
            self.loop.run(self.step)
        finally:
            for channel in (self.inbox, self.results, self.cache):
                channel.close()
            tp_steps = self.engine.runner.tp_steps
            if tp_steps is not None:
                with contextlib.suppress(Exception):  # the group may be broken already
                    tp_steps.send_stop()
                    leave_group(self.engine.runner.graphs)

    def step(self) -> bool:
        if not self.engine.has_work():
            return False
        started = time.monotonic()
        try:
            deltas = self.engine.step()
        except Exception as exc:  # a model failure must answer every request it touched
            log.exception("engine step failed")
            scheduler = self.engine.scheduler
            for request_id in [*scheduler.running, *(s.request_id for s in scheduler.waiting)]:
                self.engine.abort(request_id)
                self.fail(request_id, 500, "internal_error", f"decoder failed: {exc}")
            if self.engine.runner.tp_steps is not None:
                raise  # the ranks' group is in an unknown state: restart (supervisord) and form a new one
            return False
        if deltas:
            self.results.send(TokenBatch(deltas))
        for request_id, why in self.engine.take_failed():
            self.fail(request_id, 500, "grammar_error", why)
        took = time.monotonic() - started
        self.timing["busy_s"] += took
        self.timing["steps"] += 1
        self.slowest_step_s = max(self.slowest_step_s, took)
        return self.engine.has_work()

    def timed(self, handler: Callable[[bytes, Message], None], counter: str) -> Callable[[bytes, Message], None]:
        """``handler``, adding its wall time to ``self.timing[counter]``."""

        def run(peer: bytes, msg: Message) -> None:
            started = time.monotonic()
            try:
                handler(peer, msg)
            finally:
                self.timing[counter] += time.monotonic() - started

        return run

    def report(self) -> None:
        """A line per period with work: how long steps took and what they carried. A slow step under
        image load is the decoder sharing its GPU (or its CPU) with the vision path."""
        seconds, grew = self.window.take()
        _, engine = self.engine_window.take()
        slowest, self.slowest_step_s = self.slowest_step_s, 0.0
        if grew["steps"]:
            log.info(
                "decoder: %d steps over %.1fs, in steps %.0f%%, on requests %.0f%%, on cache answers %.0f%%; "
                "%.1f ms per step, slowest %.0f ms; host launch %.2f ms per decode-graph step, %.2f per other; "
                "waiting on tokens %.2f ms per step, grammar masks %.2f ms per step (%d rows); "
                "%d prompt tokens, %d generated; %d running, %d queued, %d waiting for media",
                grew["steps"],
                seconds,
                100 * grew["busy_s"] / seconds,
                100 * grew["inbox_s"] / seconds,
                100 * grew["cache_s"] / seconds,
                1e3 * grew["busy_s"] / grew["steps"],
                1e3 * slowest,
                per_step_ms(engine, "decode_launch_s", engine.get("decode_graph_steps", 0)),
                per_step_ms(engine, "other_launch_s", engine.get("steps", 0) - engine.get("decode_graph_steps", 0)),
                per_step_ms(engine, "token_wait_s", engine.get("steps", 0)),
                per_step_ms(engine, "grammar_fill_s", engine.get("steps", 0)),
                engine.get("grammar_rows", 0),
                engine.get("prompt_tokens", 0),
                engine.get("generated_tokens", 0),
                len(self.engine.scheduler.running),
                len(self.engine.scheduler.waiting),
                len(self.waiting),
            )

    # ------------------------------------------------------------------ messages
    def on_inbox(self, _peer: bytes, msg: Message) -> None:
        match msg:
            case PreparedRequest(request_id=rid) if not self.known(rid) and rid not in self.aborted:
                self.admit(msg)
            case Abort(request_id=rid):
                self.aborted.add(rid, time.monotonic())
                self.engine.abort(rid)
                if self.waiting.pop(rid, None) is not None:
                    self.cache.send(CacheRelease(rid))
                if self.compiles is not None:
                    self.compiles.abort(rid)
            case _:
                pass

    def known(self, request_id: str) -> bool:
        """A re-issued request (its fetcher died after handing it over) must not run twice."""
        compiling = self.compiles is not None and self.compiles.holds(request_id)
        return self.engine.holds(request_id) or request_id in self.waiting or compiling

    def admit(self, request: PreparedRequest) -> None:
        if self.compiles is not None and self.compiles.needs_compile(request):
            self.compiles.wait(request)  # (admitted again by on_grammar once its grammar is compiled)
            return
        try:
            seq = self.engine.prepare(request)
        except PromptError as exc:
            self.fail(request.request_id, 400, exc.code, str(exc))
            return
        if not request.media:
            self.engine.add(seq)
            return
        call_id = uuid.uuid4().hex
        deadline = time.monotonic() + self.cfg.decoder.media_wait_s
        self.waiting[request.request_id] = Waiting(seq, call_id, deadline, time.monotonic())
        self.cache.send(CacheAcquire(call_id, request.request_id, [m.content_hash for m in request.media]))

    def on_grammar(self, request: PreparedRequest, error: str) -> None:
        """A request's grammar finished compiling (``error`` "": it compiled) on `GrammarCompiles`' thread."""
        if error:
            self.fail(request.request_id, 400, "invalid_grammar", error)
        else:
            self.admit(request)

    def on_cache(self, _peer: bytes, msg: Message) -> None:
        match msg:
            case StatsResult(incarnation=inc):
                self.cache_seen = time.monotonic()
                if self.cache_incarnation and inc != self.cache_incarnation:
                    self.pools.forget_except("")
                    self.reacquire_waiting()
                self.cache_incarnation = inc
            case CacheAcquireResult(request_id=rid):
                waiting = self.waiting.get(rid)
                if waiting is None or waiting.call_id != msg.call_id:
                    return
                del self.waiting[rid]
                if msg.status != 200:
                    self.fail(rid, msg.status, "media_unavailable", msg.message)
                    return
                try:
                    self.take_embeddings(waiting.seq, msg.refs)
                except (OSError, ValueError, RuntimeError) as exc:  # (RuntimeError: a GPU pool that cannot be mapped)
                    self.fail(rid, 503, "media_unavailable", f"cannot read media embeddings: {exc}")
                    return
                finally:
                    self.cache.send(CacheRelease(rid))  # the copy above is ours; the lease can go
                waiting.seq.media_wait_s = time.monotonic() - waiting.since
                self.engine.add(waiting.seq)
            case _:
                pass

    # ------------------------------------------------------------------ liveness and endings
    def heartbeat(self) -> None:
        self.results.send(WorkerStatus("decoder", self.name, self.incarnation, self.cfg.decoder.max_running))
        self.results.send(DecoderStats(self.incarnation, self.stats(), self.name))
        self.cache.send(StatsRequest("ping"))
        now = time.monotonic()
        if self.waiting and now - self.cache_seen > self.cfg.liveness.dead_after_s:
            self.fail_waiting("the embedding cache daemon is not answering")
        for rid, waiting in list(self.waiting.items()):
            if waiting.deadline < now:
                del self.waiting[rid]
                self.cache.send(CacheRelease(rid))
                self.fail(rid, 504, "media_timeout", "timed out waiting for the vision encoder")

    def stats(self) -> dict[str, float]:
        gauges = {
            "requests_waiting_for_media": float(len(self.waiting)),
            "requests_waiting_for_grammar": float(len(self.compiles) if self.compiles is not None else 0),
            "requests_queued": float(len(self.engine.scheduler.waiting)),
            "requests_running": float(len(self.engine.scheduler.running)),
            "security_denied": float(self.transport.security.denied),
        }
        return {**self.engine.stats(), **gauges}

    def reacquire_waiting(self) -> None:
        """Ask the new cache for every waiting request's embeddings again. An acquire sent before the
        restart may have been lost with the old daemon, or may have reached the new one: asking again
        answers both. Embeddings the old daemon held are gone, and the new one says so at once (503)."""
        for rid, waiting in self.waiting.items():
            waiting.call_id = uuid.uuid4().hex  # an answer to the earlier call is ignored
            hashes = [m.content_hash for m in waiting.seq.request.media]
            self.cache.send(CacheAcquire(waiting.call_id, rid, hashes))

    def fail_waiting(self, why: str) -> None:
        for rid in list(self.waiting):
            del self.waiting[rid]
            self.cache.send(CacheRelease(rid))  # (a daemon only slow to answer still holds its lease)
            self.fail(rid, 503, "media_unavailable", f"{why}; retry the request")

    def take_embeddings(self, seq: Sequence, refs: list[TensorRef]) -> None:
        """A copy of the request's embeddings, items in prompt order. A Qwen3-VL entry is [1 + K, rows, hidden]
        (merged, then the DeepStack sets): items join along the rows, and the sets go apart."""
        if not self.spec.num_deepstack:
            seq.media_embeds = gather_rows(refs, self.pools)
            return
        sets = gather_rows(refs, self.pools, dim=1)
        if sets.ndim != 3 or sets.shape[0] != self.spec.embedding_sets:
            raise ValueError(f"expected {self.spec.embedding_sets} feature sets an entry, got {list(sets.shape)}")
        seq.media_embeds, seq.deepstack_embeds = sets[0], sets[1:]

    def fail(self, request_id: str, status: int, code: str, message: str) -> None:
        self.results.send(RequestError(request_id, status, code, message))
