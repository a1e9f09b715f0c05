"""The supervisord configuration a deployment runs: its own paths, one encoder per GPU."""

from __future__ import annotations

import configparser
import socket
from pathlib import Path

import pytest
import torch

from common.config import UNIT_ROLES, Config
from common.topology import UNIT_PROCESSES, check_unit, encoder_count
from ops.deploy import REPO, MpsPlan, mps_wanted, preflight, render
from workers.models.runtime import encoder_gpu, resolve_device


def rendered(encoders: int, run: Path) -> configparser.RawConfigParser:
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, run, encoders)
    assert "%(here)s" not in text
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    return parser


def test_encoder_processes_follow_the_count_and_nothing_else_changes(tmp_path: Path) -> None:
    one, three = rendered(1, tmp_path / "run"), rendered(3, tmp_path / "run")
    assert one["program:encoder"]["numprocs"] == "1" and three["program:encoder"]["numprocs"] == "3"
    for section in one.sections():
        for key, value in one[section].items():
            if (section, key) != ("program:encoder", "numprocs"):
                assert three[section][key] == value, (section, key)
    assert three["program:fetcher"]["numprocs"] == "1"
    assert three["program:encoder"]["stdout_logfile"] == f"{tmp_path}/run/logs/encoder-%(process_num)d.log"
    assert three["program:encoder"]["command"].startswith(f"{REPO}/.venv/bin/python -m workers.encoder --gpu")


def test_fetcher_processes_follow_their_count(tmp_path: Path) -> None:
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2, fetchers=3)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    fetcher = parser["program:fetcher"]
    assert (fetcher["numprocs"], parser["program:encoder"]["numprocs"]) == ("3", "2")
    assert fetcher["command"].endswith("-m workers.fetcher --index %(process_num)d")  # each its own index
    with pytest.raises(ValueError, match="one fetcher"):
        render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 1, fetchers=0)


def test_encoder_count_and_bad_counts(tmp_path: Path) -> None:
    cfg = Config()
    cfg.encoder.count = 2
    assert encoder_count(cfg) == 2
    cfg.encoder.count = 0
    assert encoder_count(cfg) == max(1, torch.cuda.device_count())  # one per GPU, one on a CPU host
    cfg.encoder.gpus = [1]  # a dedicated vision GPU: one encoder, whatever the host has
    assert encoder_count(cfg) == 1
    with pytest.raises(ValueError, match="at least one encoder"):
        render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 0)


def test_a_tensor_parallel_decoder_gets_its_other_ranks(tmp_path: Path) -> None:
    assert not rendered(1, tmp_path).has_section("program:decoder-rank")  # size 1: no rank waits for nobody
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2, decoder_ranks=4)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    ranks = parser["program:decoder-rank"]
    assert (ranks["numprocs"], ranks["numprocs_start"]) == ("3", "1")  # ranks 1, 2, 3 beside rank 0
    assert ranks["command"].endswith("-m workers.decoder --rank %(process_num)d")
    assert ranks["stdout_logfile"] == f"{tmp_path}/logs/decoder-rank-%(process_num)d.log"
    assert parser["program:decoder"]["command"].endswith("-m workers.decoder")  # rank 0 unchanged
    # Started before rank 0 and stopped after it, so rank 0's stop broadcast finds them still there.
    assert int(ranks["priority"]) < int(parser["program:decoder"]["priority"])


def test_decoder_replicas_each_get_a_program_and_their_own_ranks(tmp_path: Path) -> None:
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2, 2, MpsPlan(), replicas=3)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    programs = [s.removeprefix("program:") for s in parser.sections() if s.startswith("program:")]
    for replica, name in enumerate(["decoder", "decoder-1", "decoder-2"]):
        program, ranks = parser[f"program:{name}"], parser[f"program:{name}-rank"]
        replica_args = f" --replica {replica}" if replica else ""
        assert program["command"].endswith(f"-m workers.decoder{replica_args}"), name
        assert program["stdout_logfile"] == f"{tmp_path}/logs/{name}.log"
        assert "numprocs" not in program  # (supervisord's process name is the program's: the replica's name)
        assert ranks["command"].endswith(f"-m workers.decoder{replica_args} --rank %(process_num)d"), name
        assert ranks["stdout_logfile"] == f"{tmp_path}/logs/{name}-rank-%(process_num)d.log"
        assert (ranks["numprocs"], ranks["numprocs_start"]) == ("1", "1")
        assert int(ranks["priority"]) < int(program["priority"])
        for section in (program, ranks):  # each talks to the deployment's MPS daemon, at normal priority
            assert f'CUDA_MPS_PIPE_DIRECTORY="{tmp_path}/mps/pipe"' in section["environment"], name
            assert "CLIENT_PRIORITY" not in section["environment"], name
        assert name in programs and f"{name}-rank" in programs
    one = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2)
    assert "--replica" not in one and "decoder-1" not in one


def test_mps_daemon_runs_first_per_deployment(tmp_path: Path) -> None:
    assert not rendered(1, tmp_path).has_section("program:mps")  # off unless asked for
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2, mps=MpsPlan())
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    mps = parser["program:mps"]
    assert int(mps["priority"]) < min(
        int(parser[s]["priority"]) for s in parser.sections() if s != "program:mps" and s.startswith("program:")
    )
    assert f"{tmp_path}/mps/pipe" in mps["command"] and "nvidia-cuda-mps-control -f" in mps["command"]
    pipe = f'CUDA_MPS_PIPE_DIRECTORY="{tmp_path}/mps/pipe"'
    assert pipe in parser["program:encoder"]["environment"] and pipe in parser["program:decoder"]["environment"]
    assert "ACTIVE_THREAD" not in text  # no SM caps: they do not keep the two sides off each other's SMs
    # the encoders yield the SMs to the decoder
    assert 'CUDA_MPS_CLIENT_PRIORITY="1"' in parser["program:encoder"]["environment"]
    assert "CLIENT_PRIORITY" not in parser["program:decoder"]["environment"]
    # no group: supervisord stops each program's group in turn (the gateway first, the MPS daemon last)
    assert not [s for s in parser.sections() if s.startswith("group:")]


def test_mps_auto_is_on_only_where_it_was_measured_to_pay() -> None:
    cfg = Config()
    assert cfg.encoder.mps == "auto"
    assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True) == (True, "auto: an encoder shares the decoder's GPU")
    assert mps_wanted(cfg, has_gpu=lambda: False, has_daemon=True)[0] is False  # a CPU host

    def no_torch() -> bool:
        raise AssertionError("has_gpu (a torch import) asked where the answer cannot depend on it")

    assert mps_wanted(cfg, has_gpu=no_torch, has_daemon=False) == (
        False,
        "auto: nvidia-cuda-mps-control is not on PATH",
    )
    for change in ({"gpus": [1]}, {"tensor_parallel": 2}, {"replicas": 2}):
        other = Config()
        other.encoder.gpus = change.get("gpus", [])
        other.decoder.tensor_parallel = change.get("tensor_parallel", 1)
        other.decoder.replicas = change.get("replicas", 1)
        assert mps_wanted(other, has_gpu=lambda: True, has_daemon=True)[0] is False, change
        other.encoder.mps = True  # asked for by name: on wherever there is a GPU
        assert mps_wanted(other, has_gpu=lambda: True, has_daemon=True)[0] is True, change
    cfg.encoder.gpus = [0, 1]  # encoder 0 shares GPU 0 with the decoder
    assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True)[0] is True
    cfg.cache.device_pool = True  # the GPU pool (the auto default on a GPU) leaves it on
    assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True)[0] is True
    routed = Config()  # the two-GPU auto layout: the encoder beside the media replica only
    routed.encoder.gpus, routed.decoder.replicas = [1], 2
    routed.decoder.text_replicas, routed.decoder.media_replicas = [0], [1]
    assert mps_wanted(routed, has_gpu=lambda: True, has_daemon=True) == (
        True,
        "auto: the encoders share GPUs with media-only replicas alone",
    )
    cfg.encoder.mps = False
    assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True) == (False, "[encoder] mps = false")


def test_sm_split_needs_mps_and_splits_only_gpus_shared_with_a_text_replica() -> None:
    from workers.models.runtime import split_gpus

    cfg = Config()
    cfg.encoder.sm_split = 72
    cfg.decoder.replicas, cfg.decoder.replica_gpus = 2, [0, 0]
    cfg.decoder.text_replicas, cfg.decoder.media_replicas = [0], [1]
    # auto: on with a split, though replicas > 1 has it off otherwise
    assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True)[0] is True
    for setting, daemon in ((False, True), ("auto", False)):
        cfg.encoder.mps = setting
        with pytest.raises(ValueError, match="sm_split needs the CUDA MPS daemon"):
            mps_wanted(cfg, has_gpu=lambda: True, has_daemon=daemon)
        assert mps_wanted(cfg, has_gpu=lambda: False, has_daemon=daemon)[0] is False  # a CPU host: no split
    assert split_gpus(cfg, visible=1) == {0}
    cfg.encoder.gpus = [1]  # the encoder on a GPU of its own: nothing to split
    assert split_gpus(cfg, visible=2) == set()
    cfg.encoder.gpus, cfg.encoder.count, cfg.decoder.replica_gpus = [], 2, [0, 1]  # encoders on both; text on 0
    assert split_gpus(cfg, visible=2) == {0}


def test_each_encoder_finds_its_gpu() -> None:
    cfg = Config()
    assert [encoder_gpu(cfg, k) for k in range(3)] == [0, 1, 2]  # encoder K on GPU K (resolve_device wraps)
    cfg.encoder.gpus = [1, 1]  # two encoders sharing GPU 1, GPU 0 left to the decoder
    assert [encoder_gpu(cfg, k) for k in range(2)] == [1, 1]
    with pytest.raises(ValueError, match=r"encoder 2: \[encoder\] gpus = \[1, 1\] lists only 2 encoders"):
        encoder_gpu(cfg, 2)
    cfg.model.device = "cpu"
    assert resolve_device(cfg, encoder_gpu(cfg, 0)) == torch.device("cpu")  # a CPU host ignores the list


def test_a_media_replica_on_the_text_replicas_gpu_runs_as_vision_work(tmp_path: Path) -> None:
    cfg = Config()
    cfg.decoder.replicas, cfg.decoder.text_replicas, cfg.decoder.media_replicas = 3, [0], [1, 2]
    cfg.decoder.replica_gpus = [0, 0, 1]  # replica 1 beside the text replica; replica 2 on a GPU of its own
    plan = MpsPlan.of(cfg)
    assert plan.vision_replicas == {1}
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 1, 1, MpsPlan(plan.vision_replicas), 3)
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    for program in ("program:encoder", "program:decoder-1"):
        environment = parser[program]["environment"]
        assert 'CUDA_MPS_CLIENT_PRIORITY="1"' in environment
    for program in ("program:decoder", "program:decoder-2"):
        assert "CLIENT_PRIORITY" not in parser[program]["environment"]
    cfg.decoder.text_replicas = []  # every replica takes text: none is vision work
    assert MpsPlan.of(cfg).vision_replicas == frozenset()
    cfg.decoder.text_replicas, cfg.decoder.replica_gpus = [0], [0, 1, 2]  # each on its own GPU
    assert MpsPlan.of(cfg).vision_replicas == frozenset()


def test_preflight_refuses_what_workers_would_fail_on_for_ever(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model.path = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"the model directory .*no-such-model does not exist"):
        preflight(cfg)
    (tmp_path / "no-such-model").mkdir()
    with pytest.raises(ValueError, match=r"no-such-model/config\.json is missing"):
        preflight(cfg)
    cfg.model.path = ""  # the demo checkpoint
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        cfg.server.port = holder.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{cfg.server.port} .*another program holds it"):
            preflight(cfg)
    preflight(cfg)  # (the port free again)


def unit_programs(role: str, tmp_path: Path) -> configparser.RawConfigParser:
    text = render((REPO / "ops/vlm.conf").read_text(), REPO, tmp_path, 2, processes=UNIT_PROCESSES[role])
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    return parser


def test_a_units_role_chooses_its_programs(tmp_path: Path) -> None:
    programs = {role: unit_programs(role, tmp_path) for role in UNIT_ROLES}
    names = {
        role: {s.removeprefix("program:") for s in p.sections() if s.startswith("program:")}
        for role, p in programs.items()
    }
    assert names == {
        "all": {"gateway", "fetcher", "encoder", "cache", "decoder"},
        "pd": {"gateway", "fetcher", "cache", "decoder"},
        "encoder": {"encoder"},
    }
    assert programs["encoder"]["program:encoder"]["numprocs"] == "2"
    for role in ("pd", "encoder"):  # the programs a unit keeps are those of the whole deployment, unchanged
        for section in programs[role].sections():
            assert dict(programs[role][section]) == dict(programs["all"][section]), (role, section)


def test_a_unit_of_a_role_reaches_the_other_units_encoders_over_tcp_only() -> None:
    for role in ("pd", "encoder"):
        cfg = Config()
        cfg.server.role, cfg.encoder.count = role, 2
        with pytest.raises(ValueError, match=rf'role = "{role}".*encoder\.0 is ipc://'):
            check_unit(cfg)
        cfg.endpoints = {"encoder": "tcp://127.0.0.1:710{gpu}"}
        check_unit(cfg)
        assert (cfg.endpoint("encoder.0"), cfg.endpoint("encoder.1")) == (
            "tcp://127.0.0.1:7100",
            "tcp://127.0.0.1:7101",
        )
        cfg.endpoints = {"encoder.0": "tcp://10.0.0.2:7100", "encoder.1": "ipc:///tmp/e1.sock"}
        with pytest.raises(ValueError, match=r"encoder\.1 is ipc://"):
            check_unit(cfg)
        assert mps_wanted(cfg, has_gpu=lambda: True, has_daemon=True)[0] is False
    check_unit(Config())  # "all": anything goes
