"""Lazy, layout-agnostic access to a Qwen2-VL checkpoint's safetensors.

Checkpoints come with two key layouts:

* hub layout (what Qwen published, and what transformers 5 still writes by default):
  ``model.embed_tokens.weight``, ``model.layers.N.*``, ``model.norm.weight``, ``lm_head.weight``, ``visual.*``
* transformers-5 module layout (``save_pretrained(..., save_original_format=False)``):
  ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``

Keys are normalised to the hub layout ("canonical names"). Tensors are only read when asked for, so
the vision process reads just ``visual.*`` and the decoder just the language-model weights.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from workers.models.fp8 import FP8, SCALE_NAMES, adopt_fp8_layers

VISION_PREFIX = "visual."
LANGUAGE_PREFIX = "model."
LM_HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"

# (raw prefix, canonical prefix), first match wins; order matters because "model.visual." must be
# tried before the generic hub "model." prefix.
_KEY_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    # Layouts of some transformers 4.x-era conversions.
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def canonical_key(raw: str) -> str:
    """Map a checkpoint key of any supported layout to its hub-layout name."""
    for source, target in _KEY_RENAMES:
        if raw.startswith(source):
            return target + raw[len(source) :]
    return raw


class CheckpointWeights:
    """Index of a checkpoint's tensors by canonical name; reads tensors on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._locations: dict[str, tuple[Path, str]] = {}
        for file, raw_keys in _list_shards(self.path).items():
            for raw in raw_keys:
                name = canonical_key(raw)
                if name in self._locations:
                    raise ValueError(f"checkpoint {self.path} has two tensors that both map to {name!r}")
                self._locations[name] = (file, raw)

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self._locations if k.startswith(prefix))

    def __contains__(self, name: object) -> bool:
        return name in self._locations

    def load(
        self,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        part: Callable[[str], tuple[slice, ...] | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read the named tensors (canonical names), opening each shard once. ``part(name)``: the index
        of the part of a tensor to read (None: all of it), read from the file without the rest."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._locations:
                raise ValueError(f"tensor {name!r} not found in checkpoint {self.path}")
            by_file.setdefault(self._locations[name][0], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in file_names:
                    raw = self._locations[name][1]
                    index = part(name) if part is not None else None
                    tensor = handle.get_tensor(raw) if index is None else handle.get_slice(raw)[index]
                    # FP8 weights and their fp32 scales keep their dtype (`workers.models.fp8`)
                    kept = tensor.dtype == FP8 or name.endswith(SCALE_NAMES)
                    out[name] = _convert(tensor, device, None if kept else dtype)
        return out

    def load_prefix(
        self,
        prefix: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        strip: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Read every tensor whose canonical name starts with ``prefix``."""
        names = self.keys(prefix)
        if not names:
            raise ValueError(f"checkpoint {self.path} has no tensors under {prefix!r}")
        tensors = self.load(names, device, dtype)
        if not strip:
            return tensors
        return {name[len(prefix) :]: tensor for name, tensor in tensors.items()}


def load_vision_state(
    checkpoint: CheckpointWeights | str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Vision tower weights, keys relative to ``visual.`` (e.g. ``blocks.0.attn.qkv.weight``)."""
    return _as_checkpoint(checkpoint).load_prefix(VISION_PREFIX, device, dtype)


def load_language_state(
    checkpoint: CheckpointWeights | str | Path,
    tie_word_embeddings: bool,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Decoder weights, keys relative to ``model.`` plus ``lm_head.weight``.

    With tied embeddings (or a checkpoint that simply has no ``lm_head.weight``) the returned
    ``lm_head.weight`` is the very same tensor as ``embed_tokens.weight``, so no memory is spent twice.
    """
    weights = _as_checkpoint(checkpoint)
    state = weights.load_prefix(LANGUAGE_PREFIX, device, dtype)
    if tie_word_embeddings or LM_HEAD_KEY not in weights:
        if "embed_tokens.weight" not in state:
            raise ValueError(f"checkpoint {weights.path} has neither lm_head.weight nor embed_tokens.weight")
        state[LM_HEAD_KEY] = state["embed_tokens.weight"]
    else:
        state.update(weights.load([LM_HEAD_KEY], device, dtype))
    return state


def checkpoint_root(path: CheckpointWeights | str | Path) -> Path:
    """The checkpoint's directory, given as a path or as its open weights."""
    return path.path if isinstance(path, CheckpointWeights) else Path(path)


class Loadable(Protocol):
    def load_state(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def eval(self) -> Loadable: ...


Built = TypeVar("Built", bound=Loadable)


def built_and_loaded(make: Callable[[], Built], state: Mapping[str, torch.Tensor]) -> Built:
    """``make()`` built on the meta device (no random init of weights the load overwrites at once), then
    ``load_state(state)``, in eval mode, no parameter requiring grad: every family's towers and language models come
    this way. The linear layers whose weights ``state`` holds in FP8 (with their scales) become
    `workers.models.fp8.Fp8Linear` first."""
    with torch.device("meta"), _parameters_left_uninitialised():
        module = make()
        adopt_fp8_layers(module, state)
    module.load_state(state)
    module.eval()
    # Served, never trained: with a parameter that requires grad, a step's input copied into a static buffer (the
    # decoder's step graphs) chains an autograd graph that keeps every step's inputs alive, and the host's memory
    # grows without end.
    module.requires_grad_(False)
    return module


# torch.nn.init's in-place fills, which the layers' reset_parameters call
_INIT_FILLS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def _parameters_left_uninitialised() -> Iterator[None]:
    """torch.nn.init's fills do nothing here. On the meta device they fill nothing anyway (no data, no random
    numbers drawn), but ``normal_`` there (``nn.Embedding``'s init) runs torch's Python reference, whose first call
    imports dynamo into the process."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FILLS}
    for name in _INIT_FILLS:
        setattr(nn.init, name, _unfilled)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


def _unfilled(tensor: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    return tensor


def assign_state(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Load ``state`` into ``module`` (meta-built: its tensors become the state's), after `check_state`; where
    ``lm_head.weight`` is ``embed_tokens.weight`` (tied embeddings) the two parameters stay one tensor."""
    check_state(module, state, what)
    module.load_state_dict(dict(state), strict=True, assign=True)
    head, embed = state.get(LM_HEAD_KEY), state.get("embed_tokens.weight")
    if head is not None and head is embed:
        # assign=True wraps each key in its own Parameter; share one so tied weights stay tied.
        module.lm_head.weight = module.embed_tokens.weight  # type: ignore[union-attr]


def check_state(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ValueError unless ``state`` has exactly the module's keys with the module's shapes.

    Done by hand because a failed ``load_state_dict`` on a meta-built module leaves it half loaded
    and raises RuntimeError with a message that hides which checkpoint was at fault.
    """
    expected = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} weights do not match: missing {missing[:8]}, unexpected {unexpected[:8]}")
    wrong = [
        f"{name}: {tuple(state[name].shape)} != {shape}"
        for name, shape in expected.items()
        if tuple(state[name].shape) != shape
    ]
    if wrong:
        raise ValueError(f"{what} weight shapes do not match the config: {wrong[:8]}")


def _as_checkpoint(checkpoint: CheckpointWeights | str | Path) -> CheckpointWeights:
    return checkpoint if isinstance(checkpoint, CheckpointWeights) else CheckpointWeights(checkpoint)


def _list_shards(root: Path) -> dict[Path, list[str]]:
    """Map each safetensors file of the checkpoint to the raw tensor names it holds."""
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} is not a directory")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards: dict[Path, list[str]] = {}
        for raw, file_name in weight_map.items():
            shards.setdefault(root / file_name, []).append(raw)
        missing = [str(p) for p in shards if not p.is_file()]
        if missing:
            raise ValueError(f"index {index} names missing shard files: {missing}")
        return shards
    files = [root / "model.safetensors"] if (root / "model.safetensors").is_file() else []
    # Unindexed multi-file checkpoints do exist (hand-made conversions); take every file then.
    files = files or sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {root}")
    shards = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            shards[file] = list(handle.keys())
    return shards


def _convert(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor:
    # Integer/bool tensors (none in Qwen2-VL today) must keep their dtype.
    if dtype is not None and tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)
