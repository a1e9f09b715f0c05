"""What a deployment left at "auto" becomes on the GPUs it has: where the decoder replicas and the encoders run,
and whether the embedding pool lives on the GPU.

`common.config.load_config` applies these rules in every process, so all of them agree: the launcher
(`ops.deploy`) counts the GPUs once and hands the count to every program (``VLM_GPU_COUNT``); a process
started by hand counts them without torch. Each rule returns the line the launcher prints, naming the rule and
the setting that overrides it. A setting written in the config file always wins: the placement rule fills
nothing once any placement key is set (a half-automatic placement would be a layout nobody measured).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from common.config import Config

# Keys a config file may leave out or set to "auto" (section.key); the others have plain defaults.
PLACEMENT_KEYS = (
    "decoder.replicas",
    "decoder.text_replicas",
    "decoder.media_replicas",
    "decoder.replica_gpus",
    "encoder.gpus",
    "encoder.count",
)
AUTO_KEYS = frozenset({*PLACEMENT_KEYS, "cache.device_pool", "cache.spill_bytes", "cache.pool_bytes"})
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def gpu_count(cfg: Config, env: Mapping[str, str], driver_gpus: Path = NVIDIA_GPUS) -> int:
    """The GPUs the model runs on, without torch: the launcher's count (``VLM_GPU_COUNT``), else
    ``CUDA_VISIBLE_DEVICES``' entries, else the driver's GPUs; 0 with ``[model] device = "cpu"``, 1 with one named
    device (``cuda:N``)."""
    device = cfg.model.device
    if device == "cpu":
        return 0
    if env.get("VLM_GPU_COUNT", "").isdigit():
        count = int(env["VLM_GPU_COUNT"])
    elif "CUDA_VISIBLE_DEVICES" in env:
        entries = [entry.strip() for entry in env["CUDA_VISIBLE_DEVICES"].split(",")]
        # (CUDA stops at the first invalid entry: "-1" or "" hide every GPU)
        count = next((i for i, entry in enumerate(entries) if not entry or entry.startswith("-")), len(entries))
    else:
        count = len(list(driver_gpus.iterdir())) if driver_gpus.is_dir() else 0
    return min(count, 1) if device.startswith("cuda:") else count


def resolve(cfg: Config, gpus: int) -> list[str]:
    """Fill what ``cfg.auto`` names for a host of ``gpus`` GPUs; the lines that say what was chosen and why."""
    return [place(cfg, gpus), device_pool(cfg, gpus), sm_split(cfg, gpus)]


def place(cfg: Config, gpus: int) -> str:
    """Where the replicas and encoders run. One GPU: one decoder and one encoder share it. Two or more: the
    text streams get GPU 0 to themselves (replica 0 takes text only), and a media replica with the encoders
    take the others (replica 1 on GPU 1, an encoder on each of GPUs 1..N-1): the vision work never runs on
    the text streams' GPU, which kept them near their throughput without image load."""
    decoder, encoder = cfg.decoder, cfg.encoder
    override = "set [decoder] replicas / [encoder] gpus to override"
    set_by_hand = [key for key in PLACEMENT_KEYS if key not in cfg.auto]
    if set_by_hand:
        section, _, key = set_by_hand[0].partition(".")
        return f"layout: as configured ([{section}] {key} is set: the auto layout fills nothing)"
    if gpus == 0:
        return "layout: no GPU -> one decoder and one encoder on the CPU (auto)"
    if decoder.tensor_parallel > 1:
        return (
            f"layout: tensor_parallel = {decoder.tensor_parallel} -> one replica on GPUs "
            f"0..{decoder.tensor_parallel - 1}, an encoder on each GPU (auto: no layout beyond that with tensor "
            f"parallelism; {override})"
        )
    if gpus == 1:
        return f"layout: 1 GPU -> one decoder and one encoder share GPU 0 (auto; {override})"
    decoder.replicas, decoder.text_replicas, decoder.media_replicas = 2, [0], [1]
    decoder.replica_gpus = []  # replica r on GPU r
    encoder.gpus = list(range(1, gpus))
    encoders = "GPU 1" if gpus == 2 else f"GPUs 1..{gpus - 1}"
    return (
        f"layout: {gpus} GPUs -> text decoder on GPU 0, media decoder on GPU 1 and encoders on {encoders} "
        f"(auto: vision on its own GPUs; {override})"
    )


def device_pool(cfg: Config, gpus: int) -> str:
    """The embedding pool on GPU 0 (CUDA IPC) wherever a GPU runs one decoder replica: it measured no slower
    than the host pool and saves the trip through the host. Replicas on other GPUs cannot read GPU 0's pool."""
    cache = cfg.cache
    if "cache.device_pool" not in cfg.auto:
        return f"embedding pool: {'GPU' if cache.device_pool else 'host'} ([cache] device_pool = {cache.device_pool})"
    cache.device_pool = gpus > 0 and cfg.decoder.replicas == 1
    if gpus == 0:
        return "embedding pool: host shared memory (auto: no GPU)"
    if cfg.decoder.replicas > 1:
        return "embedding pool: host shared memory (auto: decoder replicas read it from their own GPUs)"
    return "embedding pool: GPU 0, by CUDA IPC (auto: a GPU and one decoder replica; [cache] device_pool = false: host)"


def sm_split(cfg: Config, gpus: int) -> str:
    """``[encoder] sm_split`` has no auto value: it raised the text streams' share on one GPU, but what it costs
    image throughput is not measured, so it is off unless set."""
    if cfg.encoder.sm_split:
        return f"SM split: text replica on the first {cfg.encoder.sm_split} SMs ([encoder] sm_split)"
    if gpus == 1:
        return "SM split: off (its cost to image throughput is not measured; [encoder] sm_split = N to split)"
    return "SM split: off"
