"""The engine's options, one frozen object: what the scheduler, the model runner and every tensor-parallel
rank are built from. `EngineConfig.from_settings` reads them from the ``[decoder]`` settings; the worker
(rank 0) and `tp.DecoderRank` (ranks 1..w-1) both call it, so their kernels and graphs pair up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import DecoderConfig
from workers.kernels import paged_attention, paged_attention_reference
from workers.models.paged import KV_CACHE_DTYPES, PagedAttention

GRAPH_MODES = ("off", "static", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_running: int
    prefill_budget: int  # tokens computed per step, so running decodes keep moving
    num_blocks: int
    block_size: int
    decoding_budget: int = 0  # the budget while a sequence decodes (0: prefill_budget)
    prefix_cache: bool = True
    # paged_attention: Triton on CUDA tensors, the torch reference elsewhere
    attention: PagedAttention = paged_attention
    # Concatenated projections and the fused norm/activation/rotary/cache kernels (Triton on CUDA).
    fuse: bool = False
    # "cuda" replays steps from CUDA graphs (decode steps up to max_running sequences, mixed prefill/decode
    # steps up to graph_tokens tokens); "static" runs the same static-buffer path eagerly (how it is tested
    # without a GPU); "off" runs every step eagerly.
    graphs: str = "off"
    graph_tokens: int = 0
    # The host schedules and stages step N+1 (and reads step N-1's tokens) while the device runs step N;
    # off, each step's tokens are read as soon as its sampling is launched.
    overlap: bool = False
    # "auto": K/V in the model's dtype; "fp8": float8_e4m3fn with per-(token, kv head) scales
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be 'off', 'static' or 'cuda', got {self.graphs!r}")
        if self.graph_tokens < 0:
            raise ValueError(f"graph_tokens must be >= 0, got {self.graph_tokens}")

    @property
    def step_budget(self) -> int:
        """The budget while a sequence decodes."""
        return self.decoding_budget or self.prefill_budget

    @classmethod
    def from_settings(
        cls,
        settings: DecoderConfig,
        device: torch.device,
        num_blocks: int,
        max_model_len: int,
    ) -> EngineConfig:
        """Triton kernels, fused projections and CUDA graphs on a GPU unless the settings turn them off; the
        plain-torch paths elsewhere (and always with kernels = "torch"). Overlap as ``[decoder] overlap`` says,
        graphs or not: on a CPU it gains nothing, but the CPU's stack tests then run the server's path.
        Every family takes the same paths (Qwen3-VL's q/k norm and DeepStack adds are in the fused layers and
        in the graphs)."""
        triton = settings.kernels == "triton" and device.type == "cuda"
        if triton and settings.kv_cache_dtype == "fp8":  # (the only setting a GPU's capability can refuse)
            check_kv_cache_dtype(settings.kv_cache_dtype, torch.cuda.get_device_capability(device), str(device))
        return cls(
            max_model_len=max_model_len,
            max_running=settings.max_running,
            prefill_budget=settings.prefill_tokens_per_step,
            decoding_budget=settings.tokens_per_step_while_decoding,
            num_blocks=num_blocks,
            block_size=settings.block_size,
            prefix_cache=settings.prefix_cache,
            attention=paged_attention if triton else paged_attention_reference,
            fuse=triton,
            graphs="cuda" if triton and settings.cuda_graphs else "off",
            graph_tokens=settings.graph_tokens,
            overlap=settings.overlap,
            kv_cache_dtype=settings.kv_cache_dtype,
        )


FP8_CACHE_CAPABILITY = (8, 9)  # Triton converts to float8_e4m3fn (float8e4nv) from Ada/Hopper on


def check_kv_cache_dtype(setting: str, capability: tuple[int, int] | None, device: str) -> None:
    """ValueError for ``kv_cache_dtype = "fp8"`` where no path of the device runs it: the Triton kernels (which
    quantize and dequantize the cache) on a CUDA GPU older than sm_89. ``capability``: the GPU's where the Triton
    kernels serve, None where the torch paths do (they run FP8 anywhere)."""
    if setting != "fp8" or capability is None or capability >= FP8_CACHE_CAPABILITY:
        return
    raise ValueError(
        f'[decoder] kv_cache_dtype = "fp8" needs a GPU of compute capability >= 8.9 (Ada, Hopper, ...) for the '
        f"Triton kernels; {device} is {capability[0]}.{capability[1]}. Supported: such GPUs, any GPU with "
        '[decoder] kernels = "torch" (slower), and CPU; or set kv_cache_dtype = "auto"'
    )
