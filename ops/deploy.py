"""The supervisord configuration of one deployment, rendered from ``ops/vlm.conf``.

``python -m ops.deploy OUT`` (what ``vlm-serve serve`` and ``./ops/serve`` run) writes it for the configuration that
``VLM_CONFIG`` names: paths point at this checkout and at the deployment's own run directory (so two
deployments never share a socket, pid file or log), the encoder program runs one process per
encoder the fetcher will dispatch to (``[encoder] count``, 0: one per visible GPU), data-parallel decoder
replicas (``[decoder] replicas`` = R) run as ``decoder`` (replica 0) and ``decoder-1`` .. ``decoder-{R-1}``,
and a tensor-parallel decoder (``[decoder] tensor_parallel`` = N) gets its ranks 1..N-1 as ``decoder-rank``
(replica r > 0: ``decoder-r-rank``);
with ``[encoder] mps`` on a GPU host, the CUDA MPS control daemon runs first and every GPU process uses it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.config import Config, decoder_name, load_config
from common.memory import PoolPlan, host_memory, pool_plan
from common.topology import (
    UNIT_PROCESSES,
    check_unit,
    encoder_count,
    has_gpu,
    unit_processes,
    visible_gpus,
    vision_replicas,
)
from workers.models.synth import prepared_model

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MpsPlan:
    """How the GPU processes share each GPU under CUDA MPS: the encoders' work yields to the decoder's (MPS
    client priority ``BELOW_NORMAL``), and so does that of ``vision_replicas``: media-only decoder replicas on a
    GPU where a replica that takes text runs (``replica_gpus``), whose image prefills are vision work too."""

    vision_replicas: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg: Config) -> MpsPlan:
        return cls(vision_replicas(cfg))


def render(
    template: str,
    repo: Path,
    run: Path,
    encoders: int,
    decoder_ranks: int = 1,
    mps: MpsPlan | None = None,
    replicas: int = 1,
    fetchers: int = 1,
    processes: tuple[str, ...] = UNIT_PROCESSES["all"],
) -> str:
    """The configuration to run: the programs of ``processes`` (a unit's, `common.topology.UNIT_PROCESSES`);
    ``mps`` adds the CUDA MPS control daemon and each GPU process's share."""
    if min(encoders, decoder_ranks, replicas, fetchers) < 1:
        raise ValueError(
            "a deployment needs at least one encoder, one decoder replica, one rank each and one fetcher, got "
            f"{encoders}, {replicas}, {decoder_ranks}, {fetchers}"
        )
    text = template.replace("%(here)s/../run/", f"{run}/").replace("%(here)s/..", str(repo))
    for program in UNIT_PROCESSES["all"]:
        if program not in processes:
            text = _without(text, program)
    if "encoder" in processes:
        text = _with_processes(text, "encoder", encoders)
    if "fetcher" in processes:
        text = _with_processes(text, "fetcher", fetchers)
    if "decoder" in processes:
        text = _add_decoders(text, replicas, decoder_ranks)
    if mps is not None:
        text = _add_mps(text, repo, run, mps)
    return text


def _add_mps(text: str, repo: Path, run: Path, plan: MpsPlan) -> str:
    """The MPS control daemon of this deployment (its pipe and log directories in the run directory, so
    two deployments never share one), started first and ended with supervisord even if that is killed hard
    (`common.exec_supervised`); every GPU process talks to it through the same pipe directory, with the plan's SM
    client priorities."""
    pipes, logs = run / "mps" / "pipe", run / "mps" / "log"
    mps_env = f'CUDA_MPS_PIPE_DIRECTORY="{pipes}",CUDA_MPS_LOG_DIRECTORY="{logs}"'
    daemon = f"{repo}/.venv/bin/python -m common.exec_supervised nvidia-cuda-mps-control -f"
    program = (
        "[program:mps]\n"
        f"command = /bin/sh -c 'mkdir -p {pipes} {logs} && exec {daemon}'\n"
        f"directory = {repo}\n"
        f"environment = {mps_env}\n"
        "priority = 5\nautorestart = true\nstartsecs = 1\nstopsignal = TERM\nredirect_stderr = true\n"
        f"stdout_logfile = {run}/logs/mps.log\n"
    )
    vision = {"encoder"} | {decoder_name(r) + tail for r in plan.vision_replicas for tail in ("", "-rank")}
    for name in re.findall(r"^\[program:(encoder|decoder[-\w]*)\]$", text, flags=re.MULTILINE):
        # The GPU schedules a below-normal client's blocks after a normal one's: a decode step that arrives
        # while the ViT runs takes the SMs as ViT blocks finish, instead of queueing behind them.
        extra = ',CUDA_MPS_CLIENT_PRIORITY="1"' if name in vision else ""
        section = _section(text, name)
        body = section.group(0).rstrip("\n") + f"\nenvironment = {mps_env}{extra}\n\n"
        text = text[: section.start()] + body + text[section.end() :]
    return text.rstrip("\n") + "\n\n" + program


def _with_processes(text: str, program: str, count: int) -> str:
    section = _section(text, program)
    if "numprocs = 1" not in section.group(0):
        raise ValueError(f"the template's [program:{program}] section has no 'numprocs = 1' to set")
    body = section.group(0).replace("numprocs = 1", f"numprocs = {count}", 1)
    return text[: section.start()] + body + text[section.end() :]


def _without(text: str, program: str) -> str:
    section = _section(text, program)
    return text[: section.start()] + text[section.end() :]


def _section(text: str, program: str) -> re.Match[str]:
    section = re.search(rf"^\[program:{program}\]\n(?:(?!\[).*\n?)*", text, flags=re.MULTILINE)
    if section is None:
        raise ValueError(f"the template has no [program:{program}] section")
    return section


def _add_decoders(text: str, replicas: int, ranks: int) -> str:
    """Replicas 1..replicas-1 of the decoder (its program with ``--replica R``) and each replica's
    tensor-parallel ranks 1..ranks-1 (with ``--rank K``). Only in rendered configurations: started
    without a rank 0 that waits for them, ranks would only time out."""
    decoder = _section(text, "decoder").group(0)
    priority = re.search(r"^priority = (\d+)$", decoder, flags=re.MULTILINE)
    if priority is None:
        raise ValueError("the template's [program:decoder] section has no 'priority = N'")
    added: dict[str, str] = {}  # program name -> section
    for replica in range(replicas):
        name = decoder_name(replica)
        if replica:
            added[name] = _derived(decoder, name, f"--replica {replica}")
        if ranks > 1:
            args = (f"--replica {replica} " if replica else "") + "--rank %(process_num)d"
            # supervisord stops programs in reverse priority order: rank 0 first, so that its stop broadcast
            # reaches ranks that are still there (stopped first, they left rank 0 waiting to be killed).
            below = f"priority = {int(priority.group(1)) - 1}"
            added[f"{name}-rank"] = _derived(decoder, f"{name}-rank", args, ranks - 1).replace(priority.group(0), below)
    return "".join([text.rstrip("\n") + "\n", *("\n" + program for program in added.values())])


def _derived(decoder: str, name: str, args: str, numprocs: int = 0) -> str:
    """The decoder's program as ``name``, with ``args`` and a log of that name; ``numprocs`` > 0: that many
    processes numbered from 1 (``%(process_num)d``, in the log's name too)."""
    program = (
        decoder.replace("[program:decoder]", f"[program:{name}]")
        .replace("-m workers.decoder", f"-m workers.decoder {args}")
        .replace("logs/decoder.log", f"logs/{name}{'-%(process_num)d' if numprocs else ''}.log")
        .rstrip("\n")
    )
    if numprocs:
        program += f"\nprocess_name = %(program_name)s-%(process_num)d\nnumprocs = {numprocs}\nnumprocs_start = 1"
    return program + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m ops.deploy OUT_CONF")
    try:
        write_supervisord_conf(launcher_config(), Path(argv[0]))
    except (OSError, ValueError) as exc:  # (stopped here, before supervisord restarts failing workers for ever)
        sys.exit(f"vlm-serve: {exc}")


def launcher_config() -> Config:
    """The deployment's config with its "auto" settings resolved for the GPUs that torch sees here: the count
    goes into the environment (``VLM_GPU_COUNT``), which supervisord hands to every program, so that each one
    resolves them the same way (`common.config.resolve`)."""
    os.environ.setdefault("VLM_GPU_COUNT", str(visible_gpus()))
    return load_config()


def write_supervisord_conf(cfg: Config, out: Path) -> None:
    """Check what the workers would fail on (`preflight`, which makes the demo checkpoint if it is the model), and
    write the deployment's supervisord configuration to ``out``, printing each choice made for this machine
    (layout, embedding pool, MPS) with its rule. Raises OSError or ValueError."""
    preflight(cfg)
    wanted, why = mps_wanted(cfg, has_gpu, _has_mps_daemon())
    if wanted and cfg.encoder.sm_split:
        from workers.models.runtime import check_sm_split  # (torch: already imported to ask for a GPU)

        check_sm_split(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    template = (REPO / "ops/vlm.conf").read_text()
    for line in [*cfg.choices, memory_plan(cfg).describe() + " (the cache daemon logs what it allocates)"]:
        print(line, file=sys.stderr)
    print(f"CUDA MPS: {'on' if wanted else 'off'} ({why})", file=sys.stderr)
    mps = MpsPlan.of(cfg) if wanted else None
    decoder = cfg.decoder
    counts = {"replicas": decoder.replicas, "fetchers": cfg.fetcher.count, "processes": unit_processes(cfg)}
    text = render(template, REPO, cfg.run_path, encoder_count(cfg), decoder.tensor_parallel, mps, **counts)
    out.write_text(with_gpu_count(text, os.environ.get("VLM_GPU_COUNT", "")))


def with_gpu_count(text: str, count: str) -> str:
    """The configuration with ``VLM_GPU_COUNT`` in supervisord's environment (every program inherits it), so
    that a program restarted by supervisord resolves "auto" as the launcher did."""
    if not count.isdigit():
        return text
    return text.replace("[supervisord]\n", f'[supervisord]\nenvironment = VLM_GPU_COUNT="{count}"\n', 1)


def memory_plan(cfg: Config) -> PoolPlan:
    """The embedding pool the cache daemon will allocate, as it will size it (GPU 0's memory, asked of torch
    only for a GPU pool)."""
    gpu_total = 0
    if cfg.cache.device_pool:
        import torch  # (already imported to count the GPUs)

        gpu_total = torch.cuda.get_device_properties(0).total_memory
    return pool_plan(cfg, gpu_total, host_memory())


def preflight(cfg: Config) -> None:
    """What would otherwise fail only inside the workers, after supervisord has started them (and would restart
    them for ever): a model directory that is no checkpoint of a supported family (or lacks a file), a backend or
    tensor_parallel the model cannot run with, and a port another program holds. The demo
    checkpoint, if it is the model, is made here: once, before the processes start (they would race to make it).
    The checks that need the checkpoint's spec import torch with its family's module (a second of every start): they
    run where they can refuse, a vision backend other than torch's (which runs every tower) and a tensor_parallel
    other than 1."""
    check_unit(cfg)
    model = prepared_model(cfg)
    if cfg.encoder.backend != "torch" or cfg.decoder.tensor_parallel != 1:
        from workers.encoder.backends import check_backend
        from workers.models.registry import read_spec
        from workers.models.tensor_parallel import check_tensor_parallel

        spec = read_spec(model, cfg.model.quantization)
        check_backend(cfg, spec.vision)
        check_tensor_parallel(spec, cfg.decoder.tensor_parallel)
    if "gateway" not in unit_processes(cfg):
        return
    host, port = cfg.server.host, cfg.server.port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # SO_REUSEADDR as aiohttp binds: a port in TIME_WAIT after the last stop is free to it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port} ({exc.strerror}): another program holds it; set VLM_PORT"
            ) from exc


def mps_wanted(cfg: Config, has_gpu: Callable[[], bool], has_daemon: bool) -> tuple[bool, str]:
    """Whether the deployment runs the MPS daemon, and why. ``mps = "auto"`` turns it on only where it was
    measured to pay: a GPU host with the daemon's binary, an encoder on a decoder's GPU, decoders of one rank,
    and either one replica or encoders beside media-only replicas alone (the two-GPU routed layout): there it
    raised image throughput and kept more of the text streams' throughput under image load (the figures are in
    the docs). MPS with tensor-parallel ranks, or with encoders beside a text replica of several, has not paid
    or not been measured: ``mps = true`` asks for it there. ``has_gpu`` is asked only where the answer depends
    on it (it imports torch: a second or two)."""
    setting = cfg.encoder.mps
    if setting is False or (setting == "auto" and not has_daemon):
        why = "[encoder] mps = false" if setting is False else "auto: nvidia-cuda-mps-control is not on PATH"
        if cfg.encoder.sm_split and has_gpu():  # without MPS the processes take turns: a split only takes SMs
            raise ValueError(f"[encoder] sm_split needs the CUDA MPS daemon, and {why}")
        return False, why
    if not has_gpu():
        return False, "no CUDA GPU"
    if setting is True:
        return True, "[encoder] mps = true"
    if cfg.server.role != "all":
        return False, f"auto: [server] role = {cfg.server.role!r} runs no encoder beside a decoder"
    if cfg.encoder.sm_split:
        return True, "auto: [encoder] sm_split runs the two sides of a GPU at once"
    encoders = set(cfg.encoder.gpus or range(encoder_count(cfg)))
    if not cfg.decoder_gpus() & encoders:
        return False, "auto: no encoder shares a decoder's GPU"
    if cfg.decoder.tensor_parallel > 1:
        return False, "auto: not measured with tensor_parallel > 1; set mps = true to try"
    if cfg.decoder.replicas == 1:
        return True, "auto: an encoder shares the decoder's GPU"
    if cfg.decoder_gpus(r for r in range(cfg.decoder.replicas) if cfg.takes_text(r)) & encoders:
        return False, "auto: not measured with an encoder beside one of several text replicas; set mps = true to try"
    return True, "auto: the encoders share GPUs with media-only replicas alone"


def _has_mps_daemon() -> bool:
    return shutil.which("nvidia-cuda-mps-control") is not None


if __name__ == "__main__":
    main(sys.argv[1:])
