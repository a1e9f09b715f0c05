"""One configuration for every process: a TOML file, then environment overrides.

Every process of a deployment reads the same file, so all of them agree on the socket
addresses. Addresses default to ``ipc://`` sockets in a per-deployment run directory keyed by
the HTTP port, so two deployments on one host never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "ops" / "vlm.toml"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # non-empty: every /v1 request needs one as a Bearer token
    served_model_name: str = ""
    request_timeout_s: float = 300.0
    max_request_bytes: int = 64 * 1024 * 1024
    # Completion requests handled at once (bodies, media and queues included); past it a 503 at once,
    # before the body is read, rather than a queue (and memory) without end.
    max_requests_in_flight: int = 512
    max_request_bytes_in_flight: int = 1024 * 1024 * 1024  # their bodies together (one alone may be larger)

    def validate(self, where: str) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"{where}.port: expected 1..65535, got {self.port}")
        if not (isinstance(self.api_keys, list) and all(isinstance(k, str) and k for k in self.api_keys)):
            raise ValueError(f'{where}.api_keys: expected a list of non-empty strings like ["sk-..."]')
        if self.max_requests_in_flight < 1:
            raise ValueError(f"{where}.max_requests_in_flight: expected >= 1, got {self.max_requests_in_flight}")
        if self.max_request_bytes_in_flight < 1:
            raise ValueError(f"{where}.max_request_bytes_in_flight: expected >= 1")


@dataclass
class ModelConfig:
    path: str = ""  # empty: the built-in demo checkpoint
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    # auto: what a request leaves unset comes from generation_config.json's sampling keys (as vLLM does);
    # ignore: OpenAI's defaults
    generation_config: str = "auto"

    def validate(self, where: str) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"{where}.dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"{where}.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.generation_config not in ("auto", "ignore"):
            raise ValueError(f"{where}.generation_config: expected 'auto' or 'ignore', got {self.generation_config!r}")


@dataclass
class FetcherConfig:
    http_timeout_s: float = 15.0
    max_media_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 64_000_000
    max_images_per_request: int = 16
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_frames: int = 768  # Qwen's FPS_MAX_FRAMES; sampled frames, after the fps rule
    # The whole video's token budget (qwen-vl-utils assumes 128000); it bounds the float32 patches
    # a fetcher thread holds (tokens * 4 * 28 * 28 * 3 * 4 bytes: ~900 MiB at 24576).
    max_video_tokens: int = 24576
    max_redirects: int = 3
    allow_private_addresses: bool = False
    allowed_local_media_path: str = ""  # file:// URLs only below this directory; empty: refused
    credits: int = 8
    encode_attempts: int = 3
    encode_timeout_s: float = 60.0
    threads: int = 4


VISION_BACKENDS = ("torch", "onnxruntime", "tensorrt")  # what runs the tower: workers/encoder/backends.py


@dataclass
class EncoderConfig:
    count: int = 0  # 0: one per visible GPU, or one on a CPU host
    # The GPU of each encoder, e.g. [1]: one encoder, on GPU 1, so the decoder has GPU 0 to itself.
    # Empty: encoder K on GPU K (more encoders than GPUs share them round robin).
    gpus: list[int] = field(default_factory=list)
    credits: int = 16  # jobs an encoder holds at once: what it can pack into one forward
    max_batch_patches: int = 16384  # patches (before merging) per forward; a larger single image goes alone
    backend: str = "torch"  # "torch", "onnxruntime" or "tensorrt" (workers/encoder/backends.py)
    # CUDA MPS on GPU hosts: encoders and the decoder share each GPU's SMs concurrently instead of
    # time-slicing; the encoders may use at most this share of the SMs (100: no cap). "auto": on where it
    # was measured to pay (one H200: seed3img +18-24% requests/s; see `common.deploy.mps_wanted`), off elsewhere.
    mps: bool | str = "auto"
    mps_encoder_sm_percent: int = 100
    # The decoder ranks' cap: decoding is bound by memory bandwidth, which fewer SMs can still saturate,
    # so a cap here can leave SMs to the encoders without slowing decoding much (100: no cap).
    mps_decoder_sm_percent: int = 100
    # The encoders' MPS client priority below the decoder's, so decode steps are not queued behind ViT work.
    # Off, image-heavy load gets its first tokens sooner and the rest later (one H200, seed3img at 32 clients:
    # TTFT 1.56 -> 0.7 s, TPOT 9.4 -> 16 ms, same end-to-end) and text streams beside images a worse ITL p99.
    mps_encoder_low_priority: bool = True
    engine_dir: str = ""  # where exported ONNX files and TensorRT engines are cached; empty: <run dir>/engines
    # On a GPU, queue the next batch's forward before the last batch's rows are handed out, so that the GPU
    # computes while the host copies rows into slots and answers. On the H200 (seed3img, 32 clients, MPS)
    # it took 11.7 -> 12.7 req/s and the mean TTFT 1.51 -> 0.88 s, answers identical
    # (benchmarks/results/2026-11-30-h200-overlap-skinny-c195769).
    overlap_batches: bool = True
    # On a GPU that the encoders share with a decoder replica that takes text: that replica runs on the GPU's first
    # sm_split SMs, the encoders (and media-only replicas there) on the rest, each process in a CUDA green context,
    # so that vision work never holds the SMs a decode step needs (`workers.models.sm_partition`). 0: all share all.
    sm_split: int = 0

    def validate(self, where: str) -> None:
        for name, low in (("count", 0), ("max_batch_patches", 1), ("sm_split", 0)):  # (credits: _AT_LEAST_ONE)
            if getattr(self, name) < low:
                raise ValueError(f"{where}.{name}: expected >= {low}, got {getattr(self, name)}")
        indices = isinstance(self.gpus, list) and all(type(g) is int for g in self.gpus)  # (bool is an int)
        if not indices:
            raise ValueError(f"{where}.gpus: expected a list of GPU indices like [1], got {self.gpus!r}")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"{where}.gpus: GPU indices start at 0, got {self.gpus}")
        if self.gpus and self.count and self.count != len(self.gpus):
            raise ValueError(f"{where}: count = {self.count} but gpus lists {len(self.gpus)} encoders; set one of them")
        if not (isinstance(self.mps, bool) or self.mps == "auto"):  # (1 == True, so not `in (True, ...)`)
            raise ValueError(f'{where}.mps: expected true, false or "auto", got {self.mps!r}')
        for name in ("mps_encoder_sm_percent", "mps_decoder_sm_percent"):
            if not 1 <= getattr(self, name) <= 100:
                raise ValueError(f"{where}.{name}: expected 1..100, got {getattr(self, name)}")
        if self.backend not in VISION_BACKENDS:
            names = ", ".join(map(repr, VISION_BACKENDS[:-1])) + f" or {VISION_BACKENDS[-1]!r}"
            raise ValueError(f"{where}.backend: expected {names}, got {self.backend!r}")


@dataclass
class CacheConfig:
    pool_bytes: int = 256 * 1024 * 1024
    # GPU hosts: the pool in GPU memory (CUDA IPC), so embeddings go encoder -> decoder without the host.
    device_pool: bool = False
    # Behind a GPU pool: a host shared-memory tier that evicted embeddings move to instead of being lost.
    spill_bytes: int = 0
    lease_ttl_s: float = 120.0
    pending_ttl_s: float = 60.0

    def validate(self, where: str) -> None:
        if self.pool_bytes < 0 or self.spill_bytes < 0:
            raise ValueError(f"{where}: pool_bytes and spill_bytes must be >= 0")
        if self.spill_bytes and not self.device_pool:
            raise ValueError(
                f"{where}.spill_bytes: a spill tier backs a GPU pool (device_pool = true); the host pool "
                "itself is host memory, so raise pool_bytes instead"
            )


@dataclass
class DecoderConfig:
    max_running: int = 64
    # Tokens per step (prefill chunks + decodes). Every running stream waits for the whole step, so this
    # bounds the gap a burst of arriving prompts puts between two tokens; at graph_tokens the mixed steps
    # also replay CUDA graphs (an 8,192-token step runs eagerly, for tens of milliseconds).
    prefill_tokens_per_step: int = 2048
    # The same budget while any sequence is decoding (0: prefill_tokens_per_step): a smaller one keeps the
    # running streams' inter-token gaps short while prompts arrive, and prefills at full size otherwise.
    tokens_per_step_while_decoding: int = 0
    # Tokens per KV-cache block. 64 over 16 on the H200: a 64-key attention tile reads one block-table entry and
    # one contiguous run of slots, not four; decode attention 7-15% faster, prefill attention 12%, decode steps
    # 2% (benchmarks/results/2026-11-30-h200x2-dp-routed-0741daa). The prefix cache matches whole blocks: a
    # shared prefix is reused to its last full 64 tokens.
    block_size: int = 64
    kv_cache_bytes: int = 0  # 0: gpu_memory_fraction of the GPU memory free after loading; 256 MiB on CPU
    gpu_memory_fraction: float = 0.8
    prefix_cache: bool = True
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    media_wait_s: float = 90.0
    kernels: str = "triton"  # "triton": Triton kernels and fused projections on CUDA; "torch": plain torch
    cuda_graphs: bool = True  # steps replayed from CUDA graphs (needs kernels = "triton" on CUDA)
    graph_tokens: int = 2048  # mixed prefill/decode steps up to this many tokens replay graphs too (0: none)
    overlap: bool = True  # with graphs: stage decode step N+1 while the GPU runs step N
    # Every step so, those with prefill chunks or arrivals too (one rank; with or without graphs). On the
    # H200 it kept 74% of the text streams' tokens/s under image prompts instead of 62%, and halved the
    # streams' ITL p99 without images (benchmarks/results/2026-11-30-h200-overlap-prefill-95b3a61).
    overlap_mixed: bool = True
    tensor_parallel: int = 1  # decoder ranks (one process, and one GPU, each); > 1 runs the plain-torch layers
    tp_timeout_s: float = 120.0  # how long the ranks wait for each other at start and in a collective
    # Data parallelism: whole copies of the decoder, each with its own GPUs (replica r: GPUs r*tp .. r*tp+tp-1),
    # KV cache and prefix cache. The gateway sends each request to the least loaded live replica.
    replicas: int = 1
    # Each replica's first GPU (its ranks on the next ones), e.g. [0, 0]: two replicas share GPU 0, each with its
    # share of the KV memory (and under MPS, a media-only one yields to the text one). Empty: r * tensor_parallel.
    replica_gpus: list[int] = field(default_factory=list)
    # Which replicas take text-only requests and which take requests with images or videos (empty: all).
    # E.g. text_replicas = [0], media_replicas = [1], with [encoder] gpus = [1]: the text streams' GPU never
    # runs vision work, neither the ViT nor an image prompt's prefill.
    text_replicas: list[int] = field(default_factory=list)
    media_replicas: list[int] = field(default_factory=list)
    # While every replica of a request's kind is down (or has not started in request_timeout_s), another live
    # replica takes it: the isolation is lost for that while, not the requests. false: they are refused, 503.
    kind_fallback: bool = True

    def validate(self, where: str) -> None:
        if self.kernels not in ("triton", "torch"):
            raise ValueError(f"{where}.kernels: expected 'triton' or 'torch', got {self.kernels!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"{where}.tensor_parallel: expected >= 1, got {self.tensor_parallel}")
        if self.replicas < 1:
            raise ValueError(f"{where}.replicas: expected >= 1, got {self.replicas}")
        for name in ("text_replicas", "media_replicas"):
            listed = getattr(self, name)
            if not (isinstance(listed, list) and all(type(r) is int for r in listed)):
                raise ValueError(f"{where}.{name}: expected a list of replica indices like [0], got {listed!r}")
            if any(not 0 <= r < self.replicas for r in listed) or len(set(listed)) != len(listed):
                raise ValueError(
                    f"{where}.{name}: {listed} must name distinct replicas of 0..{self.replicas - 1} "
                    f"(replicas = {self.replicas})"
                )
        gpus = self.replica_gpus
        if not (isinstance(gpus, list) and all(type(g) is int and g >= 0 for g in gpus)):
            raise ValueError(f"{where}.replica_gpus: expected a list of GPU indices like [0, 0], got {gpus!r}")
        if gpus and len(gpus) != self.replicas:
            raise ValueError(
                f"{where}.replica_gpus: {gpus} names {len(gpus)} GPU(s), one per replica is needed "
                f"(replicas = {self.replicas}); [] places replica r on GPU r * tensor_parallel"
            )
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"{where}.gpu_memory_fraction: expected a share of the GPU in (0, 1]")
        if self.graph_tokens < 0:
            raise ValueError(f"{where}.graph_tokens: expected >= 0 (0: no mixed graphs), got {self.graph_tokens}")
        if self.prefill_tokens_per_step < 1:
            raise ValueError(f"{where}.prefill_tokens_per_step: expected >= 1, got {self.prefill_tokens_per_step}")
        if not 0 <= self.tokens_per_step_while_decoding <= self.prefill_tokens_per_step:
            raise ValueError(
                f"{where}.tokens_per_step_while_decoding: expected 0 (off) to prefill_tokens_per_step "
                f"({self.prefill_tokens_per_step}), got {self.tokens_per_step_while_decoding}"
            )


@dataclass
class LivenessConfig:
    heartbeat_s: float = 0.5
    dead_after_s: float = 3.0
    call_timeout_s: float = 5.0
    # A request lost with its decoder before its first token, with no live replica to take it (a lone decoder
    # that crashed: supervisord has it back in seconds), waits this long for one before it fails (0: fails now).
    hold_lost_requests_s: float = 30.0
    # A process whose loop has not turned for this long exits (stacks logged) for supervisord to restart it (0: never).
    stall_exit_s: float = 300.0

    def validate(self, where: str) -> None:
        for name in ("heartbeat_s", "dead_after_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{where}.{name}: expected > 0 seconds, got {getattr(self, name)}")
        if self.stall_exit_s < 0:
            raise ValueError(f"{where}.stall_exit_s: expected >= 0 (0: never), got {self.stall_exit_s}")
        if (hold := self.hold_lost_requests_s) < 0:
            raise ValueError(f"{where}.hold_lost_requests_s: expected >= 0 (0: none held), got {hold}")


def decoder_name(replica: int) -> str:
    """A decoder replica's name: its program's under supervisord, its heartbeat's, its sockets' (``decoder``
    for replica 0, so that one-replica deployments keep their names; ``decoder-1`` ...)."""
    return "decoder" if replica == 0 else f"decoder-{replica}"


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fetcher: FetcherConfig = field(default_factory=FetcherConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    run_dir: str = ""  # empty: <repo>/run/<port>
    endpoints: dict[str, str] = field(default_factory=dict)
    source: str = ""

    # ------------------------------------------------------------------ derived
    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else REPO_ROOT / "run" / str(self.server.port)

    @property
    def deployment_id(self) -> str:
        """Short, host-unique name for shared-memory segments of this deployment."""
        return hashlib.sha1(str(self.run_path.resolve()).encode()).hexdigest()[:10]

    def endpoint(self, name: str) -> str:
        """The ZMQ address of a named hub (``gateway``, ``fetch``, ``cache``, ``decoder``, ``encoder.K``)."""
        if name in self.endpoints:
            return self.endpoints[name]
        if name.startswith("encoder.") and "encoder" in self.endpoints:
            return self.endpoints["encoder"].replace("{gpu}", name.split(".", 1)[1])
        return f"ipc://{self.run_path / (name + '.sock')}"

    def decoder_endpoint(self, replica: int, hub: str = "decoder") -> str:
        """The address of a decoder replica's request socket (``hub`` "decoder") or its tensor-parallel
        rendezvous (``hub`` "decoder-tp")."""
        return self.endpoint(hub if replica == 0 else f"{hub}-{replica}")

    def decoder_gpu(self, replica: int, rank: int = 0) -> int:
        """The GPU of a decoder replica's rank: ``tensor_parallel`` GPUs from ``replica_gpus[replica]``, or by
        default from ``replica * tensor_parallel`` (each replica on GPUs of its own)."""
        decoder = self.decoder
        return (decoder.replica_gpus[replica] if decoder.replica_gpus else replica * decoder.tensor_parallel) + rank

    def replica_gpu_set(self, replica: int) -> set[int]:
        return {self.decoder_gpu(replica, rank) for rank in range(self.decoder.tensor_parallel)}

    def decoder_gpus(self, replicas: Iterable[int] | None = None) -> set[int]:
        """The GPUs of ``replicas`` (default: every replica), each rank's."""
        chosen = range(self.decoder.replicas) if replicas is None else replicas
        return set().union(*(self.replica_gpu_set(r) for r in chosen))

    def takes_text(self, replica: int) -> bool:
        return not self.decoder.text_replicas or replica in self.decoder.text_replicas

    def model_path(self) -> Path:
        """The checkpoint's directory: ``[model] path``, or where the demo checkpoint lives. Only named here:
        `workers.models.synth.prepared_model` generates the demo checkpoint (the workers and the launcher call it)."""
        if self.model.path:
            return Path(self.model.path).expanduser()
        from common.checkpoint import demo_checkpoint_path

        return demo_checkpoint_path()


_ENV = {
    "VLM_MODEL": ("model", "path", str),
    "VLM_HOST": ("server", "host", str),
    "VLM_PORT": ("server", "port", int),
    "VLM_DEVICE": ("model", "device", str),
    "VLM_DTYPE": ("model", "dtype", str),
}


def _apply_section(target: Any, values: dict[str, Any], where: str) -> None:
    names = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"{where}: unknown setting {key!r}; known: {', '.join(sorted(names))}")
        setattr(target, key, _typed(names[key].type, getattr(target, key), value, f"{where}.{key}"))
    _check_ranges(target, where)
    if hasattr(target, "validate"):
        target.validate(where)


def _typed(annotation: Any, default: Any, value: Any, where: str) -> Any:
    """``value`` if it has the setting's type (an integer for a float is fine); never converted silently
    (1.9 to 1). Lists, and settings of several types, are their section's ``validate`` to check."""
    if "|" in str(annotation):
        return value
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = type(value) is int, "an integer"
    elif isinstance(default, float):
        ok, kind = type(value) in (int, float), "a number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    else:  # (lists: each section says what its lists hold)
        ok, kind = True, ""
    if not ok:
        raise ValueError(f"{where}: expected {kind}, got {value!r}")
    return float(value) if isinstance(default, float) else value


# Settings that must be positive (> 0) or at least 1, wherever they are: a zero there is never a choice, and would
# only show later as a stack that never answers (max_running = 0) or a worker restarting for ever (block_size = 0).
_POSITIVE = {
    "request_timeout_s", "http_timeout_s", "encode_timeout_s", "lease_ttl_s", "pending_ttl_s", "media_wait_s",
    "tp_timeout_s", "gpu_memory_fraction",
}  # fmt: skip
_AT_LEAST_ONE = {
    "max_request_bytes", "max_media_bytes", "max_image_pixels", "max_images_per_request", "max_video_bytes",
    "max_video_frames", "max_video_tokens", "encode_attempts", "threads", "credits", "max_running", "block_size",
}  # fmt: skip


def _check_ranges(target: Any, where: str) -> None:
    for f in dataclasses.fields(target):
        value = getattr(target, f.name)
        if f.name in _POSITIVE and not value > 0:
            raise ValueError(f"{where}.{f.name}: expected > 0, got {value}")
        if f.name in _AT_LEAST_ONE and value < 1:
            raise ValueError(f"{where}.{f.name}: expected >= 1, got {value}")


def load_config(path: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None) -> Config:
    """Read the TOML file (``VLM_CONFIG`` or the one in ``ops/``), then the ``VLM_*`` variables."""
    env = dict(os.environ) if env is None else env
    named = path or env.get("VLM_CONFIG")
    path = Path(named or DEFAULT_CONFIG)
    if named and not path.is_file():  # (a typo in a path must not start the defaults on port 8000 instead)
        raise ValueError(f"config file {path} does not exist")
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from exc
    cfg = Config(source=str(path))
    for key, value in raw.items():
        if key in ("run_dir",):
            cfg.run_dir = str(value)
        elif key == "endpoints":
            cfg.endpoints = {str(k): str(v) for k, v in value.items()}
        elif isinstance(value, dict) and dataclasses.is_dataclass(getattr(cfg, key, None)):
            _apply_section(getattr(cfg, key), value, f"{path}: [{key}]")
        else:
            raise ValueError(f"{path}: unknown section or key {key!r}")
    for var, (section, key, kind) in _ENV.items():
        if env.get(var):
            try:
                setattr(getattr(cfg, section), key, kind(env[var]))
            except ValueError as exc:
                raise ValueError(f"{var}={env[var]!r}: expected {kind.__name__}") from exc
            getattr(cfg, section).validate(var)
    if env.get("VLM_RUN_DIR"):
        cfg.run_dir = env["VLM_RUN_DIR"]
    if env.get("VLM_API_KEYS"):
        cfg.server.api_keys = [k.strip() for k in env["VLM_API_KEYS"].split(",") if k.strip()]
    if cfg.decoder.replicas > 1 and cfg.cache.device_pool:
        raise ValueError(
            f"{path}: [cache] device_pool puts the embedding pool on GPU 0, beside replica 0 only; with "
            f"[decoder] replicas = {cfg.decoder.replicas} use the host pool (device_pool = false)"
        )
    return cfg
