"""The encoder process: one per GPU, runs the vision tower and writes embeddings into cache slots."""

from __future__ import annotations

import logging
import time

import torch
import zmq

from common.config import Config
from common.protocol import CacheCommit, EncodeJob, EncodeResult, Message, Ping, StatsRequest, StatsResult, WorkerStatus
from common.tensor_ref import ShmAttachments, read_tensor, torch_dtype
from common.transport import Channel, EventLoop, worker_identity
from workers.models.runtime import resolve_device, resolve_dtype
from workers.models.vision import VisionTower

log = logging.getLogger(__name__)


class EncoderWorker:
    def __init__(self, cfg: Config, gpu: int) -> None:
        self.cfg = cfg
        self.name = f"encoder.{gpu}"
        self.incarnation, _ = worker_identity(self.name)
        self.device = resolve_device(cfg, gpu)
        self.dtype = resolve_dtype(cfg, self.device)
        started = time.monotonic()
        self.tower = VisionTower.from_checkpoint(cfg.model_path(), device=self.device, dtype=self.dtype)
        self.ctx = zmq.Context()
        self.jobs = Channel(self.ctx, zmq.ROUTER, cfg.endpoint(self.name), bind=True)
        self.cache = Channel(self.ctx, zmq.DEALER, cfg.endpoint("cache"), bind=False)
        self.pools = ShmAttachments()
        self.counters = {"images_encoded": 0.0, "patches_encoded": 0.0, "failures": 0.0}
        self.loop = EventLoop()
        self.loop.on_message(self.jobs, self.handle)
        log.info(
            "%s ready on %s (%s) in %.1fs at %s",
            self.name,
            self.device,
            self.dtype,
            time.monotonic() - started,
            self.jobs.address,
        )

    def run(self) -> None:
        try:
            self.loop.run()
        finally:
            self.jobs.close()
            self.cache.close()

    def status(self) -> WorkerStatus:
        return WorkerStatus("encoder", self.name, self.incarnation, self.cfg.encoder.credits)

    def handle(self, peer: bytes, msg: Message) -> None:
        match msg:
            case Ping():
                self.jobs.send_to(peer, self.status())
            case EncodeJob():
                self.jobs.send_to(peer, self.encode(msg))
                self.jobs.send_to(peer, self.status())
            case StatsRequest(call_id=c):
                self.jobs.send_to(peer, StatsResult(c, self.name, self.incarnation, dict(self.counters)))
            case _:
                log.warning("unexpected %s", msg.TAG)

    def encode(self, job: EncodeJob) -> EncodeResult:
        try:
            pixels = read_tensor(job.pixels).to(self.device, self.dtype)
            grid = torch.tensor([job.grid_thw], dtype=torch.int64, device=self.device)
            with torch.inference_mode():
                embeds = self.tower(pixels, grid)
            if job.slot.shm_name not in self.pools.pools:
                self.pools.forget_except("")  # a restarted cache daemon made a new pool; drop the old map
            slot = self.pools.view(job.slot)
            if tuple(slot.shape) != tuple(embeds.shape):
                raise ValueError(f"slot shape {list(slot.shape)} != embedding shape {list(embeds.shape)}")
            slot.copy_(embeds.to(torch_dtype(job.slot.dtype)).cpu())
        except Exception as exc:  # one bad job must not take the encoder down
            log.exception("encode job %s failed", job.job_id)
            self.counters["failures"] += 1
            self.cache.send(CacheCommit(job.content_hash, error=str(exc) or type(exc).__name__))
            return EncodeResult(job.job_id, job.content_hash, status=500, message=f"vision encoder failed: {exc}")
        self.counters["images_encoded"] += 1
        self.counters["patches_encoded"] += pixels.shape[0]
        self.cache.send(CacheCommit(job.content_hash))
        return EncodeResult(job.job_id, job.content_hash)
