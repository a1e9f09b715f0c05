"""Qwen3-VL dense (``model_type: qwen3_vl``; transformers' ``qwen3_vl`` is the reference).

The vision tower (`workers.models.qwen3_vl_vision`: patch 16, learned position embeddings resampled to each grid,
GELU-tanh MLP) returns the merged embeddings and one DeepStack feature set per ``deepstack_visual_indexes`` entry;
served, it returns them stacked, [1 + K, tokens, hidden], which is how an image's embeddings travel as one cache
entry. The text model (`workers.models.qwen3_vl_text`) is Qwen3's: q/k RMSNorm per head, interleaved M-RoPE,
DeepStack adds after the first K decoder layers. For images the M-RoPE index rule is Qwen2-VL's
(`workers.models.mrope`); a video's temporal steps each come after their timestamp text in the prompt and are
numbered as separate one-step items (`workers.models.mrope.frame_rope_positions`).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from workers.models import qwen3_vl_synth as tables
from workers.models.mrope import frame_rope_positions
from workers.models.qwen3_vl_spec import Qwen3VLSpec
from workers.models.qwen3_vl_text import Qwen3LanguageModel
from workers.models.qwen3_vl_vision import Qwen3VisionTower
from workers.models.registry import Family, SynthTables
from workers.models.spec import ModelSpec
from workers.models.vision import warm_up_forward
from workers.models.weights import CheckpointWeights, checkpoint_root


class StackedVisionTower(Qwen3VisionTower):
    """The tower as the encoder runs it: one tensor [1 + K, rows, hidden] (merged, then each DeepStack set), so
    that an item's rows of every set are one slice along the rows' axis."""

    @classmethod
    def load(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: ModelSpec | None = None,
    ) -> StackedVisionTower:
        # The tower reads its own spec (grid_side, the DeepStack mergers); the served ModelSpec names the same fields.
        own = Qwen3VLSpec.from_dir(checkpoint_root(path))
        return cast(StackedVisionTower, cls.from_checkpoint(path, device, dtype, own))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pixel_values, grid_thw).stacked()

    def tune_attention(self, tokens: int = 4096) -> dict[str, float]:
        """The encoder's hook for choosing SDPA kernels: this tower keeps torch's choice."""
        return {}

    def warm_up(self) -> None:
        """On CUDA, one forward, so that the first request does not pay for the kernels' set-up."""
        warm_up_forward(self, [(8, 6)])


def load_language_model(
    path: str | Path | CheckpointWeights,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    spec: ModelSpec | None = None,
) -> Qwen3LanguageModel:
    """Qwen3's decoder, built from the served spec (it names every field the module reads)."""
    served = spec or ModelSpec.from_dir(checkpoint_root(path))
    return Qwen3LanguageModel.from_checkpoint(path, device, dtype, served)  # type: ignore[arg-type]


def storage(size: str) -> tuple[str, float]:
    """(dtype name, init std) of a size's weights."""
    shape = tables.SIZES[size]
    return shape["dtype"], shape["init_std"]


SYNTH = SynthTables(
    sizes=tuple(tables.SIZES),
    config=tables.config_dict,
    shapes=tables.weight_shapes,
    storage=storage,
    preprocessor=tables.preprocessor_config,
    video_preprocessor=tables.video_preprocessor_config,
    chat_template=tables.CHAT_TEMPLATE,
    dir_name="qwen3-vl",
    write_tokenizer=tables.write_tokenizer,
    thinking_chat_template=tables.THINKING_CHAT_TEMPLATE,
)

FAMILY = Family(
    model_type="qwen3_vl",
    read_spec=ModelSpec.from_config,
    vision_tower=StackedVisionTower.load,
    language_model=load_language_model,
    rope_positions=frame_rope_positions,
    synth=SYNTH,
    video_timestamps=True,
    tensor_parallel=True,  # q/k norm replicated per head, DeepStack added after the all-reduce
)
