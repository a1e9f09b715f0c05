"""How many processes of each kind a deployment runs and which GPUs they share, from the config alone.

The launcher (`ops.deploy`) renders supervisord's programs from these, and the processes use the same answers
at run time (the fetcher dials one socket per encoder, a decoder replica learns whether it runs on the vision
side of its GPU), so they live below both. Torch-free: only counting visible GPUs imports torch, and only on a
host with NVIDIA's driver tools.
"""

from __future__ import annotations

import os
import shutil

from common.config import Config, gpu_count


def encoder_count(cfg: Config) -> int:
    """Encoders to run (or, in a pd unit, encoder endpoints to dial): one per listed GPU, the configured count, or
    one per GPU (`common.config.gpu_count`, torch-free; one on a CPU host, and one endpoint in a pd unit)."""
    if cfg.encoder.gpus:
        return len(cfg.encoder.gpus)
    if cfg.encoder.count:
        return cfg.encoder.count
    if cfg.server.role == "pd":
        return 1
    return max(1, gpu_count(cfg, os.environ))


# The processes a host runs for each `[server] role` (the names are also the CurveZMQ roles, `common.security`).
UNIT_PROCESSES = {
    "all": ("gateway", "fetcher", "encoder", "cache", "decoder"),
    "pd": ("gateway", "fetcher", "cache", "decoder"),
    "encoder": ("encoder",),
}


def unit_processes(cfg: Config) -> tuple[str, ...]:
    return UNIT_PROCESSES[cfg.server.role]


def check_unit(cfg: Config) -> None:
    """A ValueError where a unit of another role could not reach this one's encoders, or these the others': a pd unit
    dials its encoders on other hosts and an encoder unit serves them, both over tcp://."""
    role = cfg.server.role
    if role == "all":
        return
    for k in range(encoder_count(cfg)):
        address = cfg.endpoint(f"encoder.{k}")
        if address.startswith("tcp://"):
            continue
        if role == "pd":
            raise ValueError(
                f'[server] role = "pd" runs no vision encoders, and encoder.{k} is {address}: name the encoder '
                f'units\' addresses in [endpoints], "encoder.{k}" = "tcp://HOST:PORT" for each of the [encoder] '
                f"count ({encoder_count(cfg)})"
            )
        raise ValueError(
            f'[server] role = "encoder" serves pd units on other hosts, and encoder.{k} is {address}: bind the '
            'encoders on tcp://, e.g. [endpoints] encoder = "tcp://0.0.0.0:710{gpu}"'
        )


def vision_replicas(cfg: Config) -> frozenset[int]:
    """Media-only decoder replicas that share a GPU with a replica that takes text."""
    text_gpus = cfg.decoder_gpus(r for r in range(cfg.decoder.replicas) if cfg.takes_text(r))
    return frozenset(
        r for r in range(cfg.decoder.replicas) if not cfg.takes_text(r) and cfg.replica_gpu_set(r) & text_gpus
    )


def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 on a host without NVIDIA's driver tools, without importing torch)."""
    if not may_have_gpu():
        return 0
    import torch  # only when the count depends on the hardware

    return torch.cuda.device_count()


def has_gpu() -> bool:
    if not may_have_gpu():
        return False
    import torch  # only where the answer depends on it

    return torch.cuda.is_available()


def may_have_gpu() -> bool:
    """False on a host without NVIDIA's driver tools (as ops/install judges it): there, importing torch to
    ask (2-3 s of every start-up) would only say no."""
    return shutil.which("nvidia-smi") is not None


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype_name(cfg: Config, device_type: str) -> str:
    """Embeddings and activations dtype on a device of ``device_type``: float32 on CPU (exact parity), bfloat16
    on GPUs, unless ``[model] dtype`` names one. The fetcher sizes embeddings by it, the encoder and the decoder
    compute in it (`workers.models.runtime.resolve_dtype`): all must agree."""
    if cfg.model.dtype == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    if cfg.model.dtype not in MODEL_DTYPES:
        raise ValueError(f"[model] dtype must be one of auto, {', '.join(MODEL_DTYPES)}; got {cfg.model.dtype!r}")
    return cfg.model.dtype


def model_device_type(cfg: Config) -> str:
    """The kind of device ("cuda", "cpu") the encoders and decoders run the model on, as
    `workers.models.runtime.resolve_device` picks it."""
    choice = cfg.model.device
    if choice != "auto":
        return choice.partition(":")[0]
    import torch  # only where the answer depends on the hardware

    return "cuda" if torch.cuda.is_available() else "cpu"
