"""Unit tests for ``common/config.py``: defaults, TOML sections, environment overrides, endpoints."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from common import config as config_mod
from common.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    CacheConfig,
    Config,
    DecoderConfig,
    EncoderConfig,
    FetcherConfig,
    LivenessConfig,
    ModelConfig,
    ServerConfig,
    decoder_name,
    load_config,
    main,
    reference,
    sections,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vlm.toml"
    path.write_text(text)
    return path


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    # (not the defaults: a typo in VLM_CONFIG must not start a stack on port 8000 instead)
    with pytest.raises(ValueError, match=r"nope\.toml does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ValueError, match=r"nope\.toml does not exist"):
        load_config(env={"VLM_CONFIG": str(tmp_path / "nope.toml")})


def test_defaults_when_the_file_is_empty(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""), env={})
    assert cfg.server == ServerConfig()
    assert cfg.model == ModelConfig()
    assert cfg.fetcher == FetcherConfig()
    assert cfg.encoder == EncoderConfig()
    assert cfg.cache == CacheConfig()
    assert cfg.decoder == DecoderConfig()
    assert cfg.liveness == LivenessConfig()
    assert cfg.run_dir == "" and cfg.endpoints == {}
    assert cfg.source == str(tmp_path / "vlm.toml")
    # A few concrete values, so a changed default is noticed.
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert cfg.fetcher.allow_private_addresses is False
    assert cfg.liveness.dead_after_s == 3.0
    assert cfg.run_path == REPO_ROOT / "run" / "8000"


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""), env={})
    assert cfg.server == ServerConfig() and cfg.cache == CacheConfig()


def test_vlm_config_variable_picks_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 9123\n")
    cfg = load_config(None, env={"VLM_CONFIG": str(path)})
    assert cfg.server.port == 9123
    assert cfg.source == str(path)
    # An explicit path beats VLM_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text("[server]\nport = 9124\n")
    assert load_config(other, env={"VLM_CONFIG": str(path)}).server.port == 9124


def test_no_path_and_no_variable_reads_the_shipped_file() -> None:
    assert load_config(None, env={}).source == str(DEFAULT_CONFIG)


def test_toml_sections_override(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
run_dir = "/tmp/vlm-run-x"

[server]
host = "0.0.0.0"
port = 9001
served_model_name = "qwen"

[model]
path = "/models/qwen2-vl"
dtype = "float16"

[fetcher]
allow_private_addresses = true
credits = 2
http_timeout_s = 4

[cache]
pool_bytes = 1048576

[liveness]
dead_after_s = 7
""",
    )
    cfg = load_config(path, env={})
    assert (cfg.server.host, cfg.server.port, cfg.server.served_model_name) == ("0.0.0.0", 9001, "qwen")
    assert cfg.server.request_timeout_s == ServerConfig().request_timeout_s  # untouched key keeps its default
    assert (cfg.model.path, cfg.model.dtype, cfg.model.device) == ("/models/qwen2-vl", "float16", "auto")
    assert cfg.fetcher.allow_private_addresses is True
    assert cfg.fetcher.credits == 2
    assert cfg.cache.pool_bytes == 1048576
    assert cfg.decoder == DecoderConfig()  # untouched section keeps its defaults
    assert cfg.run_dir == "/tmp/vlm-run-x"
    assert cfg.run_path == Path("/tmp/vlm-run-x")
    # TOML integers for float settings become floats.
    assert cfg.liveness.dead_after_s == 7.0 and isinstance(cfg.liveness.dead_after_s, float)
    assert isinstance(cfg.fetcher.http_timeout_s, float)


def test_env_overrides_beat_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhost = "10.0.0.1"\nport = 9001\n[model]\npath = "/from/file"\n')
    env = {
        "VLM_MODEL": "/from/env",
        "VLM_HOST": "0.0.0.0",
        "VLM_PORT": "9555",
        "VLM_RUN_DIR": str(tmp_path / "rd"),
        "VLM_DEVICE": "cpu",
        "VLM_DTYPE": "float32",
    }
    cfg = load_config(path, env=env)
    assert cfg.model.path == "/from/env"
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.port == 9555 and isinstance(cfg.server.port, int)
    assert cfg.run_dir == str(tmp_path / "rd")
    assert cfg.endpoint("cache") == f"ipc://{tmp_path / 'rd' / 'cache.sock'}"
    assert (cfg.model.device, cfg.model.dtype) == ("cpu", "float32")


def test_env_run_dir_beats_the_file_run_dir(tmp_path: Path) -> None:
    path = write(tmp_path, 'run_dir = "/tmp/from-file"\n')
    assert load_config(path, env={}).run_dir == "/tmp/from-file"
    assert load_config(path, env={"VLM_RUN_DIR": "/tmp/from-env"}).run_dir == "/tmp/from-env"


def test_empty_env_values_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 9001\n")
    cfg = load_config(path, env={"VLM_PORT": "", "VLM_HOST": "", "VLM_RUN_DIR": ""})
    assert (cfg.server.port, cfg.server.host, cfg.run_dir) == (9001, "127.0.0.1", "")


def test_explicit_env_ignores_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLM_PORT", "1234")
    monkeypatch.setenv("VLM_MODEL", "/process/env")
    path = write(tmp_path, "[server]\nport = 9001\n")
    cfg = load_config(path, env={})
    assert cfg.server.port == 9001 and cfg.model.path == ""
    # ... while env=None does read it.
    assert load_config(path).server.port == 1234


def test_unknown_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gpu_farm'"):
        load_config(write(tmp_path, "[gpu_farm]\nsize = 3\n"), env={})


def test_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'portt'"):
        load_config(write(tmp_path, "portt = 3\n"), env={})


def test_section_name_used_as_a_scalar_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'server'"):
        load_config(write(tmp_path, "server = 3\n"), env={})


def test_unknown_key_is_named_with_its_section(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[cache\].*'pool_size'") as info:
        load_config(write(tmp_path, "[cache]\npool_size = 3\n"), env={})
    assert "pool_bytes" in str(info.value)  # the known keys are listed


@pytest.mark.parametrize("name", ["source", "run_path", "deployment_id"])
def test_section_named_like_a_config_attribute_is_named(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        load_config(write(tmp_path, f"[{name}]\nx = 1\n"), env={})


@pytest.mark.parametrize("value", ['"yes"', "1", "0", '"false"'])
def test_bool_settings_need_true_or_false(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match="allow_private_addresses"):
        load_config(write(tmp_path, f"[fetcher]\nallow_private_addresses = {value}\n"), env={})


def test_bool_settings_accept_booleans(tmp_path: Path) -> None:
    on = load_config(write(tmp_path, "[fetcher]\nallow_private_addresses = true\n"), env={})
    assert on.fetcher.allow_private_addresses is True
    off = load_config(write(tmp_path, "[fetcher]\nallow_private_addresses = false\n"), env={})
    assert off.fetcher.allow_private_addresses is False


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ('"auto"', "auto")])
def test_mps_takes_a_boolean_or_auto(tmp_path: Path, value: str, expected: bool | str) -> None:
    assert load_config(write(tmp_path, f"[encoder]\nmps = {value}\n"), env={}).encoder.mps == expected


@pytest.mark.parametrize("value", ['"yes"', "1", '"on"'])
def test_mps_refuses_anything_else(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match=r"mps: expected true, false or \"auto\""):
        load_config(write(tmp_path, f"[encoder]\nmps = {value}\n"), env={})


# --------------------------------------------------------------------------- endpoints


@pytest.mark.parametrize("name", ["gateway", "fetch", "cache", "decoder", "encoder.0", "encoder.3"])
def test_endpoint_defaults_to_ipc_in_the_run_dir(name: str) -> None:
    cfg = Config()
    cfg.server.port = 8123
    assert cfg.endpoint(name) == f"ipc://{REPO_ROOT / 'run' / '8123' / (name + '.sock')}"


def test_two_ports_two_deployments() -> None:
    a, b = Config(), Config()
    a.server.port, b.server.port = 8123, 8124
    for name in ("gateway", "fetch", "cache", "decoder", "encoder.0"):
        assert a.endpoint(name) != b.endpoint(name)
    assert a.deployment_id != b.deployment_id
    assert len(a.deployment_id) == 10 and a.deployment_id.isalnum()
    # Stable: the same run dir always gives the same id.
    c = Config()
    c.server.port = 8123
    assert c.deployment_id == a.deployment_id


def test_run_dir_sets_the_deployment(tmp_path: Path) -> None:
    a, b = Config(run_dir=str(tmp_path / "a")), Config(run_dir=str(tmp_path / "b"))
    a.server.port = b.server.port = 8000
    assert a.endpoint("cache") == f"ipc://{tmp_path / 'a' / 'cache.sock'}"
    assert a.deployment_id != b.deployment_id


def test_explicit_endpoints_win(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[endpoints]
cache = "tcp://127.0.0.1:5555"
encoder = "ipc:///tmp/vlm-enc-{gpu}.sock"
"encoder.1" = "tcp://10.0.0.2:6000"
""",
    )
    cfg = load_config(path, env={})
    assert cfg.endpoint("cache") == "tcp://127.0.0.1:5555"
    assert cfg.endpoint("encoder.0") == "ipc:///tmp/vlm-enc-0.sock"
    assert cfg.endpoint("encoder.7") == "ipc:///tmp/vlm-enc-7.sock"
    assert cfg.endpoint("encoder.1") == "tcp://10.0.0.2:6000"  # an exact name beats the template
    assert cfg.endpoint("decoder") == f"ipc://{cfg.run_path / 'decoder.sock'}"  # others keep the default


def settings_of(cfg: Config) -> dict[str, list[dataclasses.Field]]:
    """Every setting's field by section ("" for the top-level keys)."""
    top = [f for f in dataclasses.fields(cfg) if f.name in ("run_dir", "endpoints")]
    return {"": top} | {name: list(dataclasses.fields(section)) for name, section in sections(cfg).items()}


def test_every_setting_has_help() -> None:
    fields = settings_of(Config())
    assert set(fields) == {"", "server", "model", "fetcher", "encoder", "cache", "decoder", "liveness", "security"}
    missing = [f"[{s}] {f.name}" for s, each in fields.items() for f in each if not f.metadata.get("help", "").strip()]
    assert not missing, f"settings without help: {missing}"


def helps_in(text: str) -> dict[tuple[str, str], str]:
    """The comment block above each key of a reference, by (section, key)."""
    helps, section, comment = {}, "", []
    for line in text.splitlines():
        if line.startswith("# "):
            comment.append(line[2:])
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line:
            helps[section, line.split(" = ")[0]] = " ".join(comment)
        comment = []
    return helps


def test_the_reference_covers_every_setting_with_its_default(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--defaults"]) == 0
    text = capsys.readouterr().out
    assert text == reference()
    raw, helps = tomllib.loads(text), helps_in(text)
    for section, each in settings_of(Config()).items():
        keys = raw if not section else raw[section]
        for f in each:
            assert f.name in keys, f"[{section}] {f.name} is not in the reference"
            assert helps[section, f.name] == " ".join(f.metadata["help"].split()), f"[{section}] {f.name}'s help"
    assert load_config(write(tmp_path, text), env={}) == Config(source=str(tmp_path / "vlm.toml"))
    for var in ("VLM_CONFIG", "VLM_MODEL", "VLM_HOST", "VLM_PORT", "VLM_CACHE_DIR", "VLM_API_KEYS", "VLM_RUN_DIR"):
        assert f"#   {var}" in text


def test_the_reference_shows_the_settings_it_is_given() -> None:
    cfg = Config()
    cfg.decoder.replica_gpus, cfg.encoder.mps, cfg.endpoints = [0, 0], True, {"cache": "tcp://127.0.0.1:5555"}
    raw = tomllib.loads(reference(cfg))
    assert raw["decoder"]["replica_gpus"] == [0, 0] and raw["encoder"]["mps"] is True
    assert raw["endpoints"] == {"cache": "tcp://127.0.0.1:5555"}


def test_main_without_a_flag_shows_its_usage(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert "--defaults" in capsys.readouterr().out


def test_the_shipped_file_holds_only_settings_that_differ_from_their_defaults() -> None:
    cfg, defaults = load_config(DEFAULT_CONFIG, env={}), Config()
    raw = tomllib.loads(DEFAULT_CONFIG.read_text())
    for section, values in raw.items():
        assert isinstance(values, dict), f"top-level key {section} in the shipped file"
        assert section in sections(defaults), f"[{section}] is not a section"
        for key, value in values.items():
            assert key in {f.name for f in dataclasses.fields(getattr(defaults, section))}, f"[{section}] {key}"
            assert value != getattr(getattr(defaults, section), key), f"[{section}] {key} is its default"
            assert getattr(getattr(cfg, section), key) == value, f"[{section}] {key}"


def test_decoder_kernels_choice_is_checked(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, '[decoder]\nkernels = "torch"\n'), env={}).decoder.kernels == "torch"
    with pytest.raises(ValueError, match=r"\[decoder\]\.kernels: expected 'triton' or 'torch', got 'flash'"):
        load_config(write(tmp_path, '[decoder]\nkernels = "flash"\n'), env={})


def test_encoder_gpus_are_checked(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[encoder]\ngpus = [1]\n"), env={}).encoder.gpus == [1]
    for bad, message in (
        ('gpus = "1"', r"\.gpus: expected a list of GPU indices like \[1\], got '1'"),
        ("gpus = [true]", r"\.gpus: expected a list of GPU indices"),
        ("gpus = [-1]", r"\.gpus: GPU indices start at 0"),
        ("gpus = [0, 1]\ncount = 3", "count = 3 but gpus lists 2 encoders"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(write(tmp_path, f"[encoder]\n{bad}\n"), env={})


def test_the_decoding_step_budget_is_checked(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[decoder]\ntokens_per_step_while_decoding = 512\n"), env={})
    assert cfg.decoder.tokens_per_step_while_decoding == 512
    with pytest.raises(ValueError, match=r"while_decoding: expected 0 \(off\) to prefill_tokens_per_step"):
        load_config(write(tmp_path, "[decoder]\ntokens_per_step_while_decoding = 4096\n"), env={})
    with pytest.raises(ValueError, match=r"prefill_tokens_per_step: expected >= 1, got 0"):
        load_config(write(tmp_path, "[decoder]\nprefill_tokens_per_step = 0\n"), env={})


def test_decoder_replicas_have_their_own_names_sockets_and_gpus(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[decoder]\nreplicas = 3\ntensor_parallel = 2\n"), env={})
    assert [decoder_name(r) for r in range(3)] == ["decoder", "decoder-1", "decoder-2"]
    assert cfg.decoder_endpoint(0) == cfg.endpoint("decoder")  # one replica: the names it always had
    assert cfg.decoder_endpoint(0, "decoder-tp") == cfg.endpoint("decoder-tp")
    assert cfg.decoder_endpoint(2) == f"ipc://{cfg.run_path / 'decoder-2.sock'}"
    assert cfg.decoder_endpoint(2, "decoder-tp") == f"ipc://{cfg.run_path / 'decoder-tp-2.sock'}"
    assert len({cfg.decoder_endpoint(r, hub) for r in range(3) for hub in ("decoder", "decoder-tp")}) == 6
    assert [cfg.decoder_gpu(r, k) for r in range(3) for k in range(2)] == [0, 1, 2, 3, 4, 5]


def test_replicas_refuse_the_gpu_pool_of_replica_0(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas = 2 use the host pool"):
        load_config(write(tmp_path, "[decoder]\nreplicas = 2\n[cache]\ndevice_pool = true\n"), env={})


def test_replicas_can_be_placed_on_chosen_gpus(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, "[decoder]\nreplicas = 3\ntensor_parallel = 2\nreplica_gpus = [0, 0, 4]\n"), env={}
    )
    assert [cfg.decoder_gpu(r, k) for r in range(3) for k in range(2)] == [0, 1, 0, 1, 4, 5]
    assert cfg.replica_gpu_set(1) == {0, 1}
    assert cfg.decoder_gpus() == {0, 1, 4, 5} and cfg.decoder_gpus([2]) == {4, 5}
    with pytest.raises(
        ValueError, match=r"replica_gpus: \[0\] names 1 GPU\(s\), one per replica is needed \(replicas = 2\)"
    ):
        load_config(write(tmp_path, "[decoder]\nreplicas = 2\nreplica_gpus = [0]\n"), env={})
    with pytest.raises(ValueError, match=r"replica_gpus: expected a list of GPU indices like \[0, 0\], got \[0, -1\]"):
        load_config(write(tmp_path, "[decoder]\nreplicas = 2\nreplica_gpus = [0, -1]\n"), env={})


def test_liveness_times_must_be_positive(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[liveness]\nhold_lost_requests_s = 0\n"), env={})
    assert cfg.liveness.hold_lost_requests_s == 0.0  # (none held: lost requests fail at once, as before)
    with pytest.raises(ValueError, match=r"hold_lost_requests_s: expected >= 0 \(0: none held\), got -1.0"):
        load_config(write(tmp_path, "[liveness]\nhold_lost_requests_s = -1\n"), env={})
    with pytest.raises(ValueError, match=r"\[liveness\].dead_after_s: expected > 0 seconds, got 0.0"):
        load_config(write(tmp_path, "[liveness]\ndead_after_s = 0\n"), env={})


@pytest.mark.parametrize("value", ["auto", "none", "fp8"])
def test_model_quantization_takes_its_three_values(tmp_path: Path, value: str) -> None:
    assert ModelConfig().quantization == "auto"  # the checkpoint's own format unless told otherwise
    assert load_config(write(tmp_path, f'[model]\nquantization = "{value}"'), env={}).model.quantization == value


@pytest.mark.parametrize("value", ["auto", "none", "fp8"])
def test_encoder_quantization_takes_its_three_values(tmp_path: Path, value: str) -> None:
    assert EncoderConfig().quantization == "auto"  # the tower as the checkpoint stores it: load-time FP8 is opt-in
    assert load_config(write(tmp_path, f'[encoder]\nquantization = "{value}"'), env={}).encoder.quantization == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\napi_keys = "sk-1"', r"\[server\]\.api_keys: expected a list of non-empty strings"),
        ("[server]\nport = 70000", r"\.port: expected 1\.\.65535, got 70000"),
        ("[server]\nrequest_timeout_s = -1", r"\.request_timeout_s: expected > 0, got -1"),
        ("[decoder]\nmax_running = 0", r"\.max_running: expected >= 1, got 0"),
        ("[decoder]\nmax_running = 1.9", r"\.max_running: expected an integer, got 1\.9"),
        ('[decoder]\nmax_running = "lots"', r"\.max_running: expected an integer, got 'lots'"),
        ("[decoder]\nblock_size = 0", r"\.block_size: expected >= 1"),
        ("[decoder]\ngpu_memory_fraction = 7.5", r"\.gpu_memory_fraction: expected a share of the GPU in \(0, 1\]"),
        ("[fetcher]\nhttp_timeout_s = -5", r"\.http_timeout_s: expected > 0"),
        ("[fetcher]\ncredits = 0", r"\.credits: expected >= 1"),
        ("[encoder]\nsm_split = -8", r"\.sm_split: expected >= 0, got -8"),
        (
            '[model]\ndtype = "fp8_typo"',
            r"\.dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got 'fp8_typo'",
        ),
        ('[model]\ndevice = "tpu"', r"\.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ('[model]\nquantization = "awq"', r"\.quantization: expected 'auto', 'none' or 'fp8', got 'awq'"),
        (
            '[encoder]\nquantization = "int8"',
            r"\[encoder\]\.quantization: expected 'auto', 'none' or 'fp8', got 'int8'",
        ),
        (
            '[encoder]\nquantization = "fp8"\nbackend = "onnxruntime"',
            r"\[encoder\]\.quantization = 'fp8' runs .* backend 'onnxruntime' .*set backend = \"torch\"",
        ),
        ("[server]\nport = = 1", r"vlm\.toml is not valid TOML: .*line 2"),
    ],
)
def test_settings_are_checked_when_loaded(tmp_path: Path, text: str, message: str) -> None:
    # (each of these loaded before, and showed only as workers restarting for ever, or a stack that never answered)
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, text), env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VLM_PORT": "abc"}, r"VLM_PORT='abc': expected int"),
        ({"VLM_PORT": "0"}, r"VLM_PORT\.port: expected 1\.\.65535"),
        ({"VLM_DTYPE": "fp4"}, r"VLM_DTYPE\.dtype: expected 'auto'"),
        ({"VLM_DEVICE": "tpu"}, r"VLM_DEVICE\.device: expected 'auto'"),
    ],
)
def test_environment_settings_are_checked(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, ""), env=env)
    assert (
        load_config(write(tmp_path, "[decoder]\ngpu_memory_fraction = 1\n"), env={}).decoder.gpu_memory_fraction == 1.0
    )


# ------------------------------------------------------------------ settings left to "auto" (common.config.resolve)


def on_gpus(tmp_path: Path, gpus: int, text: str = "") -> Config:
    return load_config(write(tmp_path, text), env={"VLM_GPU_COUNT": str(gpus)})


def test_no_gpu_or_one_keeps_one_decoder_and_one_encoder(tmp_path: Path) -> None:
    for gpus in (0, 1):
        cfg = on_gpus(tmp_path, gpus)
        assert (cfg.decoder.replicas, cfg.decoder.text_replicas, cfg.decoder.media_replicas) == (1, [], [])
        assert (cfg.decoder.replica_gpus, cfg.encoder.gpus, cfg.encoder.count) == ([], [], 0)
        assert cfg.encoder.sm_split == 0  # it slows image requests: off, and the log says so
        assert cfg.cache.device_pool is (gpus == 1)  # the GPU pool wherever a GPU runs one replica
    assert on_gpus(tmp_path, 0).choices[0] == "layout: no GPU -> one decoder and one encoder on the CPU (auto)"
    choices = on_gpus(tmp_path, 1).choices
    assert choices[0].startswith("layout: 1 GPU -> one decoder and one encoder share GPU 0 (auto; set")
    assert choices[1].startswith("embedding pool: GPU 0, by CUDA IPC (auto:")
    assert choices[2].startswith("SM split: off (it isolates text streams from image work but slows image requests")
    assert choices[3].startswith("fetchers: 1 of 4 threads (auto: one per encoder (1), at most one per 4 of")


@pytest.mark.parametrize(("gpus", "cpus", "fetchers"), [(0, 2, 1), (1, 16, 1), (2, 16, 1), (4, 8, 2), (8, 128, 7)])
def test_fetchers_follow_the_encoders_within_the_cores(tmp_path: Path, gpus: int, cpus: int, fetchers: int) -> None:
    """One fetcher per encoder (the layout rule's: GPUs 1..N-1 on 2+ GPUs), at most one per 4 cores."""
    cfg = on_gpus(tmp_path, gpus)
    line = config_mod.fetchers(cfg, gpus, cpus)
    assert cfg.fetcher.count == fetchers and line.startswith(f"fetchers: {fetchers} of 4 threads (auto:")
    set_by_hand = on_gpus(tmp_path, gpus, "[fetcher]\ncount = 3\n")
    assert config_mod.fetchers(set_by_hand, gpus, cpus) == "fetchers: 3 ([fetcher] count)"
    assert set_by_hand.fetcher.count == 3
    with pytest.raises(ValueError, match="count: expected >= 1"):
        on_gpus(tmp_path, gpus, "[fetcher]\ncount = 0\n")


@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_two_gpus_or_more_give_vision_its_own_gpus(tmp_path: Path, gpus: int) -> None:
    cfg = on_gpus(tmp_path, gpus)
    decoder = cfg.decoder
    assert (decoder.replicas, decoder.text_replicas, decoder.media_replicas, decoder.replica_gpus) == (2, [0], [1], [])
    assert [cfg.decoder_gpu(r) for r in range(2)] == [0, 1]  # text replica on GPU 0, media replica on GPU 1
    assert cfg.encoder.gpus == list(range(1, gpus))  # no encoder on the text streams' GPU
    assert cfg.cache.device_pool is False  # replicas read the host pool
    assert cfg.choices[0].startswith(f"layout: {gpus} GPUs -> text decoder on GPU 0, media decoder on GPU 1")
    assert "host shared memory (auto: decoder replicas" in cfg.choices[1]


def test_tensor_parallelism_gets_no_auto_layout(tmp_path: Path) -> None:
    cfg = on_gpus(tmp_path, 4, "[decoder]\ntensor_parallel = 2\n")
    assert (cfg.decoder.replicas, cfg.decoder.text_replicas, cfg.encoder.gpus) == (1, [], [])
    assert cfg.choices[0].startswith("layout: tensor_parallel = 2 -> one replica on GPUs 0..1")


@pytest.mark.parametrize(
    "text",
    [
        "[decoder]\nreplicas = 1\n",
        "[decoder]\nreplica_gpus = [0]\n",
        "[decoder]\ntext_replicas = []\n",
        "[encoder]\ngpus = [0, 1]\n",
        "[encoder]\ncount = 2\n",
    ],
)
def test_any_placement_key_set_wins_and_the_auto_layout_fills_nothing(tmp_path: Path, text: str) -> None:
    cfg = on_gpus(tmp_path, 2, text)
    assert cfg.decoder.replicas == 1 and cfg.decoder.text_replicas == [] and cfg.decoder.media_replicas == []
    assert cfg.choices[0].startswith("layout: as configured (")
    assert cfg.cache.device_pool is True  # one replica on a GPU: the pool's own rule still applies


def test_auto_can_be_written_and_explicit_pool_settings_win(tmp_path: Path) -> None:
    cfg = on_gpus(tmp_path, 2, '[decoder]\nreplicas = "auto"\n[cache]\npool_bytes = "auto"\ndevice_pool = "auto"\n')
    assert cfg.decoder.replicas == 2 and cfg.cache.pool_bytes == 0 and cfg.cache.device_pool is False
    cfg = on_gpus(tmp_path, 1, "[cache]\ndevice_pool = false\npool_bytes = 1048576\n")
    assert cfg.cache.device_pool is False and cfg.cache.pool_bytes == 1048576
    assert cfg.choices[1] == "embedding pool: host ([cache] device_pool = False)"
    with pytest.raises(ValueError, match="spill_bytes: a spill tier backs a GPU pool"):
        on_gpus(tmp_path, 1, "[cache]\ndevice_pool = false\nspill_bytes = 1048576\n")
    assert on_gpus(tmp_path, 1, "[cache]\nspill_bytes = 1048576\n").cache.spill_bytes == 1048576  # GPU pool: fine
    with pytest.raises(ValueError, match="replicas = 2 use the host pool"):
        on_gpus(tmp_path, 2, "[cache]\ndevice_pool = true\n")  # the auto layout's replicas cannot read GPU 0's pool
    with pytest.raises(ValueError, match=r"\[decoder\]\.replicas: expected an integer"):
        on_gpus(tmp_path, 2, '[decoder]\nreplicas = "two"\n')


def test_the_gpu_count_without_torch(tmp_path: Path) -> None:
    from common.config import gpu_count

    driver = tmp_path / "gpus"
    for pci in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / pci).mkdir(parents=True)
    cfg = Config()
    assert gpu_count(cfg, {}, driver) == 3
    assert gpu_count(cfg, {}, tmp_path / "none") == 0  # no NVIDIA driver
    assert gpu_count(cfg, {"CUDA_VISIBLE_DEVICES": "1,3"}, driver) == 2
    assert gpu_count(cfg, {"CUDA_VISIBLE_DEVICES": "0,-1,2"}, driver) == 1  # CUDA stops at an invalid entry
    assert gpu_count(cfg, {"CUDA_VISIBLE_DEVICES": ""}, driver) == 0
    assert gpu_count(cfg, {"VLM_GPU_COUNT": "2", "CUDA_VISIBLE_DEVICES": "0"}, driver) == 2  # the launcher's count
    cfg.model.device = "cuda:1"
    assert gpu_count(cfg, {}, driver) == 1  # one named device: no layout over GPUs
    cfg.model.device = "cpu"
    assert gpu_count(cfg, {"VLM_GPU_COUNT": "2"}, driver) == 0


def test_the_reference_shows_auto_and_loads_back_as_auto(tmp_path: Path) -> None:
    raw = tomllib.loads(reference())
    assert raw["decoder"]["replicas"] == "auto" and raw["cache"]["device_pool"] == "auto"
    assert raw["encoder"]["gpus"] == "auto" and raw["cache"]["pool_bytes"] == "auto"
    assert "mps_encoder_sm_percent" not in raw["encoder"]  # removed: measured, settled
    cfg = on_gpus(tmp_path, 2, reference())
    assert cfg.decoder.replicas == 2 and cfg.choices[0].startswith("layout: 2 GPUs")
