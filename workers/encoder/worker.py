"""The encoder process: one per GPU, runs the vision tower and writes embeddings into cache slots, or for a job
``by_value`` (an encoder on another host than the cache) sends them back in its result.

Jobs that arrive together are encoded together: the event loop drains the socket, then `step` packs
the queued images of any requests into one forward (each image its own attention segments), bounded
by ``max_batch_patches``, and hands every job its own rows. A batch that fails is retried image by
image, so one bad job fails alone.

On a GPU a step queues the next batch's forward before it hands out the last
batch's rows: the GPU computes the next batch while the host waits for the last one's rows, copies them
into their slots and answers, and the socket loop takes in new jobs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from common.config import Config
from common.lifecycle import REPORT_EVERY_S, CounterWindow
from common.protocol import EncodeJob, EncodeResult, Message, Ping, StatsRequest, StatsResult, WorkerStatus, commit_for
from common.tensor_ref import ShmAttachments, inline_ref, read_tensor, torch_dtype
from common.transport import EventLoop, Transport, worker_identity
from workers.encoder.backends import VisionBackend, load_vision_backend
from workers.models.pixels import Normalization, normalize_patches
from workers.models.runtime import claim_device, encoder_gpu, resolve_dtype, upload

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """One job of a launched batch: its embeddings on their way to its slot, or why it failed."""

    peer: bytes
    job: EncodeJob
    slot: torch.Tensor | None = None
    host_rows: torch.Tensor | None = None  # rows still to copy into a host slot, once the batch is done
    error: Exception | None = None


@dataclass
class Launched:
    """A batch whose forward (and copies) may still be running: ``done`` is recorded after them on the
    tower's stream (None: nothing of it is left on a device)."""

    staged: list[Staged]
    done: torch.cuda.Event | None


class EncoderWorker:
    def __init__(self, cfg: Config, index: int) -> None:
        self.cfg = cfg
        self.name = f"encoder.{index}"
        self.incarnation, _ = worker_identity(self.name)
        self.device = claim_device(cfg, encoder_gpu(cfg, index), vision=True)
        self.dtype = resolve_dtype(cfg, self.device)
        started = time.monotonic()
        self.tower = load_vision_backend(cfg, self.device, self.dtype)
        self.transport = Transport(cfg, "encoder")
        self.jobs = self.transport.channel(zmq.ROUTER, self.name, bind=True)
        self.cache = self.transport.channel(zmq.DEALER, "cache", bind=False)
        self.pools = ShmAttachments()
        self.counters = {
            "images_encoded": 0.0,
            "patches_encoded": 0.0,
            "failures": 0.0,
            "batches": 0.0,
            "busy_s": 0.0,  # wall time spent encoding batches
            "queue_wait_s": 0.0,  # summed over jobs: arrival here -> their batch starts
        }
        self.window = CounterWindow(self.counters)
        self.queued: deque[tuple[bytes, EncodeJob, float]] = deque()  # (peer, job, when it arrived)
        self.max_batch_patches = cfg.encoder.max_batch_patches
        # Only where forwards run asynchronously: on the CPU a batch queued first would only delay the last one.
        self.overlap = self.device.type == "cuda"
        self.in_flight: Launched | None = None
        self.loop = EventLoop()
        self.loop.exit_if_stalled(cfg.liveness.stall_exit_s, self.name)
        self.loop.on_message(self.jobs, self.handle)
        self.loop.every(REPORT_EVERY_S, self.report)
        log.info(
            "%s ready on %s (%s, %s backend) in %.1fs at %s",
            self.name,
            self.device,
            self.dtype,
            cfg.encoder.backend,
            time.monotonic() - started,
            self.jobs.address,
        )

    def run(self) -> None:
        try:
            self.loop.run(self.step)
        finally:
            self.jobs.close()
            self.cache.close()

    def status(self) -> WorkerStatus:
        return WorkerStatus("encoder", self.name, self.incarnation, self.cfg.encoder.credits)

    def handle(self, peer: bytes, msg: Message) -> None:
        match msg:
            case Ping():
                self.jobs.send_to(peer, self.status())
            case EncodeJob() if problem := job_problem(msg):
                # (no CacheCommit: a job that is not the fetcher's own must not fail the entry it names)
                log.warning("refusing encode job %r from %r: %s", msg.job_id, peer, problem)
                self.jobs.send_to(peer, EncodeResult(msg.job_id, msg.content_hash, 400, problem))
            case EncodeJob():
                self.queued.append((peer, msg, time.monotonic()))
            case StatsRequest(call_id=c):
                stats = {
                    **self.counters,
                    "jobs_queued": float(len(self.queued)),
                    "security_denied": float(self.transport.security.denied),
                }
                self.jobs.send_to(peer, StatsResult(c, self.name, self.incarnation, stats))
            case _:
                log.warning("unexpected %s", msg.TAG)

    def step(self) -> bool:
        """Launch one batch of the queued jobs and hand out the last one's rows; True while work remains."""
        if not self.queued and self.in_flight is None:
            return False
        started = time.monotonic()
        launched = self.launch(self.take_batch()) if self.queued else None
        if self.in_flight is not None:
            self.deliver(self.in_flight)
        self.in_flight = launched
        if not self.overlap and self.in_flight is not None:
            self.deliver(self.in_flight)
            self.in_flight = None
        self.counters["busy_s"] += time.monotonic() - started
        return bool(self.queued) or self.in_flight is not None

    def launch(self, batch: list[tuple[bytes, EncodeJob, float]]) -> Launched:
        """The batch's forward and its copies toward the slots, queued on the device (run, on the CPU)."""
        started = time.monotonic()
        self.counters["queue_wait_s"] += sum(started - arrived for _, _, arrived in batch)
        outputs = self.encode_batch([job for _, job, _ in batch])
        staged = [self.stage(peer, job, out) for (peer, job, _), out in zip(batch, outputs, strict=True)]
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return Launched(staged, done)

    def deliver(self, launched: Launched) -> None:
        """Once the batch's copies are done: the rows into their host slots, the cache told, the peers answered."""
        if launched.done is not None:
            launched.done.synchronize()
        for item in launched.staged:
            self.jobs.send_to(item.peer, self.finish(item))
        for peer in {item.peer for item in launched.staged}:
            self.jobs.send_to(peer, self.status())

    def report(self) -> None:
        """A line per period with work: how busy the encoder was and how long jobs waited for it, which
        tells an encoder that is the bottleneck from one that is starved."""
        seconds, grew = self.window.take()
        if grew["images_encoded"]:
            log.info(
                "%s: %d images (%d patches) in %d batches over %.1fs, busy %.0f%%, jobs waited %.0f ms on average",
                self.name,
                grew["images_encoded"],
                grew["patches_encoded"],
                grew["batches"],
                seconds,
                100 * grew["busy_s"] / seconds,
                1e3 * grew["queue_wait_s"] / grew["images_encoded"],
            )

    def take_batch(self) -> list[tuple[bytes, EncodeJob, float]]:
        """Oldest first, while the patches fit the budget (the first job always goes, whatever its size)."""
        batch, patches = [], 0
        while self.queued:
            size = job_patches(self.queued[0][1])
            if batch and patches + size > self.max_batch_patches:
                break
            batch.append(self.queued.popleft())
            patches += size
        return batch

    def encode_batch(self, jobs: list[EncodeJob]) -> list[torch.Tensor | Exception]:
        """Each job's embeddings (on the tower's device, maybe still being computed), or why it failed."""
        if len(jobs) > 1:
            try:
                pixels = [model_pixels(job, self.device, self.tower.spec.in_chans) for job in jobs]
                embeds = encode_images(self.tower, pixels, [job.grid_thw for job in jobs])
            except Exception:  # a bad job (or a failure the batch caused): find out which, one by one
                log.exception("a batch of %d images failed; encoding them one by one", len(jobs))
            else:
                self.counters["batches"] += 1
                return list(embeds)
        return [self.encode(job) for job in jobs]

    def encode(self, job: EncodeJob) -> torch.Tensor | Exception:
        try:
            pixels = model_pixels(job, self.device, self.tower.spec.in_chans)
            (embeds,) = encode_images(self.tower, [pixels], [job.grid_thw])
        except Exception as exc:  # one bad job must not take the encoder down
            return exc
        self.counters["batches"] += 1
        return embeds

    def stage(self, peer: bytes, job: EncodeJob, out: torch.Tensor | Exception) -> Staged:
        """The job's slot checked and its rows sent toward it: into a GPU slot at once (queued after the
        forward), toward a host slot as a copy into pinned memory, to be finished by `finish`."""
        if isinstance(out, Exception):
            return Staged(peer, job, error=out)
        try:
            if tuple(job.slot.shape) != tuple(out.shape):
                raise ValueError(f"slot shape {job.slot.shape} != embedding shape {list(out.shape)}")
            rows = out.to(torch_dtype(job.slot.dtype))
            if job.by_value:  # (to the host, sent back by `finish`)
                return Staged(peer, job, host_rows=rows.to("cpu", non_blocking=True) if rows.is_cuda else rows)
            if job.slot.shm_name not in self.pools.pools:
                self.pools.forget_except("")  # a restarted cache daemon made a new pool; drop the old map
            slot = self.pools.view(job.slot)
            if slot.is_cuda or not rows.is_cuda:
                slot.copy_(rows)
                return Staged(peer, job, slot)
            # Non-blocking into pinned memory: the host goes on (to the next batch) while the rows come over.
            return Staged(peer, job, slot, host_rows=rows.to("cpu", non_blocking=True))
        except Exception as exc:
            return Staged(peer, job, error=exc)

    def finish(self, item: Staged) -> EncodeResult:
        """After the batch's copies: the rows in the job's slot and the cache told, or (``by_value``) the rows in
        the result."""
        job, slot = item.job, item.slot
        if item.error is not None or (slot is None and item.host_rows is None):
            return self.fail(job, item.error or RuntimeError("no slot was staged"))
        rows = None
        try:
            if job.by_value:
                rows = inline_ref(item.host_rows)
            elif item.host_rows is not None:
                slot.copy_(item.host_rows)
            elif slot.is_cuda and slot.device != self.device:
                # A GPU pool: the rows must be there before the cache says they are. On the tower's own
                # device the batch's `done` event (recorded after these copies, synchronized by `deliver`)
                # says so; a device-wide sync there would also wait for the next batch's forward, queued by
                # now. From another device (or a CPU tower), sync the pool's device.
                torch.cuda.synchronize(slot.device)
        except Exception as exc:
            return self.fail(job, exc)
        self.counters["images_encoded"] += 1
        self.counters["patches_encoded"] += job_patches(job)
        if job.commit and not job.by_value:  # (a job by value: its fetcher commits the entry)
            self.cache.send(commit_for(job.content_hash, job.slot))
        return EncodeResult(job.job_id, job.content_hash, rows=rows)

    def fail(self, job: EncodeJob, exc: Exception) -> EncodeResult:
        log.error("encode job %s failed: %r", job.job_id, exc)
        self.counters["failures"] += 1
        if job.commit and not job.by_value:  # (a job by value: its fetcher fails the entry)
            self.cache.send(commit_for(job.content_hash, job.slot, str(exc) or type(exc).__name__))
        return EncodeResult(job.job_id, job.content_hash, status=500, message=f"vision encoder failed: {exc}")


def model_pixels(job: EncodeJob, device: torch.device, channels: int) -> torch.Tensor:
    """The job's pixel values on ``device``: float pixels as sent, uint8 patches moved first (a quarter of
    the bytes) and then rescaled and normalised there, bit-identical to the processor's host arithmetic."""
    pixels = read_tensor(job.pixels)
    if pixels.dtype != torch.uint8:
        return upload(pixels, device)
    if job.image_mean and not len(job.image_mean) == len(job.image_std) == channels:
        raise ValueError(
            f"uint8 pixels need one mean and std per channel ({channels}), got {job.image_mean} and {job.image_std}"
        )
    norm = Normalization(job.rescale_factor, tuple(job.image_mean) or None, tuple(job.image_std) or None)
    return normalize_patches(upload(pixels, device), norm)


def job_problem(job: EncodeJob) -> str:
    """Why ``job`` cannot be queued ("" if nothing): a grid that is not three positive sizes (batches are
    planned from the grid before any pixel is read; pixels that do not fit it fail in the batch, alone)."""
    grid = job.grid_thw
    if len(grid) != 3 or min(grid) < 1:
        return f"grid_thw must be three positive sizes, got {grid}"
    return ""


def job_patches(job: EncodeJob) -> int:
    t, h, w = job.grid_thw
    return t * h * w


def encode_images(tower: VisionBackend, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
    """Embeddings of several images (or videos) in one forward, one tensor each: [t*h*w / merge², hidden]
    (or [1 + K, t*h*w / merge², hidden] with DeepStack).

    Attention never crosses an image (the tower's segments are per frame), so each image's rows equal
    what encoding it alone gives, up to the float rounding of batched matrix products."""
    merge = tower.spec.spatial_merge_size
    flat = torch.cat([upload(p, tower.device).to(tower.dtype) for p in pixels])
    grid = torch.tensor(grids, dtype=torch.int64)  # the towers read it on the host (no device round trip)
    with torch.inference_mode():
        embeds = tower(flat, grid)
    # Rows are the second-last axis: a tower with DeepStack (Qwen3-VL) gives [1 + K, rows, hidden], each
    # item's slice of it one cache entry.
    return list(embeds.split([t * h * w // merge**2 for t, h, w in grids], dim=-2))
