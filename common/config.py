"""One configuration for every process: a TOML file, then environment overrides.

Every process of a deployment reads the same file, so all of them agree on the socket
addresses. Addresses default to ``ipc://`` sockets in a per-deployment run directory keyed by
the HTTP port, so two deployments on one host never collide.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import textwrap
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.quantization import QUANTIZATION_SETTINGS

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "ops" / "vlm.toml"


def setting(default: Any, help: str) -> Any:
    """A setting: its default, and the help that ``python -m common.config --defaults`` prints beside it (lists
    are written ``field(default_factory=list, metadata={"help": ...})``, as a dataclass needs)."""
    return field(default=default, metadata={"help": help})


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "Address the HTTP gateway listens on (VLM_HOST); 0.0.0.0: every interface.")
    port: int = setting(
        8000,
        "HTTP port of the gateway (VLM_PORT). It also names the deployment's run directory (run/<port>), so two "
        "deployments on one host never collide.",
    )
    api_keys: list[str] = field(
        default_factory=list,
        metadata={
            "help": 'Non-empty, e.g. ["sk-..."]: every /v1 request needs "Authorization: Bearer <key>" with one of '
            "them (or VLM_API_KEYS, comma-separated). /health and /metrics stay open for probes."
        },
    )
    role: str = setting(
        "all",
        'What this host runs of the deployment (VLM_ROLE; ./ops/serve --role). "all": every process. "pd": the '
        "gateway, fetchers, cache daemon and decoders; the vision encoders are on other hosts, at [endpoints] "
        'encoder.K (tcp://, as many as [encoder] count). "encoder": the vision encoders alone, bound on their '
        "tcp:// [endpoints] for pd units elsewhere (they send embeddings back by value).",
    )
    served_model_name: str = setting("", "The model's id in /v1/models and in answers; empty: the checkpoint's name.")
    request_timeout_s: float = setting(300.0, "A completion request not answered in this many seconds fails.")
    max_request_bytes: int = setting(64 * 1024 * 1024, "Largest request body (inline images included); larger: 413.")
    max_requests_in_flight: int = setting(
        512,
        "Completion requests handled at once (bodies, media and queues included). Past it a 503 with Retry-After "
        "at once, before the body is read, rather than a queue (and memory) without end.",
    )
    max_request_bytes_in_flight: int = setting(
        1024 * 1024 * 1024, "The bodies of the requests in flight together (one alone may be larger); past it, a 503."
    )
    max_queue_wait_s: float = setting(
        5.0,
        "Load shedding: a new request gets a 503 with Retry-After at once when it would wait longer than this for "
        "its first answer: foreseen from the line of admitted requests still waiting for theirs (at least 8) and "
        "the best rate the stack gave first answers at in the last minute, or seen in a backlog (at least 2, and a "
        "quarter of those in flight) that has already waited this long. A burst thus queues about this much work "
        "from its start. A few slow requests (large videos) never shed traffic. Keep it above the TTFT the "
        "deployment sees at its busiest. 0: off (only max_requests_in_flight bounds the queue).",
    )

    def validate(self, where: str) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"{where}.port: expected 1..65535, got {self.port}")
        if self.role not in UNIT_ROLES:
            raise ValueError(f"{where}.role: expected one of {UNIT_ROLES}, got {self.role!r}")
        if not (isinstance(self.api_keys, list) and all(isinstance(k, str) and k for k in self.api_keys)):
            raise ValueError(f'{where}.api_keys: expected a list of non-empty strings like ["sk-..."]')
        if self.max_requests_in_flight < 1:
            raise ValueError(f"{where}.max_requests_in_flight: expected >= 1, got {self.max_requests_in_flight}")
        if self.max_request_bytes_in_flight < 1:
            raise ValueError(f"{where}.max_request_bytes_in_flight: expected >= 1")
        if self.max_queue_wait_s < 0:
            raise ValueError(f"{where}.max_queue_wait_s: expected >= 0 (0: off), got {self.max_queue_wait_s}")


@dataclass
class ModelConfig:
    path: str = setting(
        "",
        "A Hugging Face-format Qwen2-VL checkpoint directory (VLM_MODEL); empty: the built-in tiny demo model, "
        "generated once under $VLM_CACHE_DIR.",
    )
    dtype: str = setting(
        "auto", '"auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16" (VLM_DTYPE).'
    )
    device: str = setting("auto", '"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N" (VLM_DEVICE).')
    generation_config: str = setting(
        "auto",
        '"auto": what a request leaves unset comes from the sampling keys of the checkpoint\'s '
        'generation_config.json (as vLLM does); "ignore": OpenAI\'s defaults.',
    )
    quantization: str = setting(
        "auto",
        '"auto": the checkpoint\'s own weight format (its config.json quantization_config: FP8 block-wise or '
        'compressed-tensors FP8, see docs/quantization.md); "none": an unquantized checkpoint as it is; "fp8": an '
        "unquantized checkpoint's language-model linears quantized to FP8 at load time (per-channel weight scales).",
    )

    def validate(self, where: str) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"{where}.dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"{where}.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.generation_config not in ("auto", "ignore"):
            raise ValueError(f"{where}.generation_config: expected 'auto' or 'ignore', got {self.generation_config!r}")
        if self.quantization not in QUANTIZATION_SETTINGS:
            raise ValueError(f"{where}.quantization: expected 'auto', 'none' or 'fp8', got {self.quantization!r}")


@dataclass
class FetcherConfig:
    http_timeout_s: float = setting(15.0, "A whole media download, connect to last byte (not each read), in seconds.")
    max_media_bytes: int = setting(32 * 1024 * 1024, "Largest image, downloaded or in a data URL, in bytes.")
    max_image_pixels: int = setting(64_000_000, "Largest image (width x height) accepted, before it is resized.")
    max_images_per_request: int = setting(16, "Images and videos together in one request.")
    max_video_bytes: int = setting(64 * 1024 * 1024, "Largest video, downloaded or in a data URL, in bytes.")
    max_video_frames: int = setting(
        768, "Sampled frames per video at most, after the fps rule (Qwen's FPS_MAX_FRAMES)."
    )
    max_video_tokens: int = setting(
        24576,
        "The LLM tokens of one video at most: frames are shrunk to fit (qwen-vl-utils assumes 128000). It bounds "
        "the float32 patches a fetcher thread holds: tokens * 4 * 28 * 28 * 3 * 4 bytes.",
    )
    max_redirects: int = setting(3, "HTTP redirects followed for one media URL.")
    allow_private_addresses: bool = setting(
        False, "Fetch media URLs on loopback and private networks too (refused by default)."
    )
    allowed_local_media_path: str = setting("", "file:// URLs are read only below this directory; empty: refused.")
    credits: int = setting(8, "Requests the gateway may have at one fetcher at once.")
    encode_attempts: int = setting(
        3, "Encoders an encode job is given to (one lost with its encoder goes to another) before it fails."
    )
    encode_timeout_s: float = setting(
        60.0, "An encode job not done in this many seconds fails, and its request with it."
    )
    threads: int = setting(4, "Download and preprocessing threads of each fetcher.")
    count: int = setting(
        1,
        'Fetcher processes. Left out or "auto": one per encoder, at most one per 4 CPU cores (decoding, resizing and '
        "hashing media is CPU work that grows with the encoders it feeds); the gateway sends an image to the same "
        "fetcher each time, where it is remembered.",
    )

    def validate(self, where: str) -> None:
        if self.count < 1:
            raise ValueError(f"{where}.count: expected >= 1, got {self.count}")


VISION_BACKENDS = ("torch", "onnxruntime", "tensorrt")  # what runs the tower: workers/encoder/backends.py


@dataclass
class EncoderConfig:
    count: int = setting(
        0,
        'Vision encoder processes; 0: one per visible GPU, or one on a CPU host. Left out or "auto": see replicas. '
        "In a pd unit ([server] role): the encoder endpoints it dials, encoder.0 .. count-1 (0: one).",
    )
    gpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "The GPU of each encoder, e.g. [1]: one encoder, on GPU 1, so the decoder has GPU 0 to itself. "
            'Empty: encoder K on GPU K (more encoders than GPUs share them round robin). Left out or "auto": '
            "chosen with [decoder] replicas (on 2+ GPUs: [1 .. N-1])."
        },
    )
    credits: int = setting(16, "Jobs an encoder holds at once: what it can pack into one forward.")
    resolve_every_s: float = setting(
        5.0,
        "An encoder endpoint named by host (tcp://NAME:PORT, e.g. a headless Service) is every address NAME resolves "
        "to, resolved again this often: encoders that appear are used, those gone are drained, without a restart.",
    )
    max_batch_patches: int = setting(
        16384, "Patches (before merging) per forward of the vision tower; a larger single image runs alone."
    )
    backend: str = setting(
        "torch",
        '"torch", "onnxruntime" (exported once, cached in engine_dir) or "tensorrt": what runs the vision tower.',
    )
    mps: bool | str = setting(
        "auto",
        "GPU hosts: the CUDA MPS daemon, so that encoders and the decoder share each GPU's SMs at once instead of "
        "time-slicing; the encoders (and media-only replicas beside a text one) run at a lower client priority, so "
        'decode steps are not queued behind ViT work. "auto": on where it was measured to pay (an encoder on a '
        "decoder's GPU, one decoder rank; see ops.deploy.mps_wanted), off elsewhere.",
    )
    engine_dir: str = setting(
        "", "Where exported ONNX files and TensorRT engines are cached; empty: <run dir>/engines."
    )
    quantization: str = setting(
        "auto",
        '"auto": the vision tower as the checkpoint stores it (FP8 where its quantization_config quantized the '
        'tower\'s linears, else in [model] dtype); "none": in [model] dtype (FP8-stored linears dequantized at '
        'load); "fp8": every linear of the tower (attention qkv/proj, MLP, mergers) in FP8, quantized at load time '
        "per output channel where the checkpoint did not; attention, norms and the patch embedding stay in dtype. "
        'Off by default until its accuracy is shown (docs/quantization.md). fp8 needs backend = "torch".',
    )
    sm_split: int = setting(
        0,
        "On a GPU that the encoders share with a decoder replica that takes text: that replica runs on the GPU's first "
        "sm_split SMs, the encoders (and media-only replicas there) on the rest, each in a CUDA green context, so that "
        "vision work never holds the SMs a decode step needs (workers.models.sm_partition). 0: all share all.",
    )

    def validate(self, where: str) -> None:
        for name, low in (("count", 0), ("max_batch_patches", 1), ("sm_split", 0)):  # (credits: _AT_LEAST_ONE)
            if getattr(self, name) < low:
                raise ValueError(f"{where}.{name}: expected >= {low}, got {getattr(self, name)}")
        if not self.resolve_every_s > 0:
            raise ValueError(f"{where}.resolve_every_s: expected > 0, got {self.resolve_every_s}")
        indices = isinstance(self.gpus, list) and all(type(g) is int for g in self.gpus)  # (bool is an int)
        if not indices:
            raise ValueError(f"{where}.gpus: expected a list of GPU indices like [1], got {self.gpus!r}")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"{where}.gpus: GPU indices start at 0, got {self.gpus}")
        if self.gpus and self.count and self.count != len(self.gpus):
            raise ValueError(f"{where}: count = {self.count} but gpus lists {len(self.gpus)} encoders; set one of them")
        if not (isinstance(self.mps, bool) or self.mps == "auto"):  # (1 == True, so not `in (True, ...)`)
            raise ValueError(f'{where}.mps: expected true, false or "auto", got {self.mps!r}')
        if self.backend not in VISION_BACKENDS:
            names = ", ".join(map(repr, VISION_BACKENDS[:-1])) + f" or {VISION_BACKENDS[-1]!r}"
            raise ValueError(f"{where}.backend: expected {names}, got {self.backend!r}")
        if self.quantization not in QUANTIZATION_SETTINGS:
            raise ValueError(f"{where}.quantization: expected 'auto', 'none' or 'fp8', got {self.quantization!r}")
        if self.quantization == "fp8" and self.backend != "torch":
            raise ValueError(
                f"{where}.quantization = 'fp8' runs the tower's linears through FP8 GEMMs in torch; backend "
                f'{self.backend!r} runs an fp32 ONNX export of the tower; set backend = "torch" or quantization = '
                '"auto"'
            )


@dataclass
class CacheConfig:
    pool_bytes: int = setting(
        0,
        "Bytes of the embedding pool that encoders fill and decoders read: the embeddings of the requests in flight "
        'and an LRU of earlier ones. 0 or "auto": sized at start by the cache daemon, which logs the rule. On the GPU '
        "1/32 of its memory within 1..8 GiB (about what a 32-client load of three-image requests and their next "
        "turns needs on a large GPU, while the KV cache keeps nearly all it had; the decoder leaves these bytes "
        "out of its KV share). In host shared memory min(1/4 of MemAvailable, 1/2 of /dev/shm's free space, 4 GiB): "
        "the file must fit in /dev/shm beside the other processes' media (common.memory).",
    )
    device_pool: bool = setting(
        False,
        "GPU hosts: the pool in GPU memory (on GPU 0, the decoder's), so embeddings go encoder -> decoder by CUDA IPC "
        'without the host. Left out or "auto": on with a GPU and one decoder replica (it measured no slower than '
        "the host pool; replicas on other GPUs read the host pool), off on a CPU host.",
    )
    spill_bytes: int = setting(
        0,
        "Behind a GPU pool: a host shared-memory tier that evicted embeddings move to instead of being lost (0: none). "
        'Left out or "auto": min(1/4 of MemAvailable, 1/2 of /dev/shm\'s free space, 8 GiB) behind a GPU pool, '
        "none behind the host pool.",
    )
    lease_ttl_s: float = setting(
        120.0, "A request's hold on its embeddings (kept from eviction) lapses after this many seconds unless released."
    )
    pending_ttl_s: float = setting(60.0, "A slot reserved for an encoder and not filled in this many seconds is freed.")
    reserve_wait_s: float = setting(
        60.0,
        "A request whose media embeddings do not fit in the pool now waits this many seconds, in arrival order, "
        "for other requests to release theirs before it fails (503).",
    )

    def validate(self, where: str) -> None:
        if self.pool_bytes < 0 or self.spill_bytes < 0:
            raise ValueError(f"{where}: pool_bytes and spill_bytes must be >= 0")

    def check_spill(self, where: str) -> None:
        """Once device_pool is known (it may be "auto")."""
        if self.spill_bytes and not self.device_pool:
            raise ValueError(
                f"{where}.spill_bytes: a spill tier backs a GPU pool (device_pool = true); the host pool "
                "itself is host memory, so raise pool_bytes instead"
            )


@dataclass
class DecoderConfig:
    max_running: int = setting(64, "Sequences decoding at once; more wait in arrival order.")
    prefill_tokens_per_step: int = setting(
        2048,
        "Tokens per step (prefill chunks + decodes). Every running stream waits for the whole step, so this bounds "
        "the gap a burst of arriving prompts puts between two tokens; up to graph_tokens the mixed steps also replay "
        "CUDA graphs (a larger step runs eagerly).",
    )
    tokens_per_step_while_decoding: int = setting(
        0,
        "The same budget while any sequence is decoding (0: prefill_tokens_per_step). A smaller one keeps the running "
        "streams' inter-token gaps short while prompts arrive, at a cost in throughput: for when tail latency rules.",
    )
    block_size: int = setting(
        64,
        "Tokens per KV-cache block. 64: a 64-key attention tile reads one block-table entry and one contiguous run of "
        "slots. The prefix cache matches whole blocks: a shared prefix is reused to its last full block.",
    )
    kv_cache_bytes: int = setting(
        0, "Bytes of KV cache; 0: gpu_memory_fraction of the GPU memory free after loading (256 MiB on CPU)."
    )
    kv_cache_dtype: str = setting(
        "auto",
        '"auto": K/V stored in the model\'s dtype; "fp8": float8_e4m3fn with an fp32 scale per (token, kv head), '
        "computed as each token is written (amax over head_dim / 448): about twice the blocks in the same bytes. Our "
        "choice over one static scale per head, which needs calibration data we do not have; dynamic scales follow "
        "Qwen's large k-bias outliers token by token, for 4 bytes per 128-byte head vector. Runs on CPU (dequantizing "
        "reference), CUDA GPUs of compute capability >= 8.9 with the Triton kernels, and any GPU with kernels = "
        '"torch". Moves logits slightly (docs/quantization.md).',
    )
    gpu_memory_fraction: float = setting(
        0.8,
        "With kv_cache_bytes = 0: the share of free GPU memory the KV cache takes. On the GPU embedding pool's GPU "
        "(0) the pool's bytes come out of this share, whether or not the cache daemon has allocated them yet.",
    )
    prefix_cache: bool = setting(
        True, "Reuse the KV of shared prompt prefixes, images included (keyed by content hash)."
    )
    max_model_len: int = setting(0, "Longest sequence, prompt and answer; 0: the model's max_position_embeddings.")
    media_wait_s: float = setting(90.0, "A request waiting this many seconds for its image embeddings fails.")
    kernels: str = setting(
        "triton", '"triton": Triton kernels and fused projections on CUDA; "torch": plain torch everywhere.'
    )
    cuda_graphs: bool = setting(True, 'Replay steps from CUDA graphs (needs kernels = "triton" on CUDA).')
    graph_tokens: int = setting(
        2048, "Mixed prefill/decode steps up to this many tokens replay CUDA graphs too (0: none)."
    )
    overlap: bool = setting(
        True,
        "Stage step N+1 on the host while the GPU runs step N, steps with prefill chunks too (with tensor_parallel "
        "> 1: decode-graph steps only).",
    )
    tensor_parallel: int = setting(
        1, "Decoder ranks of a replica, one process and one GPU each; > 1 runs the plain-torch layers."
    )
    tp_timeout_s: float = setting(120.0, "How long the ranks wait for each other at start and in a collective.")
    replicas: int = setting(
        1,
        "Data parallelism: whole copies of the decoder, each with its own GPUs (replica r: GPUs r*tp .. r*tp+tp-1), "
        "KV cache and prefix cache. The gateway sends each request to the least loaded live replica. Left out or "
        '"auto" (with the other placement keys: text_replicas, media_replicas, replica_gpus, [encoder] gpus and '
        "count): chosen from the GPUs at start (config.place): 1 GPU: one replica; 2+ GPUs: replica 0 takes text on "
        "GPU 0, replica 1 media on GPU 1 with the encoders on GPUs 1..N-1 (vision never on the text streams' GPU); "
        "with tensor_parallel > 1: one replica. Any placement key set: the others keep their plain defaults.",
    )
    replica_gpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Each replica's first GPU (its ranks on the next ones), e.g. [0, 0]: two replicas share GPU 0, "
            "each with its share of the KV memory (and under MPS, a media-only one yields to the text one). Empty: "
            "replica r on GPU r * tensor_parallel."
        },
    )
    text_replicas: list[int] = field(
        default_factory=list, metadata={"help": "Replicas that take text-only requests (empty: all)."}
    )
    media_replicas: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Replicas that take requests with images or videos (empty: all). E.g. text_replicas = [0], "
            "media_replicas = [1], with [encoder] gpus = [1]: the text streams' GPU never runs vision work, neither "
            "the ViT nor an image prompt's prefill."
        },
    )
    kind_fallback: bool = setting(
        True,
        "While every replica of a request's kind is down (or has not started in request_timeout_s), another live "
        "replica takes it: the isolation is lost for that while, not the requests. false: they are refused, 503.",
    )

    def validate(self, where: str) -> None:
        if self.kernels not in ("triton", "torch"):
            raise ValueError(f"{where}.kernels: expected 'triton' or 'torch', got {self.kernels!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(
                f"{where}.kv_cache_dtype: expected 'auto' (the model's dtype) or 'fp8', got {self.kv_cache_dtype!r}"
            )
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
    heartbeat_s: float = setting(0.5, "Seconds between the heartbeats every process sends.")
    dead_after_s: float = setting(3.0, "A process not heard from for this many seconds is taken for dead.")
    call_timeout_s: float = setting(5.0, "A call to the cache daemon not answered in this many seconds is sent again.")
    hold_lost_requests_s: float = setting(
        30.0,
        "A request lost with its decoder before its first token, with no live replica to take it (a lone decoder "
        "that crashed: supervisord has it back in seconds), waits this long for one before it fails (0: fails now). "
        "Likewise image requests with every vision encoder down: past this, they fail at once.",
    )
    stall_exit_s: float = setting(
        300.0,
        "A process whose loop has not turned for this long (a deadlock, a stuck device call) logs every thread's "
        "stack and exits, for supervisord to restart it (0: never).",
    )

    def validate(self, where: str) -> None:
        for name in ("heartbeat_s", "dead_after_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{where}.{name}: expected > 0 seconds, got {getattr(self, name)}")
        if self.stall_exit_s < 0:
            raise ValueError(f"{where}.stall_exit_s: expected >= 0 (0: never), got {self.stall_exit_s}")
        if (hold := self.hold_lost_requests_s) < 0:
            raise ValueError(f"{where}.hold_lost_requests_s: expected >= 0 (0: none held), got {hold}")


@dataclass
class SecurityConfig:
    mode: str = setting(
        "curve",
        'How tcp:// endpoints are guarded (ipc:// ones are left to file modes). "curve": CurveZMQ, encrypted and '
        "admitting only the deployment's roles' keys; a process with a tcp:// endpoint and no keys refuses to start. "
        '"isolated-network": plaintext, for a network nothing else can reach (logged at start).',
    )
    keys_dir: str = setting(
        "",
        "Where ./ops/keys writes the roles' CurveZMQ keys: public/<role>.key (every host needs all of them) and "
        "private/<role>.key_secret (each host the roles it runs). Empty: <run directory>/keys.",
    )

    def validate(self, where: str) -> None:
        if self.mode not in SECURITY_MODES:
            raise ValueError(f"{where}.mode: expected one of {SECURITY_MODES}, got {self.mode!r}")


SECURITY_MODES = ("curve", "isolated-network")
UNIT_ROLES = ("all", "pd", "encoder")


def decoder_hub(replica: int, hub: str = "decoder") -> str:
    """The hub name (`Config.endpoint`) of a decoder replica's request socket or tensor-parallel rendezvous."""
    return hub if replica == 0 else f"{hub}-{replica}"


def decoder_name(replica: int) -> str:
    """A decoder replica's name: its program's under supervisord, its heartbeat's, its sockets' (``decoder``
    for replica 0, so that one-replica deployments keep their names; ``decoder-1`` ...)."""
    return decoder_hub(replica)


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fetcher: FetcherConfig = field(default_factory=FetcherConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    run_dir: str = setting(
        "", "Where the sockets, logs and supervisord files of this deployment go (VLM_RUN_DIR); empty: run/<port>."
    )
    endpoints: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "ZeroMQ addresses by hub name (gateway, fetch, cache, decoder, decoder-tp, encoder.K), e.g. "
            'cache = "tcp://127.0.0.1:5555"; encoder = "ipc:///tmp/enc-{gpu}.sock" names every encoder. Empty: '
            "ipc:// sockets in the run directory."
        },
    )
    source: str = ""  # (not a setting: the file it was read from)
    # (not settings:) the keys of AUTO_KEYS the file left to "auto", and what they became and why
    auto: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    choices: list[str] = field(default_factory=list, compare=False, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else REPO_ROOT / "run" / str(self.server.port)

    @property
    def keys_path(self) -> Path:
        return Path(self.security.keys_dir) if self.security.keys_dir else self.run_path / "keys"

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
        return self.endpoint(decoder_hub(replica, hub))

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
    "VLM_ROLE": ("server", "role", str),
    "VLM_DEVICE": ("model", "device", str),
    "VLM_DTYPE": ("model", "dtype", str),
}
# Every variable the processes read, for the reference; set and non-empty, each beats the file.
ENVIRONMENT = {
    "VLM_CONFIG": "the TOML file (default: ops/vlm.toml)",
    **{var: f"[{section}] {key}" for var, (section, key, _) in _ENV.items()},
    "VLM_RUN_DIR": "run_dir",
    "VLM_API_KEYS": "[server] api_keys, comma-separated",
    "VLM_CACHE_DIR": "where the built-in demo checkpoint is generated (default: ~/.cache/vlm-serve)",
    "VLM_GPU_COUNT": "the GPUs the launcher counted (it sets this for every program), for the auto layout",
}


def _apply_section(target: Any, values: dict[str, Any], where: str, section: str, auto: set[str]) -> None:
    """Set ``values`` on ``target``; the keys of ``auto`` ("section.key") it sets stop being automatic, and
    "auto" leaves them so."""
    names = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"{where}: unknown setting {key!r}; known: {', '.join(sorted(names))}")
        if f"{section}.{key}" in auto:
            if value == "auto":
                continue
            auto.discard(f"{section}.{key}")
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
    auto = set(AUTO_KEYS)
    for key, value in raw.items():
        if key in ("run_dir",):
            cfg.run_dir = str(value)
        elif key == "endpoints":
            cfg.endpoints = {str(k): str(v) for k, v in value.items()}
        elif isinstance(value, dict) and dataclasses.is_dataclass(getattr(cfg, key, None)):
            _apply_section(getattr(cfg, key), value, f"{path}: [{key}]", key, auto)
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
    cfg.auto = frozenset(auto)
    cfg.choices = resolve(cfg, gpu_count(cfg, env))
    cfg.cache.check_spill(f"{path}: [cache]")
    if cfg.decoder.replicas > 1 and cfg.cache.device_pool:
        raise ValueError(
            f"{path}: [cache] device_pool puts the embedding pool on GPU 0, beside replica 0 only; with "
            f"[decoder] replicas = {cfg.decoder.replicas} use the host pool (device_pool = false)"
        )
    return cfg


# ------------------------------------------------------------------ what "auto" becomes on this host's GPUs
# load_config applies these rules in every process, so all of them agree: the launcher (`ops.deploy`) counts the
# GPUs once and hands the count to every program (VLM_GPU_COUNT); a process started by hand counts them without
# torch. Each rule returns the line the launcher prints, naming the rule and the setting that overrides it. A
# setting written in the config file always wins: the placement rule fills nothing once any placement key is set
# (a half-automatic placement would be a layout nobody measured).

# Keys a config file may leave out or set to "auto" (section.key); the others have plain defaults.
PLACEMENT_KEYS = (
    "decoder.replicas",
    "decoder.text_replicas",
    "decoder.media_replicas",
    "decoder.replica_gpus",
    "encoder.gpus",
    "encoder.count",
)
AUTO_KEYS = frozenset({*PLACEMENT_KEYS, "cache.device_pool", "cache.spill_bytes", "cache.pool_bytes", "fetcher.count"})
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def gpu_count(cfg: Config, env: Mapping[str, str], driver_gpus: Path = NVIDIA_GPUS) -> int:
    """The GPUs the model runs on, without torch: the launcher's count (``VLM_GPU_COUNT``), else
    ``CUDA_VISIBLE_DEVICES``' entries, else the driver's GPUs; 0 with ``[model] device = "cpu"``, 1 with one named
    device (``cuda:N``)."""
    device = cfg.model.device
    if device == "cpu":
        return 0
    if env.get("VLM_GPU_COUNT", "").isdigit():
        count = int(env["VLM_GPU_COUNT"])
    elif "CUDA_VISIBLE_DEVICES" in env:
        entries = [entry.strip() for entry in env["CUDA_VISIBLE_DEVICES"].split(",")]
        # (CUDA stops at the first invalid entry: "-1" or "" hide every GPU)
        count = next((i for i, entry in enumerate(entries) if not entry or entry.startswith("-")), len(entries))
    else:
        count = len(list(driver_gpus.iterdir())) if driver_gpus.is_dir() else 0
    return min(count, 1) if device.startswith("cuda:") else count


def resolve(cfg: Config, gpus: int) -> list[str]:
    """Fill what ``cfg.auto`` names for a host of ``gpus`` GPUs; the lines that say what was chosen and why."""
    return [place(cfg, gpus), device_pool(cfg, gpus), sm_split(cfg, gpus), fetchers(cfg, gpus, usable_cpus())]


def place(cfg: Config, gpus: int) -> str:
    """Where the replicas and encoders run. One GPU: one decoder and one encoder share it. Two or more: the
    text streams get GPU 0 to themselves (replica 0 takes text only), and a media replica with the encoders
    take the others (replica 1 on GPU 1, an encoder on each of GPUs 1..N-1): the vision work never runs on
    the text streams' GPU, which kept them near their throughput without image load."""
    decoder, encoder = cfg.decoder, cfg.encoder
    override = "set [decoder] replicas / [encoder] gpus to override"
    if cfg.server.role != "all":
        return f'layout: as configured ([server] role = "{cfg.server.role}": the auto layout is for whole deployments)'
    set_by_hand = [key for key in PLACEMENT_KEYS if key not in cfg.auto]
    if set_by_hand:
        section, _, key = set_by_hand[0].partition(".")
        return f"layout: as configured ([{section}] {key} is set: the auto layout fills nothing)"
    if gpus == 0:
        return "layout: no GPU -> one decoder and one encoder on the CPU (auto)"
    if decoder.tensor_parallel > 1:
        return (
            f"layout: tensor_parallel = {decoder.tensor_parallel} -> one replica on GPUs "
            f"0..{decoder.tensor_parallel - 1}, an encoder on each GPU (auto: no layout beyond that with tensor "
            f"parallelism; {override})"
        )
    if gpus == 1:
        return f"layout: 1 GPU -> one decoder and one encoder share GPU 0 (auto; {override})"
    decoder.replicas, decoder.text_replicas, decoder.media_replicas = 2, [0], [1]
    decoder.replica_gpus = []  # replica r on GPU r
    encoder.gpus = list(range(1, gpus))
    encoders = "GPU 1" if gpus == 2 else f"GPUs 1..{gpus - 1}"
    return (
        f"layout: {gpus} GPUs -> text decoder on GPU 0, media decoder on GPU 1 and encoders on {encoders} "
        f"(auto: vision on its own GPUs; {override})"
    )


def device_pool(cfg: Config, gpus: int) -> str:
    """The embedding pool on GPU 0 (CUDA IPC) wherever a GPU runs one decoder replica: it measured no slower
    than the host pool and saves the trip through the host. Replicas on other GPUs cannot read GPU 0's pool."""
    cache = cfg.cache
    if "cache.device_pool" not in cfg.auto:
        return f"embedding pool: {'GPU' if cache.device_pool else 'host'} ([cache] device_pool = {cache.device_pool})"
    cache.device_pool = gpus > 0 and cfg.decoder.replicas == 1
    if gpus == 0:
        return "embedding pool: host shared memory (auto: no GPU)"
    if cfg.decoder.replicas > 1:
        return "embedding pool: host shared memory (auto: decoder replicas read it from their own GPUs)"
    return "embedding pool: GPU 0, by CUDA IPC (auto: a GPU and one decoder replica; [cache] device_pool = false: host)"


def sm_split(cfg: Config, gpus: int) -> str:
    """``[encoder] sm_split`` has no auto value: on one GPU it keeps the text streams' share under image load, but
    it costs image-heavy workloads more throughput than that buys (docs/isolation.md), so it is off unless set."""
    if cfg.encoder.sm_split:
        return f"SM split: text replica on the first {cfg.encoder.sm_split} SMs ([encoder] sm_split)"
    if gpus == 1:
        return (
            "SM split: off (it isolates text streams from image work but slows image requests: docs/isolation.md; "
            "[encoder] sm_split = N with routed replicas to split)"
        )
    return "SM split: off"


def fetchers(cfg: Config, gpus: int, cpus: int) -> str:
    """One fetcher per encoder (after the layout rule), as the images each encoder takes are decoded and resized
    on the CPU first; at most one per 4 cores, which each fetcher's threads keep busy."""
    if "fetcher.count" not in cfg.auto:
        return f"fetchers: {cfg.fetcher.count} ([fetcher] count)"
    encoders = len(cfg.encoder.gpus) or cfg.encoder.count or max(1, gpus)
    cfg.fetcher.count = max(1, min(encoders, cpus // 4))
    return (
        f"fetchers: {cfg.fetcher.count} of {cfg.fetcher.threads} threads (auto: one per encoder ({encoders}), at most "
        f"one per 4 of {cpus} CPU cores; [fetcher] count to override)"
    )


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity mask, as a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ------------------------------------------------------------------ the reference


def sections(cfg: Config) -> dict[str, Any]:
    """The TOML sections of ``cfg`` (``[server]``, ``[model]`` ...) by name."""
    return {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(f.default_factory)
    }


def reference(cfg: Config | None = None) -> str:
    """Every setting as TOML that loads as ``cfg`` (default: the defaults), each key under its help as a comment,
    after the environment variables that override them: what ``python -m common.config --defaults`` prints."""
    if cfg is None:
        cfg = Config(auto=AUTO_KEYS)
    lines = [
        "# vlm-serve settings, every one with its default: `python -m common.config --defaults` prints this.",
        "# Every process reads one TOML file ($VLM_CONFIG, else ops/vlm.toml); a key left out keeps its default.",
        "# Environment variables, set and non-empty, beat the file:",
        *(f"#   {var:<14}{meaning}" for var, meaning in ENVIRONMENT.items()),
        "",
        *_setting_lines(cfg, "run_dir"),
        *_setting_lines(cfg, "endpoints"),
    ]
    for name, section in sections(cfg).items():
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(section):
            lines += _setting_lines(section, f.name, f"{name}.{f.name}" in cfg.auto)
    return "\n".join(lines) + "\n"


def _help(target: Any, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(target) if f.name == name)


def _comment(text: str) -> list[str]:
    return [f"# {line}" for line in textwrap.wrap(text, width=116, break_on_hyphens=False)]


def _setting_lines(target: Any, name: str, auto: bool = False) -> list[str]:
    value = '"auto"' if auto else _toml(getattr(target, name))
    return [*_comment(_help(target, name)), f"{name} = {value}"]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # (a JSON string is a TOML basic string)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(key)} = {_toml(each)}" for key, each in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.config", description="vlm-serve's settings.")
    parser.add_argument(
        "--defaults", action="store_true", help="print every setting with its default and help, as TOML"
    )
    args = parser.parse_args(argv)
    if not args.defaults:
        parser.print_usage()
        return 2
    print(reference(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
