"""Triton kernels for the decoder, each beside the plain-torch reference it is checked against.

Every kernel ``name`` has three entry points: ``name(...)`` dispatches to Triton on CUDA tensors (when
triton is installed) and to ``name_reference(...)`` otherwise; ``name_triton(...)`` always launches the
kernel, which on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported).
The Triton code lives in the ``*_triton`` modules, imported only on first launch, so that importing this
package never needs triton.
"""

from workers.kernels.activation import silu_and_mul, silu_and_mul_reference
from workers.kernels.attention import (
    AttentionMetadata,
    attention_metadata,
    paged_attention,
    paged_attention_reference,
)
from workers.kernels.cache import reshape_and_cache, reshape_and_cache_reference
from workers.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference
from workers.kernels.rotary import (
    apply_mrope,
    apply_mrope_reference,
    apply_qk_norm_mrope,
    apply_qk_norm_mrope_reference,
)

__all__ = [
    "AttentionMetadata",
    "apply_mrope",
    "apply_mrope_reference",
    "apply_qk_norm_mrope",
    "apply_qk_norm_mrope_reference",
    "attention_metadata",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "paged_attention",
    "paged_attention_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "rms_norm",
    "rms_norm_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]
