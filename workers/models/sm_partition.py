"""A GPU process confined to one part of its GPU's SMs: a CUDA green context (the driver API, through ctypes).

Under MPS the encoders and the decoder run at once on one GPU, but MPS's active-thread percentage caps how many
SMs a client's work may take, not which: capped clients still meet on the same SMs, and a decode step's kernels
wait there for the ViT's blocks to drain, whatever its cap or priority (docs/isolation.md). The driver splits a GPU's
SMs the same way in every process, so a process that takes the
first ``count`` SMs of a split and one that takes the rest of the same split run on disjoint SMs.

This GPU's driver has no MPS static partitions (`nvidia-cuda-mps-control -S` needs CUDA 13.1's MPS), the other
way to get disjoint SMs across processes.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Literal

import torch

log = logging.getLogger(__name__)

Side = Literal["first", "rest"]

_SM_RESOURCE = 1  # CU_DEV_RESOURCE_TYPE_SM
_RESOURCE_BYTES = 512  # a CUdevResource: 144-152 bytes from CUDA 12.4 to 13.x; room to spare
_SM_COUNT_AT = 96  # its smCount: after the type (4 bytes) and 92 bytes of padding
_GREEN_CTX_DEFAULT_STREAM = 1
_STREAM_NON_BLOCKING = 1


class SmPartitionError(RuntimeError):
    pass


def confine(device: torch.device, count: int, side: Side) -> int:
    """Run this thread's CUDA work (torch's, cuBLAS', Triton's, CUDA graphs') on the first ``count`` SMs of
    ``device`` or on the rest of them: a green context over those SMs becomes current, with a stream of its own as
    torch's current stream. Call it once, before the process builds anything on the device. Returns the SMs it has.
    """
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the primary context, which a green context keeps alive, is up

    def check(what: str, status: int) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(status, ctypes.byref(name))
            raise SmPartitionError(f"{what} failed: {(name.value or b'?').decode()} ({status})")

    handle = ctypes.c_int()
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(handle), device.index or 0))
    whole, first, rest = (ctypes.create_string_buffer(_RESOURCE_BYTES) for _ in range(3))
    check("cuDeviceGetDevResource", cuda.cuDeviceGetDevResource(handle, whole, _SM_RESOURCE))
    groups = ctypes.c_uint(1)
    check(
        f"splitting the SMs at {count}",
        cuda.cuDevSmResourceSplitByCount(first, ctypes.byref(groups), whole, rest, 0, ctypes.c_uint(count)),
    )
    chosen = first if side == "first" else rest
    sms = int.from_bytes(chosen.raw[_SM_COUNT_AT : _SM_COUNT_AT + 4], "little")
    if groups.value != 1 or sms == 0:
        raise SmPartitionError(f"the GPU's SMs do not split at {count}: the {side} part would have {sms}")
    desc, green, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check("cuDevResourceGenerateDesc", cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), chosen, 1))
    check("cuGreenCtxCreate", cuda.cuGreenCtxCreate(ctypes.byref(green), desc, handle, _GREEN_CTX_DEFAULT_STREAM))
    check("cuCtxFromGreenCtx", cuda.cuCtxFromGreenCtx(ctypes.byref(context), green))
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
    check("cuGreenCtxStreamCreate", cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), green, _STREAM_NON_BLOCKING, 0))
    torch.cuda.set_stream(torch.cuda.ExternalStream(stream.value, device=device))
    log.info("confined to the %s %d SMs of %s (split at %d)", side, sms, device, count)
    return sms
