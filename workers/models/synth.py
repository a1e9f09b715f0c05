"""Synthetic checkpoints of each model family with seeded random weights (the Qwen2-VL tables live here).

The server, its tests and its benchmarks need a model that looks exactly like a real
Hugging Face Qwen2-VL checkpoint (same config layout, tensor names, tokenizer special ids,
chat template and image processor) without network access.  This module writes such a
directory from scratch: weights are streamed tensor by tensor straight into safetensors
files from a (name -> shape) table, so even the 7b size never has to exist in memory.

    python -m workers.models.synth --size tiny --out /tmp/qwen2-vl-tiny --seed 0
    python -m workers.models.synth --family qwen2_5_vl --size tiny

Each family's tables (config.json, tensor shapes, processor configs) are its `workers.models.registry.SynthTables`;
the tokenizer, the weight streaming and the atomic write are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import math
import multiprocessing
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypedDict

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from common.checkpoint import DEMO_SEED, DEMO_SIZE, demo_checkpoint_path
from common.config import Config
from common.model_files import SUPPORTED_MODEL_TYPES, check_model_files
from workers.models.registry import SynthTables

if TYPE_CHECKING:  # torch is imported where weights are made: finding the demo checkpoint made needs none of it
    import torch

QWEN2_VL = "qwen2_vl"

# Bump when the bytes written for a given (size, seed) change, so cached demo models regenerate.
GENERATOR_VERSION = 2
META_FILE = "synth_meta.json"


class VisionSpec(TypedDict):
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: int


class SizeSpec(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    mrope_section: list[int]
    dtype: str
    init_std: float
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    vision: VisionSpec


_QWEN2_VL_VISION: VisionSpec = {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4}

# Small enough to run on a laptop CPU in tests; the vocabulary stays full size so that
# token ids, the tokenizer and the embedding table behave exactly like the real model.
_TINY: SizeSpec = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "mrope_section": [2, 3, 3],
    "dtype": "float32",
    # Large enough that attention is sharp and positions matter: with 0.02 a tiny model barely
    # attends, and greedy parity tests could not tell M-RoPE from plain 1-D positions.
    "init_std": 0.2,
    # 512 image tokens at most, so CPU prompts stay short.
    "max_pixels": 401408,
    "video_min_pixels": 3136,
    "video_max_pixels": 100352,
    "vision": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 4},
}

SIZES: dict[str, SizeSpec] = {
    "tiny": _TINY,
    # The tiny shape with a kv head per rank at tensor parallel 4 (as Qwen2-VL-7B's 4 kv heads on 4 GPUs).
    "tiny-4kv": {**_TINY, "num_key_value_heads": 4},
    # The tiny shape with 128-wide heads and a 512-column MLP: at tensor parallel 2 every rank's shard of every
    # projection is whole 128 x 128 blocks, as block-wise FP8 checkpoints' sharding needs (Qwen2.5-VL-7B's 128-wide
    # heads); stored in bfloat16, as such checkpoints' unquantized tensors are.
    "tiny-128": {
        **_TINY,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "mrope_section": [16, 24, 24],
        "dtype": "bfloat16",
    },
    # Shapes of Qwen/Qwen2-VL-2B-Instruct.
    "2b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "mrope_section": [16, 24, 24],
        "dtype": "bfloat16",
        "init_std": 0.02,
        "max_pixels": 12845056,
        "video_min_pixels": 100352,
        "video_max_pixels": 602112,
        "vision": _QWEN2_VL_VISION,
    },
    # Shapes of Qwen/Qwen2-VL-7B-Instruct.
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "mrope_section": [16, 24, 24],
        "dtype": "bfloat16",
        "init_std": 0.02,
        "max_pixels": 12845056,
        "video_min_pixels": 100352,
        "video_max_pixels": 602112,
        "vision": _QWEN2_VL_VISION,
    },
}

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
SPATIAL_MERGE_SIZE = 2
IN_CHANNELS = 3
MIN_PIXELS = 3136
INIT_STD = 0.02
# Real checkpoints are sharded at 4 GB; keep a margin for the JSON header.
MAX_SHARD_BYTES = 4_000_000_000 - 16_000_000
# Elements generated per RNG call: bounds memory while streaming the largest tensors.
CHUNK_ELEMENTS = 1 << 24

NUM_REGULAR_TOKENS = 151643
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
BOS_TOKEN_ID = SPECIAL_TOKENS["<|endoftext|>"]
EOS_TOKEN_ID = SPECIAL_TOKENS["<|im_end|>"]

# Qwen2's pre-tokenizer split, as in the hub tokenizer.json and transformers' Qwen2Tokenizer.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_MERGES = 4000

# The Jinja chat template shipped with Qwen/Qwen2-VL-7B-Instruct, verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

_DTYPES: dict[str, tuple[str, str]] = {  # name -> (torch's name, safetensors' tag)
    "float32": ("float32", "F32"),
    "bfloat16": ("bfloat16", "BF16"),
}


def _torch_dtype(dtype_name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES[dtype_name][0])


# --------------------------------------------------------------------------- config


def _spec(size: str) -> SizeSpec:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}") from None


def config_dict(size: str) -> dict[str, Any]:
    """config.json in the flat layout of the hub's Qwen2-VL repos (text fields at top level)."""
    spec = _spec(size)
    vision = spec["vision"]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "vision_token_id": SPECIAL_TOKENS["<|vision_pad|>"],
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
        "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initializer_range": spec["init_std"],
        "intermediate_size": spec["intermediate_size"],
        "max_position_embeddings": 32768,
        "max_window_layers": spec["num_hidden_layers"],
        "model_type": "qwen2_vl",
        "num_attention_heads": spec["num_attention_heads"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "torch_dtype": spec["dtype"],
        # What the hub's Qwen2-VL-2B config says. Without a version, transformers 5 treats a local
        # tokenizer as a possibly broken Mistral one and warns about its regex on every load.
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": vision["depth"],
            "embed_dim": vision["embed_dim"],
            "mlp_ratio": vision["mlp_ratio"],
            "num_heads": vision["num_heads"],
            "in_chans": IN_CHANNELS,
            # transformers 5 reads `in_channels`; the hub's `in_chans` is kept for older readers.
            "in_channels": IN_CHANNELS,
            "hidden_size": spec["hidden_size"],
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec["mrope_section"])},
        "vocab_size": spec["vocab_size"],
    }


# --------------------------------------------------------------------------- weights


def text_shapes(spec: SizeSpec) -> dict[str, tuple[int, ...]]:
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    head_dim = hidden // spec["num_attention_heads"]
    q_dim, kv_dim = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec["vocab_size"], hidden)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.q_proj.bias": (q_dim,),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.k_proj.bias": (kv_dim,),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.bias": (kv_dim,),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not spec["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (spec["vocab_size"], hidden)
    return shapes


def _vision_shapes(spec: SizeSpec) -> dict[str, tuple[int, ...]]:
    vision = spec["vision"]
    dim, mlp_dim = vision["embed_dim"], vision["embed_dim"] * vision["mlp_ratio"]
    merged = dim * SPATIAL_MERGE_SIZE**2
    shapes: dict[str, tuple[int, ...]] = {
        "visual.patch_embed.proj.weight": (dim, IN_CHANNELS, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE)
    }
    for i in range(vision["depth"]):
        p = f"visual.blocks.{i}"
        shapes |= {
            f"{p}.norm1.weight": (dim,),
            f"{p}.norm1.bias": (dim,),
            f"{p}.norm2.weight": (dim,),
            f"{p}.norm2.bias": (dim,),
            f"{p}.attn.qkv.weight": (3 * dim, dim),
            f"{p}.attn.qkv.bias": (3 * dim,),
            f"{p}.attn.proj.weight": (dim, dim),
            f"{p}.attn.proj.bias": (dim,),
            f"{p}.mlp.fc1.weight": (mlp_dim, dim),
            f"{p}.mlp.fc1.bias": (mlp_dim,),
            f"{p}.mlp.fc2.weight": (dim, mlp_dim),
            f"{p}.mlp.fc2.bias": (dim,),
        }
    shapes |= {
        "visual.merger.ln_q.weight": (dim,),
        "visual.merger.ln_q.bias": (dim,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (spec["hidden_size"], merged),
        "visual.merger.mlp.2.bias": (spec["hidden_size"],),
    }
    return shapes


def weight_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, under the hub's names, in file order."""
    spec = _spec(size)
    return text_shapes(spec) | _vision_shapes(spec)


def parameter_count(size: str) -> int:
    """Parameters stored in the checkpoint (a tied lm_head is not counted twice)."""
    return sum(math.prod(shape) for shape in weight_shapes(size).values())


def _tensor_seed(seed: int, name: str) -> int:
    # Independent of the order tensors are visited in, so any tensor can be regenerated alone.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _is_norm_weight(name: str) -> bool:
    return name.endswith(".weight") and ("norm" in name or ".ln_q." in name)


def _tensor_chunks(
    name: str, numel: int, seed: int, dtype: torch.dtype, std: float = INIT_STD
) -> Iterator[torch.Tensor]:
    """The tensor's values as flat chunks, already cast to the storage dtype."""
    import torch

    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    # Norm scales sit around 1 (identity) with noise so that loading them is observable.
    offset = 1.0 if _is_norm_weight(name) else 0.0
    for start in range(0, numel, CHUNK_ELEMENTS):
        chunk = torch.empty(min(CHUNK_ELEMENTS, numel - start), dtype=torch.float32)
        chunk.normal_(offset, std, generator=generator)
        yield chunk.to(dtype)


def make_tensor(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, std: float = INIT_STD
) -> torch.Tensor:
    """One weight exactly as generate_checkpoint stores it (handy for checks)."""
    import torch

    chunks = list(_tensor_chunks(name, math.prod(shape), seed, dtype, std))
    return torch.cat(chunks).reshape(shape)


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _safetensors_header(names: list[str], shapes: dict[str, tuple[int, ...]], dtype_tag: str, itemsize: int) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        end = offset + math.prod(shapes[name]) * itemsize
        header[name] = {"dtype": dtype_tag, "shape": list(shapes[name]), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    # The format wants the data section 8-byte aligned; pad the header with spaces like safetensors does.
    return raw + b" " * (-len(raw) % 8)


def _itemsize(dtype_name: str) -> int:
    return _torch_dtype(dtype_name).itemsize


def _write_safetensors(
    path: Path, names: list[str], shapes: dict[str, tuple[int, ...]], seed: int, dtype_name: str, std: float
) -> None:
    """Stream one safetensors file: header first, then each tensor chunk by chunk."""
    dtype, tag = _torch_dtype(dtype_name), _DTYPES[dtype_name][1]
    itemsize = dtype.itemsize
    names = sorted(names)  # safetensors' own writer orders by name; keep files comparable
    header = _safetensors_header(names, shapes, tag, itemsize)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name in names:
            _write_tensor(f, name, math.prod(shapes[name]), seed, dtype, std)


def _write_tensor(f: BinaryIO, name: str, numel: int, seed: int, dtype: torch.dtype, std: float) -> None:
    # safetensors is little-endian, as are the x86-64 and arm64 hosts this runs on.
    import torch

    for chunk in _tensor_chunks(name, numel, seed, dtype, std):
        f.write(chunk.view(torch.uint8).numpy().data)


def storage(size: str) -> tuple[str, float]:
    """(dtype name, init std) of a Qwen2-VL size's weights."""
    return _spec(size)["dtype"], _spec(size)["init_std"]


def write_weights(out_dir: Path, size: str, seed: int, tables: SynthTables | None = None) -> list[Path]:
    """Write model.safetensors, or 4 GB shards plus their index when it does not fit (2b, 7b)."""
    tables = tables or family_tables(QWEN2_VL)
    dtype_name, std = tables.storage(size)
    shapes = tables.shapes(size)
    itemsize = _itemsize(dtype_name)
    shards = _plan_shards(shapes, itemsize, MAX_SHARD_BYTES)
    if len(shards) == 1:  # like save_pretrained: no index for a single file
        path = out_dir / "model.safetensors"
        _write_safetensors(path, shards[0], shapes, seed, dtype_name, std)
        return [path]
    paths = [out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    # Each tensor has its own seed, so the shards are written side by side, in processes (the normal draws hold
    # one core each): a 7B checkpoint in a fraction of the time, the same bytes.
    workers = max(1, min(len(shards), (os.cpu_count() or 1) // 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        written = [
            pool.submit(_write_safetensors, path, names, shapes, seed, dtype_name, std)
            for path, names in zip(paths, shards, strict=True)
        ]
        for future in written:
            future.result()
    weight_map = {name: path.name for path, names in zip(paths, shards, strict=True) for name in names}
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index)
    return paths


# --------------------------------------------------------------------------- tokenizer


def _words(text: str) -> list[str]:
    return text.split()


_NOUNS = _words("""
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact
month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education picture image photo
camera video screen window table chair dog cat bird horse tree flower river mountain road street
bridge building tower sky cloud sun moon star ocean beach forest garden field farm animal fish boat
train plane bicycle bus truck phone computer keyboard mouse paper letter sign map chart graph label
color shape circle square triangle line corner edge center background foreground object person
shirt hat shoe bag cup bottle glass plate bowl food apple banana orange bread cake pizza coffee tea
kitchen bedroom bathroom wall floor roof light lamp clock mirror painting poster crowd group player
ball field stadium market shop store restaurant hospital school university library museum park
""")

_ADJECTIVES = _words("""
good new first last long great little own other old right big high different small large next
early young important few public bad same able red blue green yellow black white brown gray pink
purple orange bright dark clear sunny cloudy rainy wet dry hot cold warm cool happy sad busy quiet
loud empty full open closed round square tall short wide narrow heavy light soft hard smooth rough
clean dirty modern ancient famous simple complex beautiful strange common rare real main single
""")

_VERBS = _words("""
shows contains depicts holds carries watches reads writes opens closes builds paints drives rides
walks runs jumps sits stands looks finds gives takes makes sees knows wants uses tells asks works
seems feels tries leaves calls keeps brings begins helps turns starts moves plays lives believes
happens includes continues sets learns changes leads understands follows stops creates speaks
allows adds spends grows offers remembers loves considers appears buys waits serves dies sends
expects stays falls cuts reaches kills remains suggests raises passes sells requires reports
""")

_FUNCTION = _words("""
the a an this that these those some every each any no one two three four five many several
in on at by with from to of for under over above below behind near between into onto through
and or but because while although when where which who whose what how why if then than
is are was were be been being has have had do does did will would can could should may might
it he she they we you I me him her them us my his its our their your there here not very also
""")

_MORE_WORDS = _words("""
about above across action activity actually add address admit adult affect after again against age
agency agent ago agree agreement ahead allow almost alone along already although always american
among amount analysis another answer anyone anything appear apply approach argue arm around arrive
article artist assume attack attention attorney audience author authority available avoid away baby
bank bar base beat become bed before begin behavior benefit best better beyond bill billion bit
blood board boy break brother budget burn buy campaign cancer candidate capital card care career
catch cause cell central century certain certainly challenge chance character charge check choice
choose church citizen civil claim class coach collection college come commercial compare concern
condition conference congress consumer contain control cost could country couple course court cover
crime cultural culture current customer damage data daughter dead deal death debate decade decide
decision deep defense degree democrat describe design despite detail determine develop development
difference difficult dinner direction director discover discuss discussion disease doctor dream
drive drop drug during east easy economic economy effect effort eight either election else employee
energy enjoy enough enter entire environment environmental especially establish even evening event
ever everybody everyone everything evidence exactly example executive exist experience expert
explain fail fast fear federal feel feeling figure fill film final finally financial fine finger
finish fire firm fly focus foot foreign forget form former forward free front fund future gas
general generation get goal ground grow growth guess gun hair half hang happen hear heart heat
herself himself hit hope hotel however huge human hundred husband identify imagine impact improve
including increase indeed indicate individual industry inside instead institution interest
interesting international interview investment involve itself join just key knowledge land language
late later laugh lawyer lay leader least left leg legal less let lie likely listen local lose loss
low machine magazine maintain major majority manage management manager marriage material matter
maybe mean measure media medical meet meeting memory mention message method middle military million
mind miss mission model nation national natural nature nearly necessary need network never news
newspaper nice none nor north note nothing notice now occur officer official often oil once only
operation opportunity option order organization outside owner page pain participant particular
particularly partner pass past patient pattern pay peace perform performance perhaps period personal
physical pick piece plan plant please police policy political politics poor popular population
position positive possible practice prepare present pressure pretty prevent price private probably
problem process produce product production professional professor property protect prove provide
pull purpose push put quality quickly quite race radio raise range rate rather reach read ready
realize really receive recent recently recognize record reduce reflect region relate relationship
religious remember remove represent require resource respond response responsibility rest return
reveal rich rise risk rock role rule safe save say scene science scientist score sea season seat
second section security seek sell send senior sense series serious serve set seven share shoot
shoulder show significant similar since sing sister situation size skill skin social society soldier
somebody someone something sometimes son song soon sort sound source south southern space speak
special specific speech spend sport spring staff stage standard state statement station stay step
still stock stop strategy strong structure student stuff style subject success successful such
suddenly suffer suggest summer support sure surface talk task tax teach technology television tell
ten tend term test thank thanks thing think third though thought thousand threat throughout throw
thus today together tonight too top total tough toward town trade traditional training travel treat
treatment trial trip trouble true truth try turn type understand unit until upon usually value
various victim view violence visit voice vote wait walk want watch weapon wear weight well west
western whatever whether whole wife win wind wish within without wonder worker worry would write
writer wrong yard yeah yes yet yourself hello assistant user system token text vision frame pixel
patch prompt request server client stream batch cache latency throughput
""")

_PREPOSITIONS = _words("in on at by with from to of for under over above below behind near between into")

_PROMPTS = [
    "Describe this image.",
    "What is in the picture?",
    "How many {noun}s are there in the image?",
    "What color is the {noun}?",
    "Read the text in the image.",
    "Summarize the video in one sentence.",
    "Write a short story about a {adj} {noun}.",
    "Explain the chart step by step.",
    "Is there a {adj} {noun} in the corner?",
]


_DETERMINERS = ["the", "a", "this", "that", "one", "every", "some", "my", "their", "our"]
_ENDINGS = [".", ".", ".", "!", "?", ";", ","]


def _noun_phrase(rng: random.Random) -> str:
    adjectives = rng.sample(_ADJECTIVES, rng.randint(0, 2))
    return " ".join([rng.choice(_DETERMINERS), *adjectives, rng.choice(_NOUNS + _MORE_WORDS)])


def _capitalise(text: str) -> str:
    return text[0].upper() + text[1:]


def _sentence(rng: random.Random) -> str:
    words = [_noun_phrase(rng), rng.choice(_VERBS), _noun_phrase(rng)]
    if rng.random() < 0.6:
        words += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    return _capitalise(" ".join(words)) + rng.choice(_ENDINGS)


def _word_salad(rng: random.Random) -> str:
    # Grammar-free but covers the long tail of the word list, which is where merges come from.
    words = rng.sample(_MORE_WORDS + _FUNCTION, rng.randint(4, 14))
    return _capitalise(" ".join(words)) + rng.choice(_ENDINGS)


def _numbers(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    return (
        f"There are {rng.randint(0, 9999)} {noun}s, about {rng.randint(1, 99)}% of the "
        f"{rng.randint(1, 12)} rows (${rng.randint(1, 500)}.{rng.randint(0, 99):02d} each)."
    )


def _prompt(rng: random.Random) -> str:
    return rng.choice(_PROMPTS).format(noun=rng.choice(_NOUNS), adj=rng.choice(_ADJECTIVES))


def _chat(rng: random.Random) -> str:
    # The role names follow "<|im_start|>" with no space, so they must be learnt in that form too.
    return f"system\nYou are a helpful assistant.\nuser\n{_prompt(rng)}\nassistant\n{_sentence(rng)}\n"


def _paragraph(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.05:
        return _chat(rng)
    if kind < 0.1:
        return _prompt(rng)
    if kind < 0.2:
        return _numbers(rng)
    if kind < 0.27:
        return "\n".join(f"{i}. {_sentence(rng)}" for i in range(1, rng.randint(3, 6)))
    if kind < 0.6:
        return " ".join(_word_salad(rng) for _ in range(rng.randint(1, 3)))
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


def training_corpus(paragraphs: int = 30000) -> list[str]:
    """A deterministic English-like corpus; every word also appears bare and capitalised."""
    rng = random.Random(20240829)
    vocabulary = list(dict.fromkeys(_NOUNS + _ADJECTIVES + _VERBS + _FUNCTION + _MORE_WORDS))
    lines = [" ".join(vocabulary), " ".join(w.capitalize() for w in vocabulary)]
    lines += [_paragraph(rng) for _ in range(paragraphs)]
    return lines


def _byte_level_pipeline(tokenizer: Tokenizer) -> None:
    """Normalizer, pre-tokenizer and decoders exactly as in Qwen2's hub tokenizer.json."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


@functools.cache
def _trained_bpe() -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """Vocabulary and merges learnt from the corpus (cached: identical for every size and seed)."""
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    _byte_level_pipeline(tokenizer)
    trainer = BpeTrainer(
        vocab_size=len(pre_tokenizers.ByteLevel.alphabet()) + BPE_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return tuple(vocab), tuple(merges)  # type: ignore[return-value]


def full_vocab() -> dict[str, int]:
    """The 151,643 regular tokens: trained BPE tokens, then unreachable fillers."""
    trained, _ = _trained_bpe()
    vocab = dict(trained)
    # "Ġfiller123" can never come out of BPE: the pre-tokenizer always splits letters from digits.
    # The leading "Ġ" (a space) keeps a random model's decoded output readable.
    for token_id in range(len(vocab), NUM_REGULAR_TOKENS):
        vocab[f"Ġfiller{token_id}"] = token_id
    return vocab


def build_tokenizer() -> Tokenizer:
    """The complete fast tokenizer, special tokens at Qwen2-VL's ids."""
    _, merges = _trained_bpe()
    model = BPE(
        vocab=full_vocab(),
        merges=list(merges),
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    _byte_level_pipeline(tokenizer)
    # Added in id order: tokenizers assigns the next free id, i.e. 151643 onward.
    specials = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for token, token_id in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} landed on id {tokenizer.token_to_id(token)}, expected {token_id}")
    return tokenizer


def _added_token_entry(token: str) -> dict[str, Any]:
    return {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def tokenizer_config() -> dict[str, Any]:
    decoder = {str(i): _added_token_entry(t) | {"special": True} for t, i in SPECIAL_TOKENS.items()}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": _extra_special_tokens(),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _extra_special_tokens() -> list[str]:
    return [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"]


def special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": _extra_special_tokens(),
        "eos_token": _added_token_entry("<|im_end|>"),
        "pad_token": _added_token_entry("<|endoftext|>"),
    }


def write_tokenizer(out_dir: Path) -> None:
    tokenizer = build_tokenizer()
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    vocab_text = json.dumps(full_vocab(), ensure_ascii=False, separators=(",", ":"))
    (out_dir / "vocab.json").write_text(vocab_text, encoding="utf-8")
    _, merges = _trained_bpe()
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (out_dir / "merges.txt").write_text(merges_text, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map())


# --------------------------------------------------------------------------- processor


def vision_processing(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    # transformers 5 reads `size`; min/max_pixels are the hub's spelling of the same bounds.
    return {
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,  # bicubic
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": SPATIAL_MERGE_SIZE,
        "processor_class": "Qwen2VLProcessor",
    }


def preprocessor_config(size: str) -> dict[str, Any]:
    config = vision_processing(MIN_PIXELS, _spec(size)["max_pixels"])
    return {"image_processor_type": "Qwen2VLImageProcessor", **config}


def video_preprocessor_config(size: str) -> dict[str, Any]:
    spec = _spec(size)
    config = vision_processing(spec["video_min_pixels"], spec["video_max_pixels"])
    # cap_pixels_per_frame: qwen-vl-utils' total-video pixel budget, transformers' default from 5.22 on.
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        **config,
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
        "pad_token_id": BOS_TOKEN_ID,
        "do_sample": False,
    }


# --------------------------------------------------------------------------- checkpoint


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def family_tables(family: str) -> SynthTables:
    """The generator's tables of a model family (its module in `workers.models.registry`)."""
    from workers.models.registry import family as registered  # (the family modules import this one)

    return registered(family).synth


def _write_all(
    out_dir: Path, size: str, seed: int, family: str, thinking: bool = False, quantization: str | None = None
) -> None:
    tables = family_tables(family)
    _write_json(out_dir / "config.json", tables.config(size))
    _write_json(out_dir / "generation_config.json", generation_config())
    _write_json(out_dir / "preprocessor_config.json", tables.preprocessor(size))
    _write_json(out_dir / "video_preprocessor_config.json", tables.video_preprocessor(size))
    _write_json(out_dir / "chat_template.json", {"chat_template": tables.chat_template})
    (tables.write_tokenizer or write_tokenizer)(out_dir)
    if thinking:
        _write_thinking_template(out_dir, family)
    write_weights(out_dir, size, seed, tables)
    meta: dict[str, Any] = {"generator": "vlm-serve synth", "version": GENERATOR_VERSION, "size": size, "seed": seed}
    if family != QWEN2_VL:  # (a Qwen2-VL checkpoint's meta is unchanged, so cached demo models stay current)
        meta["family"] = family
    if thinking:
        meta["thinking"] = True
    if quantization is not None:
        from workers.models.synth_fp8 import quantize_checkpoint  # (it reads checkpoints through this layer's loader)

        quantize_checkpoint(out_dir, quantization)
        meta["quantization"] = quantization
    _write_json(out_dir / META_FILE, meta)


def _write_thinking_template(out_dir: Path, family: str) -> None:
    """The family's "Thinking" chat template in place of its own, where the processor and tokenizer read it."""
    template = family_tables(family).thinking_chat_template
    if template is None:
        raise ValueError(f"{family} has no thinking variant (its tokenizer has no <think> tokens)")
    _write_json(out_dir / "chat_template.json", {"chat_template": template})
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    _write_json(config_path, {**config, "chat_template": template})


def _swap_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished tmp_dir to out_dir, replacing an older checkpoint there."""
    try:
        tmp_dir.rename(out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    # rename() cannot replace a non-empty directory: move the old one aside first.
    trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.rename(trash / out_dir.name)
    tmp_dir.rename(out_dir)
    shutil.rmtree(trash, ignore_errors=True)


def generate_checkpoint(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    family: str = "qwen2_vl",
    thinking: bool = False,
    quantization: str | None = None,
) -> Path:
    """Write a complete checkpoint directory of the family (its model_type) to out_dir and return its path;
    ``thinking``: with the family's "Thinking" chat template (Qwen3-VL's: the answer starts inside `<think>`);
    ``quantization``: "fp8-block" or "fp8-channel", its linear weights rewritten in that hub FP8 format
    (`workers.models.synth_fp8`).

    Readers never see a half-written directory: everything is built in a sibling temp dir
    and renamed into place. The same (family, size, seed) always gives byte-identical weight files.
    """
    sizes = family_tables(family).sizes
    if size not in sizes:
        raise ValueError(f"unknown {family} size {size!r}; expected one of {sorted(sizes)}")
    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_all(tmp_dir, size, seed, family, thinking, quantization)
        tmp_dir.chmod(0o755)  # mkdtemp makes it 0700
        _swap_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _is_current(path: Path, size: str, seed: int) -> bool:
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    same = meta.get("size") == size and meta.get("seed") == seed and meta.get("family", QWEN2_VL) == QWEN2_VL
    return meta.get("version") == GENERATOR_VERSION and same


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def demo_checkpoint() -> Path:
    """The built-in demo model (tiny, seed 0), generated once under $VLM_CACHE_DIR/models."""
    path = demo_checkpoint_path()
    models = path.parent
    if _is_current(path, DEMO_SIZE, DEMO_SEED):
        return path
    models.mkdir(parents=True, exist_ok=True)
    # Several workers start together: one generates while the others wait, then all reuse it.
    with _file_lock(models / f".{path.name}.lock"):
        if not _is_current(path, DEMO_SIZE, DEMO_SEED):
            _remove_leftovers(path)
            generate_checkpoint(path, DEMO_SIZE, DEMO_SEED)
    return path


def prepared_model(cfg: Config) -> Path:
    """The configured checkpoint's directory (`Config.model_path`), the demo checkpoint generated first when it
    is the one configured: every process that loads the model calls this at start-up, so that each one started
    alone with the default config still finds it (one generates, the others wait on its lock). Raises ValueError
    naming the model type or the file at fault where the checkpoint is of no supported family or lacks a file
    (`common.model_files.check_model_files`: what `workers.models.registry.checkpoint_family` checks, without
    importing the family's module, and so torch, in the launcher)."""
    path = cfg.model_path() if cfg.model.path else demo_checkpoint()
    check_model_files(path, cfg.model.quantization)
    return path


def _remove_leftovers(path: Path) -> None:
    # Temp dirs of a generator that was killed midway; only the lock holder writes here.
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*"):
        for leftover in path.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _disk_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=SUPPORTED_MODEL_TYPES, default=QWEN2_VL, help="the model_type")
    parser.add_argument("--size", default="tiny", help="tiny or a real shape (qwen2_vl: 2b, 7b; qwen2_5_vl: 3b, 7b)")
    parser.add_argument("--out", type=Path, help="checkpoint directory to create (default: <family>-<size>-seed<S>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thinking", action="store_true", help="the family's Thinking chat template (qwen3_vl)")
    parser.add_argument(
        "--quantization",
        choices=("fp8-block", "fp8-channel"),
        help="write the linear weights in a Hugging Face hub FP8 format: Qwen's block-wise or compressed-tensors'",
    )
    args = parser.parse_args(argv)
    tables = family_tables(args.family)
    if args.thinking and tables.thinking_chat_template is None:
        parser.error(f"--thinking: {args.family} has no thinking variant")
    if args.size not in tables.sizes:
        parser.error(f"--size: {args.family} has sizes {', '.join(tables.sizes)}")
    out = args.out or Path(f"{tables.dir_name}-{args.size}-seed{args.seed}")
    start = time.monotonic()
    path = generate_checkpoint(out, args.size, args.seed, args.family, args.thinking, args.quantization)
    elapsed = time.monotonic() - start
    params = sum(math.prod(shape) for shape in tables.shapes(args.size).values())
    print(
        f"wrote {path} ({args.family} {args.size}, seed {args.seed}, {params / 1e9:.3f}B params, "
        f"{_disk_size(path) / 1e9:.2f} GB) in {elapsed:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
