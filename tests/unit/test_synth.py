"""Tests for the synthetic Qwen2-VL checkpoint generator (tiny size only; 2b/7b via shape tables)."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from workers.models import synth

IMAGE_PAD_ID = synth.SPECIAL_TOKENS["<|image_pad|>"]
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
# transformers 5 builds every Qwen2-VL processor (and AutoImageProcessor) on torchvision.
needs_torchvision = pytest.mark.skipif(
    not HAS_TORCHVISION, reason="transformers 5 needs torchvision for AutoProcessor/AutoImageProcessor"
)

IMAGE_MESSAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
IMAGE_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads the variable once at import, so patch the constant as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.generate_checkpoint(tmp_path_factory.mktemp("synth") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> object:
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return AutoTokenizer.from_pretrained(tiny_dir)


def hub_name(transformers_name: str) -> str:
    """Map transformers 5 module paths back to the names stored in hub checkpoints."""
    if transformers_name.startswith("model.visual."):
        return transformers_name.removeprefix("model.")
    if transformers_name.startswith("model.language_model."):
        return "model." + transformers_name.removeprefix("model.language_model.")
    return transformers_name


def meta_model_shapes(size: str) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(**synth.config_dict(size))
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    shapes = {hub_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # the same tensor as embed_tokens, absent from tied checkpoints
    return shapes


# --------------------------------------------------------------------------- shapes and config


@pytest.mark.parametrize("size", sorted(synth.SIZES))
def test_shape_table_matches_transformers_model(size: str) -> None:
    assert synth.weight_shapes(size) == meta_model_shapes(size)


@pytest.mark.parametrize(("size", "low", "high"), [("2b", 2.1e9, 2.3e9), ("7b", 8.2e9, 8.4e9)])
def test_parameter_counts(size: str, low: float, high: float) -> None:
    count = synth.parameter_count(size)
    assert low < count < high
    assert count == sum(math.prod(s) for s in meta_model_shapes(size).values())


def test_large_sizes_shard_under_4gb() -> None:
    for size in ("2b", "7b"):
        shapes = synth.weight_shapes(size)
        shards = synth._plan_shards(shapes, 2, synth.MAX_SHARD_BYTES)
        assert sorted(n for shard in shards for n in shard) == sorted(shapes)
        assert all(sum(math.prod(shapes[n]) * 2 for n in shard) <= 4e9 for shard in shards)
    assert len(synth._plan_shards(synth.weight_shapes("2b"), 2, synth.MAX_SHARD_BYTES)) == 2


@pytest.mark.parametrize("size", sorted(synth.SIZES))
def test_config_parses_into_text_and_vision_configs(size: str) -> None:
    from transformers import Qwen2VLConfig

    raw = synth.config_dict(size)
    config = Qwen2VLConfig(**raw)
    text = config.text_config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(text, key) == raw[key], key
    assert text.num_key_value_heads == raw["num_key_value_heads"]
    assert text.rope_parameters["mrope_section"] == synth.SIZES[size]["mrope_section"]
    assert text.rope_parameters["rope_theta"] == 1000000.0
    assert text.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is synth.SIZES[size]["tie_word_embeddings"]
    assert config.image_token_id == IMAGE_PAD_ID
    assert config.vision_config.hidden_size == raw["hidden_size"]
    assert config.vision_config.depth == synth.SIZES[size]["vision"]["depth"]


# --------------------------------------------------------------------------- the tiny checkpoint


def test_tiny_writes_expected_files(tiny_dir: Path) -> None:
    expected = {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "chat_template.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "model.safetensors",
        synth.META_FILE,
    }
    assert {p.name for p in tiny_dir.iterdir()} == expected
    assert not list(tiny_dir.parent.glob(".tiny.*"))  # no temp dirs left behind
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert generation["do_sample"] is False


def test_transformers_loads_tiny_without_missing_keys(tiny_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model, info = Qwen2VLForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert model.dtype == torch.float32
    stored = load_file(tiny_dir / "model.safetensors")
    loaded = {hub_name(k): v for k, v in model.state_dict().items()}
    assert set(loaded) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name


def test_tiny_model_runs_a_forward_pass(tiny_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_dir)
    input_ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, 5, synth.SIZES["tiny"]["vocab_size"])
    assert torch.isfinite(logits).all()


def test_weight_init(tiny_dir: Path) -> None:
    stored = load_file(tiny_dir / "model.safetensors")
    norm = stored["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.1 and norm.std().item() > 0.005
    bias = stored["model.layers.0.self_attn.q_proj.bias"]
    assert bool((bias != 0).all()) and bias.std().item() > 0.01  # nonzero, so bias loading is tested
    embed = stored["model.embed_tokens.weight"]
    assert abs(embed.std().item() - synth.SIZES["tiny"]["init_std"]) < 0.01
    name, shape = "visual.merger.mlp.2.weight", synth.weight_shapes("tiny")["visual.merger.mlp.2.weight"]
    assert torch.equal(stored[name], synth.make_tensor(name, shape, 0, torch.float32, synth.SIZES["tiny"]["init_std"]))


def test_determinism(tiny_dir: Path, tmp_path: Path) -> None:
    again = synth.generate_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = synth.generate_checkpoint(tmp_path / "other", "tiny", seed=1)
    original = (tiny_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == original
    assert (other / "model.safetensors").read_bytes() != original
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_shards_written_side_by_side_hold_the_single_files_tensors(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards are written in processes at once (7B: 4 GB each); every tensor is the one the single file holds,
    and the index names the shard of each."""
    monkeypatch.setattr(synth, "MAX_SHARD_BYTES", 64 * 1024)
    paths = synth.write_weights(tmp_path, "tiny", 0)
    assert len(paths) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    whole = load_file(tiny_dir / "model.safetensors")
    seen: dict[str, torch.Tensor] = {}
    for path in paths:
        part = load_file(path)
        assert all(index["weight_map"][name] == path.name for name in part)
        seen |= part
    assert seen.keys() == whole.keys() and all(torch.equal(seen[name], whole[name]) for name in whole)


def test_safetensors_header_is_standard(tiny_dir: Path) -> None:
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(synth.weight_shapes("tiny"))


def test_regenerating_replaces_existing_dir(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    synth.generate_checkpoint(target, "tiny", seed=1)
    synth.generate_checkpoint(target, "tiny", seed=2)
    meta = json.loads((target / synth.META_FILE).read_text())
    assert meta["seed"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_cli(tmp_path: Path) -> None:
    assert synth.main(["--size", "tiny", "--out", str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- tokenizer


def test_special_token_ids(tokenizer: object) -> None:
    for token, token_id in synth.SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert len(tokenizer) == 151657
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The image shows 3 red cars.",
        "  leading spaces,\ttabs\nand\r\nnewlines  ",
        "Unicode: café, naïve, 漢字, emoji 😀, RTL שלום",
        "<|im_start|>user\nWhat is in <|vision_start|><|image_pad|><|vision_end|>?<|im_end|>",
    ],
)
def test_text_round_trip(tokenizer: object, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_is_real_bpe(tokenizer: object) -> None:
    ids = tokenizer.encode(" the image shows", add_special_tokens=False)
    assert len(ids) == 3  # common words are single merged tokens
    trained = len(synth._trained_bpe()[0])
    # Fillers pad the vocabulary to Qwen's size but are never produced by encoding.
    assert all(i < trained for i in tokenizer.encode(" filler151000 filler5", add_special_tokens=False))
    assert tokenizer.convert_ids_to_tokens(151642).startswith("Ġfiller")


def test_vocab_files_agree_with_tokenizer_json(tiny_dir: Path) -> None:
    vocab = json.loads((tiny_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == synth.NUM_REGULAR_TOKENS
    assert sorted(vocab.values()) == list(range(synth.NUM_REGULAR_TOKENS))
    merges = (tiny_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2"
    model = json.loads((tiny_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    assert model["vocab"] == vocab
    assert [" ".join(m) for m in model["merges"]] == merges[1:]
    assert len(merges) - 1 == synth.BPE_MERGES


def test_chat_template(tokenizer: object, tiny_dir: Path) -> None:
    prompt = tokenizer.apply_chat_template(IMAGE_MESSAGE, tokenize=False, add_generation_prompt=True)
    assert prompt == IMAGE_PROMPT
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    stored = json.loads((tiny_dir / "chat_template.json").read_text())["chat_template"]
    assert stored == synth.CHAT_TEMPLATE == tokenizer.chat_template


# --------------------------------------------------------------------------- image processing


def test_image_processor_config_both_spellings(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert config["size"] == {"shortest_edge": config["min_pixels"], "longest_edge": config["max_pixels"]}
    assert (config["min_pixels"], config["max_pixels"]) == (3136, 401408)


def test_pil_image_processor_bounds_tiny_images(tiny_dir: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
    out = processor(images=[Image.new("RGB", (4000, 3000))], return_tensors="pt")
    tokens = int(out["image_grid_thw"].prod()) // 4
    assert 0 < tokens <= 401408 // (28 * 28)


@needs_torchvision
def test_auto_processor_expands_image_tokens(tiny_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dir)
    prompt = processor.apply_chat_template(IMAGE_MESSAGE, tokenize=False, add_generation_prompt=True)
    assert prompt == IMAGE_PROMPT
    out = processor(text=[prompt], images=[Image.new("RGB", (640, 480), (200, 30, 30))], return_tensors="pt")
    expected = int(out["image_grid_thw"][0].prod()) // 4
    assert expected == (644 // 28) * (476 // 28)  # smart_resize rounds each side to a multiple of 28
    assert int((out["input_ids"] == IMAGE_PAD_ID).sum()) == expected
    assert out["pixel_values"].shape == (expected * 4, 3 * 2 * 14 * 14)


# --------------------------------------------------------------------------- demo checkpoint


@pytest.fixture
def counted_generation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Path]]:
    monkeypatch.setenv("VLM_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = synth.generate_checkpoint

    def counting(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
        calls.append(Path(out_dir))
        return real(out_dir, size, seed)

    monkeypatch.setattr(synth, "generate_checkpoint", counting)
    yield calls


def test_demo_checkpoint_generates_once(counted_generation: list[Path], tmp_path: Path) -> None:
    models = tmp_path / "cache" / "models"
    killed_midway = models / ".qwen2-vl-tiny-seed0.tmp-dead"
    killed_midway.mkdir(parents=True)
    first = synth.demo_checkpoint()
    assert first == models / "qwen2-vl-tiny-seed0"
    assert not killed_midway.exists()
    inode = (first / "model.safetensors").stat().st_ino
    assert synth.demo_checkpoint() == first
    assert len(counted_generation) == 1
    assert (first / "model.safetensors").stat().st_ino == inode


def test_demo_checkpoint_concurrent_first_use(counted_generation: list[Path]) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(synth.demo_checkpoint())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert len(counted_generation) == 1


def test_demo_checkpoint_regenerates_stale_cache(counted_generation: list[Path]) -> None:
    path = synth.demo_checkpoint()
    meta = json.loads((path / synth.META_FILE).read_text())
    (path / synth.META_FILE).write_text(json.dumps(meta | {"version": -1}))
    assert synth.demo_checkpoint() == path
    assert len(counted_generation) == 2
