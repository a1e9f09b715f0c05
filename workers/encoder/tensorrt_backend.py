"""TensorRT backend of the vision tower: an engine built from the ONNX export, cached on disk.

Written against TensorRT 10's Python API (``tensorrt``: Builder, OnnxParser, an optimization profile for
the dynamic patch count, ``build_serialized_network``; at run time ``Runtime.deserialize_cuda_engine``,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``). TensorRT cannot be installed on the
machines this project is developed and tested on (NVIDIA's wheels need a CUDA host and are not on the
package index these machines reach), so this module has never run: its test is skipped with that reason.

The engine cache key is everything that changes the engine: the ONNX file's bytes, TensorRT's version,
the GPU, the precision and the profile's patch range. The ONNX graph takes host-computed rotary tables and
segment ids (see `onnx_backend`); the engine runs in bf16 where the GPU has it (``BuilderFlag.BF16``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from workers.encoder.onnx_backend import INPUT_NAMES, OUTPUT_NAME, _require, host_inputs
from workers.models.spec import VisionSpec
from workers.models.vision import VisionTower

WORKSPACE_BYTES = 4 << 30


def engine_key(onnx_path: Path, trt_version: str, gpu: str, precision: str, patches: tuple[int, int, int]) -> str:
    digest = hashlib.sha256()
    with open(onnx_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    digest.update(json.dumps([trt_version, gpu, precision, list(patches)]).encode())
    return digest.hexdigest()[:16]


def patch_profile(spec: VisionSpec, max_patches: int) -> tuple[int, int, int]:
    """(min, opt, max) patch counts: one merge window, a 640x480 image's worth, the batch budget."""
    smallest = spec.spatial_merge_size**2
    return smallest, min(max_patches, 1600), max(max_patches, smallest)


class TensorRTVisionEncoder:
    """Called like `VisionTower.forward`; returns fp32 embeddings on its CUDA device."""

    def __init__(
        self,
        onnx_path: Path,
        cache_dir: Path,
        spec: VisionSpec,
        device: torch.device,
        *,
        max_patches: int,
        precision: str = "bf16",
    ) -> None:
        trt = _require("tensorrt", "tensorrt (NVIDIA's wheel matching this host's CUDA)")
        if device.type != "cuda":
            raise RuntimeError("the tensorrt vision backend needs a CUDA device; use backend = 'torch' here")
        self.spec, self._device = spec, device
        self.logger = trt.Logger(trt.Logger.WARNING)
        profile = patch_profile(spec, max_patches)
        gpu = torch.cuda.get_device_name(device)
        path = cache_dir / f"vision-{engine_key(onnx_path, trt.__version__, gpu, precision, profile)}.engine"
        if not path.exists():
            write_atomically(path, build_engine(trt, self.logger, onnx_path, spec, profile, precision))
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load the engine {path}; delete it to rebuild")
        self.context = self.engine.create_execution_context()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the graph's inputs; BF16 is used inside the engine

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = VisionTower._validate(self, pixel_values, grid_thw)  # type: ignore[arg-type]
        inputs = (pixel_values, *host_inputs(self.spec, grid))
        feeds = [t.to(self._device).contiguous() for t in inputs]
        feeds[0] = feeds[0].float()
        for name, tensor in zip(INPUT_NAMES, feeds, strict=True):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        rows = pixel_values.shape[0] // self.spec.spatial_merge_size**2
        out = torch.empty((rows, self.spec.out_hidden_size), dtype=torch.float32, device=self._device)
        self.context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        stream = torch.cuda.current_stream(self._device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT failed to run the vision engine")
        stream.synchronize()  # the feeds must outlive the launch
        return out


def build_engine(
    trt: Any, logger: Any, onnx_path: Path, spec: VisionSpec, profile: tuple[int, int, int], precision: str
) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    elif precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    shapes = builder.create_optimization_profile()
    low, opt, high = profile
    widths = {"pixel_values": spec.patch_dim, "cos": spec.head_dim, "sin": spec.head_dim}
    for name in INPUT_NAMES:
        tail = (widths[name],) if name in widths else ()
        shapes.set_shape(name, (low, *tail), (opt, *tail), (high, *tail))
    config.add_optimization_profile(shapes)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see its log above)")
    return bytes(serialized)


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(staging, path)
