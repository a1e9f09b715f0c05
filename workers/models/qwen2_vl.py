"""Qwen2-VL (``model_type: qwen2_vl``): the family the rest of `workers.models` was written for."""

from __future__ import annotations

from workers.models import synth
from workers.models.language import LanguageModel
from workers.models.mrope import rope_positions
from workers.models.registry import Family, SynthTables
from workers.models.spec import ModelSpec
from workers.models.vision import VisionTower

SYNTH = SynthTables(
    sizes=tuple(synth.SIZES),
    config=synth.config_dict,
    shapes=synth.weight_shapes,
    storage=synth.storage,
    preprocessor=synth.preprocessor_config,
    video_preprocessor=synth.video_preprocessor_config,
    chat_template=synth.CHAT_TEMPLATE,
    dir_name="qwen2-vl",
)

FAMILY = Family(
    model_type="qwen2_vl",
    read_spec=ModelSpec.from_config,
    vision_tower=VisionTower.from_checkpoint,
    language_model=LanguageModel.from_checkpoint,
    rope_positions=rope_positions,
    synth=SYNTH,
    tensor_parallel=True,
)
