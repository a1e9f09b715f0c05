"""The encoder packs queued images of several requests into one forward: each job still gets exactly its
own embeddings (parity with encoding it alone), and a bad job fails alone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from common.config import Config
from common.protocol import EncodeJob, EncodeResult, TensorRef, WorkerStatus
from common.tensor_ref import ShmPool, inline_ref
from common.transport import Channel
from workers.encoder.worker import EncoderWorker, encode_images
from workers.models.synth import generate_checkpoint
from workers.models.vision import VisionTower

GRIDS = [[1, 4, 4], [1, 6, 8], [2, 4, 6], [1, 2, 2]]  # an image, a larger one, a 2-frame video, a tiny one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("encoder") / "tiny", "tiny", seed=5)


def pixels_for(tower: VisionTower, grid: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], tower.spec.patch_dim, generator=generator)


def test_a_batch_gives_each_image_its_own_embeddings(checkpoint: Path) -> None:
    tower = VisionTower.from_checkpoint(checkpoint, dtype=torch.float32)
    pixels = [pixels_for(tower, g, seed=i) for i, g in enumerate(GRIDS)]
    together = encode_images(tower, pixels, GRIDS)
    merge = tower.spec.spatial_merge_size
    for image, grid, rows in zip(pixels, GRIDS, together, strict=True):
        (alone,) = encode_images(tower, [image], [grid])
        assert rows.shape == (grid[0] * grid[1] * grid[2] // merge**2, tower.spec.out_hidden_size)
        # Same rows up to the rounding of batched matrix products (fp32): far below any image's signal.
        torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-5)


@pytest.fixture
def worker(checkpoint: Path, tmp_path: Path) -> Iterator[EncoderWorker]:
    cfg = Config()
    cfg.model.path = str(checkpoint)
    cfg.model.dtype = "float32"
    cfg.run_dir = str(tmp_path)
    cfg.encoder.max_batch_patches = 200  # GRIDS hold 16 + 48 + 48 + 4 patches: the budget cuts the queue of 8
    encoder = EncoderWorker(cfg, 0)
    yield encoder
    encoder.jobs.close()
    encoder.cache.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["one_batch_at_a_time", "next_batch_queued_first"])
def test_the_worker_batches_queued_jobs_over_its_socket(worker: EncoderWorker, overlap: bool) -> None:
    """Jobs sent back to back over the real ZMQ socket are encoded in few forwards (the patch budget
    splits them), each slot gets that image's rows, and a job whose pixels do not match its grid fails
    alone with a 500 while the others of its batch succeed. With overlap (a GPU's default is off; forced
    here on the CPU, where launching is computing) each step launches a batch before delivering the last."""
    worker.overlap = overlap
    tower, merge = worker.tower, worker.tower.spec.spatial_merge_size
    jobs_grids = [*GRIDS, *GRIDS]  # 8 images: 232 patches > the budget of 200
    bad = 5
    pool = ShmPool(f"vlm-test-enc-{os.getpid()}", 1 << 20, create=True)
    client = Channel(worker.transport.ctx, zmq.DEALER, worker.jobs.address, bind=False)
    try:
        expected, offset = [], 0
        for i, grid in enumerate(jobs_grids):
            image = pixels_for(tower, grid, seed=10 + i)
            rows = grid[0] * grid[1] * grid[2] // merge**2
            shape = [rows, tower.spec.out_hidden_size]
            slot = TensorRef("shm", "float32", shape, shm_name=pool.name, offset=offset)
            offset += rows * tower.spec.out_hidden_size * 4
            sent = image[:-1] if i == bad else image  # one patch short of its grid
            client.send(EncodeJob(f"job{i}", f"hash{i}", inline_ref(sent), grid, slot))
            expected.append((slot, None if i == bad else encode_images(tower, [image], [grid])[0]))
        results: dict[str, EncodeResult] = {}
        deadline = time.monotonic() + 30
        while len(worker.queued) < len(jobs_grids):  # every job in the queue before the first step, as
            assert time.monotonic() < deadline, f"only {len(worker.queued)} jobs arrived"  # the counts assume
            worker.loop.run_once(max_wait_s=1.0)
        while len(results) < len(jobs_grids):
            worker.loop.run_once(max_wait_s=5.0)
            while worker.step():
                pass
            while client.sock.poll(100):
                _, msg = client.recv()
                if isinstance(msg, EncodeResult):
                    results[msg.job_id] = msg
                else:
                    assert isinstance(msg, WorkerStatus)
        for i, (slot, rows) in enumerate(expected):
            result = results[f"job{i}"]
            if rows is None:
                assert result.status == 500 and "patches" in result.message, result
                continue
            assert result.status == 200, result
            torch.testing.assert_close(pool.view(slot), rows, rtol=1e-5, atol=1e-5)
        counters = worker.counters
        assert counters["images_encoded"] == len(jobs_grids) - 1 and counters["failures"] == 1
        # The budget cuts the queue after job 5 (16+48+48+4+16+48 = 180 patches; job 6 would make 228).
        # That batch failed on job 5 and was redone one by one (5 forwards succeed, job 5 fails again);
        # jobs 6 and 7 ran as one forward.
        assert counters["batches"] == 5 + 1, counters
    finally:
        client.close()
        pool.close()
        pool.unlink()


def test_uint8_jobs_are_normalised_on_the_encoder_and_bad_stats_refused() -> None:
    """A uint8 job carries the processor's rescale and per-channel stats; the encoder's pixel values are
    the host's float32 ones bit for bit, and stats that do not fit the channels are an error, not a guess."""
    from workers.encoder.worker import model_pixels
    from workers.fetcher.image import ImageProcessorSpec, image_patches, preprocess_image

    spec = ImageProcessorSpec(min_pixels=56 * 56, max_pixels=112 * 112)
    generator = torch.Generator().manual_seed(3)
    picture = torch.randint(0, 256, (90, 120, 3), dtype=torch.uint8, generator=generator).numpy()
    from PIL import Image

    image = Image.fromarray(picture)
    patches, grid = image_patches(image, spec)
    expected, _ = preprocess_image(image, spec)
    slot = TensorRef("shm", "float32", [1, 1], shm_name="unused")
    mean, std = list(spec.image_mean), list(spec.image_std)
    job = EncodeJob("j", "h", inline_ref(torch.from_numpy(patches)), list(grid), slot, spec.rescale_factor, mean, std)
    assert torch.equal(model_pixels(job, torch.device("cpu"), 3), torch.from_numpy(expected))
    bad = EncodeJob("j", "h", job.pixels, list(grid), slot, spec.rescale_factor, mean[:2], std[:2])
    with pytest.raises(ValueError, match="one mean and std per channel"):
        model_pixels(bad, torch.device("cpu"), 3)


def test_a_video_in_chunks_of_frames_gives_the_whole_videos_rows(checkpoint: Path) -> None:
    """The fetcher's split of a long video (`frame_chunks`): frames [a, b) encoded alone give exactly
    the rows those frames get in the whole video, so the parts can land in one slot side by side."""
    from workers.fetcher.worker import frame_chunks

    assert frame_chunks([5, 4, 6], 48) == [(0, 2), (2, 4), (4, 5)]
    assert frame_chunks([3, 8, 8], 10) == [(0, 1), (1, 2), (2, 3)]  # a frame over the budget still goes
    assert frame_chunks([2, 4, 4], 10_000) == [(0, 2)]
    tower = VisionTower.from_checkpoint(checkpoint, dtype=torch.float32)
    grid = [5, 4, 6]
    video = pixels_for(tower, grid, seed=21)
    (whole,) = encode_images(tower, [video], [grid])
    frame = grid[1] * grid[2]
    parts = [video[a * frame : b * frame] for a, b in frame_chunks(grid, 48)]
    chunked = encode_images(tower, parts, [[len(p) // frame, 4, 6] for p in parts])
    torch.testing.assert_close(torch.cat(chunked), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grid", [[], [1, 4], [1, 0, 4], [1, -4, 4]])
def test_a_job_whose_grid_is_not_three_positive_sizes_is_refused_on_arrival(
    worker: EncoderWorker, grid: list[int]
) -> None:
    """(such a job was queued and the next step, planning the batch from its grid, ended the encoder: found by
    tests/integration/test_fuzz_zmq.py)"""
    client = Channel(worker.transport.ctx, zmq.DEALER, worker.jobs.address, bind=False)
    try:
        slot = TensorRef("shm", "float32", [4, 8], shm_name="vlm-nope")
        client.send(EncodeJob("job", "hash", inline_ref(torch.zeros(4, 8)), grid, slot))
        deadline = time.monotonic() + 30
        while not client.sock.poll(100):
            assert time.monotonic() < deadline, "no answer"
            worker.loop.run_once(max_wait_s=0.5)
            worker.step()
        _, answer = client.recv()
        assert isinstance(answer, EncodeResult) and answer.status == 400 and "grid_thw" in answer.message, answer
        assert not worker.queued and not worker.step()
    finally:
        client.close()
