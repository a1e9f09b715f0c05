"""Device and dtype choice shared by the encoder and the decoder (they must agree on dtype)."""

from __future__ import annotations

import torch

from common.config import Config
from common.topology import encoder_count, model_dtype_name


def encoder_gpu(cfg: Config, index: int) -> int:
    """The GPU that encoder ``index`` runs on: its entry of ``[encoder] gpus``, else ``index`` itself. A listed
    GPU must exist (a typo must not quietly put the encoder on the decoder's GPU); ``index`` wraps round robin."""
    gpus = cfg.encoder.gpus
    if not gpus:
        return index
    if index >= len(gpus):
        raise ValueError(f"encoder {index}: [encoder] gpus = {gpus} lists only {len(gpus)} encoders")
    gpu = gpus[index]
    device = resolve_device(cfg)
    if device.type == "cuda" and gpu >= torch.cuda.device_count():
        raise ValueError(f"[encoder] gpus names GPU {gpu} but {torch.cuda.device_count()} are visible")
    return gpu


def resolve_device(cfg: Config, gpu: int = 0) -> torch.device:
    choice = cfg.model.device
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("[model] device = 'cuda' but no CUDA device is visible")
        # More encoders than GPUs ([encoder] count) share them round robin (e.g. under MPS).
        return torch.device("cuda", gpu % torch.cuda.device_count())
    return torch.device(choice)


GPU_PROCESS_CPU_THREADS = 2


def claim_device(cfg: Config, gpu: int = 0, vision: bool = False) -> torch.device:
    """The device a GPU process (encoder, decoder rank) works on, made ready for it: on CUDA it becomes
    the current device (Triton and NCCL launch there, not on cuda:0), and torch's CPU ops get
    ``GPU_PROCESS_CPU_THREADS`` threads. Such a process's CPU tensors are bookkeeping (positions, masks,
    embeddings to upload): an OpenMP team of every core per small op costs more than it saves, and its
    spinning threads take cores from the fetcher, the gateway and the other GPU processes on the host.
    On a CPU host the model runs on the CPU, so torch keeps its default threads there.
    With ``[encoder] sm_split`` on a GPU shared by vision work and a text decoder, the process is confined to its
    side of the split (``vision``: an encoder, or a media-only replica)."""
    device = resolve_device(cfg, gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_num_threads(GPU_PROCESS_CPU_THREADS)
        if cfg.encoder.sm_split and device.index in split_gpus(cfg, torch.cuda.device_count()):
            from workers.models.sm_partition import confine

            confine(device, cfg.encoder.sm_split, "rest" if vision else "first")
    return device


def check_sm_split(cfg: Config) -> None:
    """Before anything starts: ``[encoder] sm_split`` must leave SMs on both sides of each GPU it splits (else
    every process there would fail at start, and supervisord would restart them for ever)."""
    for gpu in sorted(split_gpus(cfg, torch.cuda.device_count())):
        total = torch.cuda.get_device_properties(gpu).multi_processor_count
        if not 0 < cfg.encoder.sm_split < total:
            raise ValueError(
                f"[encoder] sm_split = {cfg.encoder.sm_split} leaves no SMs for the vision side of GPU {gpu}, "
                f"which has {total}; choose fewer (docs/isolation.md)"
            )


def split_gpus(cfg: Config, visible: int) -> set[int]:
    """The GPUs that ``[encoder] sm_split`` splits (of ``visible`` GPUs): an encoder's that a replica taking text
    also runs on."""
    text = cfg.decoder_gpus(r for r in range(cfg.decoder.replicas) if cfg.takes_text(r))
    return {encoder_gpu(cfg, k) % visible for k in range(encoder_count(cfg))} & text


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """Embeddings and activations dtype: float32 on CPU (exact parity), bfloat16 on GPUs (`model_dtype_name`)."""
    return getattr(torch, model_dtype_name(cfg, device.type))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without making the host wait for the work already queued there: a plain copy
    from pageable memory to a GPU waits for the stream to drain, which would serialise the decoder's
    sampling, or a step staged ahead, with the forward launched before it, and an encoder's next batch
    with the last one. Pinned first, then copied asynchronously (torch's host allocator keeps the pinned
    block until the copy is done). A tensor on a GPU already is only moved, if at all."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
