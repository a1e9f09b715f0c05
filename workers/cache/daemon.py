"""The cache daemon process: owns the embedding pool and answers lookups, commits and leases; writes the embeddings
that encoders on other hosts send by value."""

from __future__ import annotations

import logging

import torch
import zmq

from common.config import Config
from common.memory import host_memory, pool_plan
from common.protocol import (
    CacheAcquire,
    CacheAcquireResult,
    CacheCommit,
    CacheLookup,
    CacheLookupResult,
    CacheRelease,
    CacheReserve,
    CacheReserveResult,
    CacheWrite,
    CudaIpcHandle,
    FetcherStarted,
    Message,
    StatsRequest,
    StatsResult,
    TensorRef,
)
from common.tensor_ref import SHM_DIR, CudaPool, ShmPool, nbytes_of, read_tensor, torch_dtype
from common.transport import EventLoop, Transport, worker_identity
from workers.cache.store import MAIN, EmbeddingStore, Entry, NeverFits, PoolFull, Spill, Wanted
from workers.cache.waiting import ReservationQueue, Waiting

log = logging.getLogger(__name__)
_FAILURES_KEPT = 1024


class CacheDaemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.incarnation, _ = worker_identity("cache")
        size_pool(cfg)
        remove_stale_pools(cfg)  # a predecessor killed with -9 could not unlink its pool
        name = f"{pool_prefix(cfg)}{self.incarnation}"
        self.pool: ShmPool | CudaPool
        self.cuda_handle: CudaIpcHandle | None = None
        self.spill: ShmPool | None = None
        if cfg.cache.device_pool:
            if not torch.cuda.is_available():
                raise ValueError("[cache] device_pool = true needs a CUDA GPU; set it to false on this host")
            # On the decoder's GPU (0), where the embeddings are read: encoders on other GPUs write to it
            # over NVLink/PCIe peer access. One pool, not one per GPU: no other
            # GPU has a reader (tensor-parallel ranks get the embedded rows from rank 0).
            self.pool = CudaPool.create(name, cfg.cache.pool_bytes, torch.device("cuda", 0))
            self.cuda_handle = self.pool.handle()
            if cfg.cache.spill_bytes:
                self.spill = ShmPool(f"{name}-spill", cfg.cache.spill_bytes, create=True)
        else:
            self.pool = ShmPool(name, cfg.cache.pool_bytes, create=True)
        self.store = EmbeddingStore(cfg.cache.pool_bytes, cfg.cache.spill_bytes if self.spill else 0)
        self.transport = Transport(cfg, "cache")
        self.channel = self.transport.channel(zmq.ROUTER, "cache", bind=True)
        self.waiters: dict[str, tuple[bytes, CacheAcquire]] = {}
        # fetchers' reservations that found no room, answered as releases make it (or at their deadline)
        self.reservations: ReservationQueue[tuple[bytes, CacheReserve]] = ReservationQueue()
        self.failures: dict[str, str] = {}  # content hash -> why its encode failed, the latest few
        # Slots reserved for a fetcher to encode, not yet filled: content hash -> (fetcher, its incarnation); and
        # each fetcher's latest incarnation. A fetcher seen restarted never fills what its predecessor reserved.
        self.owners: dict[str, tuple[str, str]] = {}
        self.fetchers: dict[str, str] = {}
        self.retired: set[str] = set()  # fetcher incarnations a newer one replaced (one per restart)
        self.loop = EventLoop()
        self.loop.exit_if_stalled(cfg.liveness.stall_exit_s, "cache")
        self.loop.on_message(self.channel, self.handle)
        self.loop.every(0.5, self.expire)
        log.info(
            "cache ready: pool %s of %.1f MiB in %s%s at %s",
            self.pool.name,
            cfg.cache.pool_bytes / 2**20,
            "GPU memory (CUDA IPC)" if self.cuda_handle else "shared memory",
            f", spill tier of {cfg.cache.spill_bytes / 2**20:.1f} MiB in shared memory" if self.spill else "",
            self.channel.address,
        )

    def run(self) -> None:
        try:
            self.loop.run()
        finally:
            for pool in (self.pool, self.spill):
                if isinstance(pool, ShmPool):
                    pool.unlink()
            self.channel.close()

    # ------------------------------------------------------------------ messages
    def handle(self, peer: bytes, msg: Message) -> None:
        match msg:
            case CacheLookup():
                self.channel.send_to(peer, self.lookup(msg))
            case CacheCommit() if self.stale(msg):
                log.info(
                    "a commit for %s names a slot it no longer has (its pool or offset): ignored", msg.content_hash[:12]
                )
            case CacheCommit(content_hash=h, error=""):
                self.owners.pop(h, None)
                self.store.commit(h)
                self.answer_waiters()
                self.serve_reservations()  # (a committed entry nobody leases can be evicted)
            case CacheCommit(content_hash=h):
                log.warning("encode of %s failed: %s", h[:12], msg.error)
                self.fail_entry(h, msg.error)
            case CacheWrite():
                self.write(msg)
            case FetcherStarted(fetcher=name, incarnation=incarnation):
                self.fetcher_seen(name, incarnation)
            case CacheReserve(request_id=r):
                self.fetcher_seen(msg.fetcher, msg.fetcher_incarnation)
                waited_already = r in self.reservations.waiting  # (its fetcher sent it again)
                self.reservations.add(r, (peer, msg), self.cfg.cache.reserve_wait_s)
                self.serve_reservations()
                if r in self.reservations.waiting and not waited_already:
                    self.store.counters["waited"] += 1
            case CacheAcquire():
                self.store.lease(msg.request_id, msg.content_hashes, self.cfg.cache.lease_ttl_s)
                self.waiters[msg.call_id] = (peer, msg)
                self.answer_waiters()
            case CacheRelease(request_id=r):
                self.reservations.withdraw(r)  # (an aborted request waiting for room waits no more)
                self.store.release(r)
                self.serve_reservations()
            case StatsRequest(call_id=c):
                stats = {
                    **self.store.snapshot(),
                    "reservations_waiting": float(len(self.reservations)),
                    "security_denied": float(self.transport.security.denied),
                }
                self.channel.send_to(peer, StatsResult(c, "cache", self.incarnation, stats))
            case _:
                log.warning("unexpected %s from %r", msg.TAG, peer)

    def write(self, msg: CacheWrite) -> None:
        """An embedding sent by value into its entry's slot here. A write for a slot this daemon no longer gives
        that hash is stale and ignored, as a stale commit is; rows that do not fit their own slot fail the entry,
        so that the requests waiting for it are answered."""
        entry, slot = self.store.entries.get(msg.content_hash), msg.slot
        start, end = slot.offset, slot.offset + nbytes_of(slot.dtype, slot.shape)
        if (
            entry is None
            or entry.ready
            or entry.tier != MAIN
            or slot.pool_incarnation != self.incarnation
            or slot.shm_name != self.pool.name
            or not entry.offset <= start < end <= entry.offset + entry.nbytes
        ):
            log.info("a write for %s names a slot it no longer has: ignored", msg.content_hash[:12])
            return
        try:
            rows = read_tensor(msg.rows) if msg.rows.kind == "inline" else None
            if rows is None or rows.dtype != torch_dtype(slot.dtype) or list(rows.shape) != slot.shape:
                raise ValueError(
                    f"rows {msg.rows.dtype} {msg.rows.shape} ({msg.rows.kind}) for a slot of {slot.dtype} {slot.shape}"
                )
            self.pool.view(slot).copy_(rows)
        except ValueError as exc:
            log.warning("an embedding of %s sent by value does not fit its slot: %s", msg.content_hash[:12], exc)
            self.fail_entry(msg.content_hash, f"the embedding sent by value does not fit its slot: {exc}")
            return
        self.store.counters["writes"] += 1
        self.store.counters["written_bytes"] += end - start

    def fail_entry(self, content_hash: str, why: str) -> None:
        """A reserved entry that will not be filled: dropped, and every request waiting for it answered."""
        self.owners.pop(content_hash, None)
        self.store.fail(content_hash)
        self.remember_failure(content_hash, why)
        self.answer_waiters()
        self.serve_reservations()

    def stale(self, commit: CacheCommit) -> bool:
        """A commit for a slot this daemon does not give its hash now: written into a lost daemon's pool, or
        into a slot freed (its fetcher restarted, or past ``pending_ttl_s``) and maybe reserved again since."""
        entry = self.store.entries.get(commit.content_hash)
        if entry is None or entry.ready:
            return False
        other_pool = bool(commit.pool_incarnation) and commit.pool_incarnation != self.incarnation
        return other_pool or (commit.offset >= 0 and commit.offset != entry.offset)

    def fetcher_seen(self, name: str, incarnation: str) -> None:
        """``name`` runs as ``incarnation``: where that is new, the slots its predecessor reserved and did not
        fill are failed now, and the requests waiting on them told (their decoder has them fetched again)."""
        if not name or not incarnation or incarnation in self.retired:  # (a dead one's last words, read late)
            return
        if self.fetchers.get(name, incarnation) == incarnation:
            self.fetchers[name] = incarnation
            return
        self.retired.add(self.fetchers[name])
        self.fetchers[name] = incarnation
        orphaned = [h for h, (who, inc) in self.owners.items() if who == name and inc != incarnation]
        for h in orphaned:
            del self.owners[h]
            entry = self.store.entries.get(h)
            if entry is not None and not entry.ready:
                self.store.fail(h)
                self.remember_failure(h, f"the fetcher {name} that was encoding it restarted")
        if orphaned:
            log.warning("%s restarted: %d slot(s) it had reserved and not filled are freed", name, len(orphaned))
            self.answer_waiters()
            self.serve_reservations()

    def remember_failure(self, content_hash: str, why: str) -> None:
        """Why ``content_hash`` has no embedding, for the requests waiting on it (the latest few kept)."""
        self.failures[content_hash] = why
        while len(self.failures) > _FAILURES_KEPT:
            del self.failures[next(iter(self.failures))]

    def lookup(self, msg: CacheLookup) -> CacheLookupResult:
        entry = self.store.lookup(msg.content_hash)
        if entry is not None:
            return CacheLookupResult(msg.call_id, "ready" if entry.ready else "pending", self.ref(entry))
        if msg.nbytes > self.pool.size:
            return CacheLookupResult(
                msg.call_id,
                "error",
                status=413,
                message=f"media embedding needs {msg.nbytes} B but the embedding pool holds {self.pool.size} B; "
                "send a smaller image or raise [cache] pool_bytes",
            )
        try:  # (a lone lookup, answered at once: fetchers reserve a request's items together, `CacheReserve`)
            entry = self.store.reserve(msg.content_hash, msg.nbytes, msg.dtype, msg.shape)
        except PoolFull as exc:
            return CacheLookupResult(
                msg.call_id, "error", status=503, message=f"embedding cache is full ({exc}); retry shortly"
            )
        if self.spill is not None:  # before the answer: the slot may be bytes that were just spilled
            copy_spills(self.store.take_spills(), self.pool, self.spill)
        return CacheLookupResult(msg.call_id, "reserved", self.ref(entry))

    def serve_reservations(self) -> None:
        for waiting in self.reservations.serve(self.try_reserve):
            peer, _ = waiting.what
            if waiting.answer is not None:
                self.channel.send_to(peer, waiting.answer)

    def try_reserve(self, waiting: Waiting[tuple[bytes, CacheReserve]]) -> bool:
        """Reserve a waiting request's items if they fit now (its answer kept on ``waiting.answer``); False
        if it must go on waiting."""
        _, msg = waiting.what
        wanted = [Wanted(i.content_hash, i.nbytes, i.dtype, list(i.shape)) for i in msg.items]
        try:
            found = self.store.reserve_all(msg.request_id, wanted, self.cfg.cache.lease_ttl_s)
        except NeverFits as exc:
            waiting.answer = too_large(msg, exc)
            return True
        except PoolFull as exc:
            waiting.why = str(exc)
            return False
        if self.spill is not None:  # before the answer: the slots may be bytes that were just spilled
            copy_spills(self.store.take_spills(), self.pool, self.spill)
        pairs = zip(msg.items, found, strict=True)
        if msg.fetcher:
            owner = (msg.fetcher, msg.fetcher_incarnation)
            self.owners.update((entry.content_hash, owner) for state, entry in found if state == "reserved")
        results = [CacheLookupResult(item.call_id, state, self.ref(entry)) for item, (state, entry) in pairs]
        waiting.answer = CacheReserveResult(msg.call_id, msg.request_id, results)
        return True

    def ref(self, entry: Entry) -> TensorRef:
        on_gpu = entry.tier == MAIN and self.cuda_handle is not None
        pool = self.pool if entry.tier == MAIN or self.spill is None else self.spill
        return TensorRef(
            kind="cuda_ipc" if on_gpu else "shm",
            dtype=entry.dtype,
            shape=entry.shape,
            shm_name=pool.name,
            offset=entry.offset,
            pool_incarnation=self.incarnation,
            cuda=self.cuda_handle if on_gpu else None,
        )

    def answer_waiters(self) -> None:
        for call_id, (peer, msg) in list(self.waiters.items()):
            entries = [self.store.entries.get(h) for h in msg.content_hashes]
            missing = [h for h, e in zip(msg.content_hashes, entries, strict=True) if e is None]
            if missing:
                why = self.failures.get(missing[0], "encode failed, expired or the cache restarted")
                reply = CacheAcquireResult(
                    call_id,
                    msg.request_id,
                    [],
                    status=503,
                    message=f"embedding of media {missing[0][:12]} is not available ({why}); retry the request",
                )
                self.store.release(msg.request_id)
            elif all(e is not None and e.ready for e in entries):
                reply = CacheAcquireResult(call_id, msg.request_id, [self.ref(e) for e in entries if e is not None])
            else:
                continue
            del self.waiters[call_id]
            self.channel.send_to(peer, reply)

    def expire(self) -> None:
        if self.store.expire(self.cfg.cache.pending_ttl_s):
            self.answer_waiters()
        for h in [h for h in self.owners if (e := self.store.entries.get(h)) is None or e.ready]:
            del self.owners[h]
        for waiting in self.reservations.expired():
            peer, msg = waiting.what
            self.store.counters["full"] += 1
            why = (
                f"no room in the embedding cache within [cache] reserve_wait_s = {self.cfg.cache.reserve_wait_s:g} s "
                f"({waiting.why or 'behind earlier requests waiting for room'}); retry the request, or raise "
                "[cache] pool_bytes"
            )
            self.channel.send_to(peer, CacheReserveResult(msg.call_id, msg.request_id, [], 503, "cache_full", why))
        self.serve_reservations()  # (expired leases and pending slots free room)


def too_large(msg: CacheReserve, exc: NeverFits) -> CacheReserveResult:
    message = (
        f"the request's images and videos need {exc.needed} B of embeddings but the embedding pool holds "
        f"{exc.capacity} B: raise [cache] pool_bytes, or send fewer or smaller images or videos (a lower "
        "max_pixels, fewer frames)"
    )
    return CacheReserveResult(msg.call_id, msg.request_id, [], 413, "embeddings_too_large", message)


def copy_spills(spills: list[Spill], main: ShmPool | CudaPool, spill: ShmPool) -> None:
    """Each spilled entry's bytes from the main pool into the spill tier (GPU to host: a synchronous copy,
    done before the main bytes can be written again)."""
    for move in spills:
        spill.buffer[move.dst : move.dst + move.nbytes].copy_(main.buffer[move.src : move.src + move.nbytes])


def size_pool(cfg: Config) -> None:
    """Fill ``[cache] pool_bytes`` (and an automatic spill tier's) from this machine's memory, and log the rule."""
    on_gpu = cfg.cache.device_pool and torch.cuda.is_available()
    plan = pool_plan(cfg, torch.cuda.get_device_properties(0).total_memory if on_gpu else 0, host_memory())
    cfg.cache.pool_bytes, cfg.cache.spill_bytes = plan.pool.nbytes, plan.spill.nbytes
    log.info("%s", plan.describe())


def pool_prefix(cfg: Config) -> str:
    return f"vlm-{cfg.deployment_id}-emb-"


def remove_stale_pools(cfg: Config) -> None:
    for stale in SHM_DIR.glob(pool_prefix(cfg) + "*"):
        stale.unlink(missing_ok=True)
