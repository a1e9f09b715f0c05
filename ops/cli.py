"""``vlm-serve``: the command line of a deployment, as users of ``vllm serve`` expect it.

``vlm-serve serve [MODEL] [--host H] [--port P] [--config FILE]`` is what ``./ops/serve`` runs (it installs
first): the options become the ``VLM_*`` variables that every process of the stack reads, the demo checkpoint
is made if it is the model, the preflight checks run, the run directory's ``supervisord.conf`` is rendered
(`ops.deploy`) and supervisord takes over this process in the foreground. ``vlm-serve config --defaults``
prints the settings reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from common.config import UNIT_ROLES, load_config
from common.security import SecurityError, check_keys, write_keys
from common.topology import unit_processes
from ops.deploy import launcher_config, write_supervisord_conf

# Each option of `serve` and the variable the stack's processes read it from (ops/vlm.toml: VLM_* win over
# the file).
SERVE_ENV = {"model": "VLM_MODEL", "host": "VLM_HOST", "port": "VLM_PORT", "role": "VLM_ROLE", "config": "VLM_CONFIG"}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.command(args)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="vlm-serve", description="A Qwen2-VL inference server (OpenAI API).")
    commands = top.add_subparsers(title="commands", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="run the whole stack under supervisord, in the foreground",
        description="Run the whole stack (gateway, fetcher, encoders, cache daemon, decoder) under supervisord, "
        "in the foreground; SIGTERM or Ctrl-C stops it. Options left out come from VLM_* variables, then the "
        "config file.",
    )
    serve_parser.add_argument(
        "model",
        nargs="?",
        help="a Qwen2-VL checkpoint directory (VLM_MODEL; default: [model] path, else the generated demo model)",
    )
    serve_parser.add_argument("--host", help="address the HTTP server listens on (VLM_HOST; default 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, help="HTTP port (VLM_PORT; default 8000)")
    serve_parser.add_argument(
        "--role",
        choices=UNIT_ROLES,
        help="what this host runs (VLM_ROLE; default all): pd, the gateway, fetchers, cache and decoders with the "
        "encoders elsewhere; encoder, the vision encoders alone ([server] role)",
    )
    serve_parser.add_argument(
        "--config", type=Path, help="the TOML settings file (VLM_CONFIG; default ops/vlm.toml of this checkout)"
    )
    serve_parser.set_defaults(command=serve)
    config_parser = commands.add_parser(
        "config", help="print the settings reference", description="Print the settings reference."
    )
    config_parser.add_argument(
        "--defaults", action="store_true", help="every setting with its default value and help text, as TOML"
    )
    config_parser.set_defaults(command=config)
    keys_parser = commands.add_parser(
        "keys",
        help="write the CurveZMQ keys tcp:// endpoints need",
        description="Write a CurveZMQ keypair for each role that has none, under [security] keys_dir (default "
        "<run directory>/keys): public/<role>.key, which every host of the deployment needs, and "
        "private/<role>.key_secret, which each host needs for the roles it runs. Existing keys are kept.",
    )
    keys_parser.add_argument(
        "--config", type=Path, help="the TOML settings file (VLM_CONFIG; default ops/vlm.toml of this checkout)"
    )
    keys_parser.add_argument("--port", type=int, help="HTTP port (VLM_PORT), which names the default run directory")
    keys_parser.add_argument("--dir", type=Path, help="write here instead of [security] keys_dir")
    keys_parser.set_defaults(command=keys)
    k8s_parser = commands.add_parser(
        "render-k8s",
        help="write Kubernetes manifests: pd and encoder units, Services, key Secrets, NetworkPolicies",
        description="Write the Kubernetes manifests of a deployment in units (ops/render_k8s.py) from the settings "
        "file and the keys ./ops/keys wrote: a Deployment of pd units behind a Service, a Deployment of encoder units "
        "behind a headless Service that the pd units' encoder endpoints name, the settings as ConfigMaps, the keys as "
        "Secrets, and a NetworkPolicy admitting only pd pods to the encoders.",
    )
    k8s_parser.add_argument("--config", type=Path, help="the TOML settings file (VLM_CONFIG; default ops/vlm.toml)")
    k8s_parser.add_argument("--out", type=Path, default=Path("deploy/k8s"), help="where (default deploy/k8s)")
    k8s_parser.add_argument("--image", default="vlm-serve:latest", help="the container image (this checkout)")
    k8s_parser.add_argument("--encoder-pods", type=int, default=1, help="encoder units to run (default 1)")
    k8s_parser.add_argument(
        "--model-claim", default="vlm-model", help="the PersistentVolumeClaim holding the checkpoint at [model] path"
    )
    k8s_parser.set_defaults(command=render_kubernetes)
    return top


def serve(args: argparse.Namespace) -> None:
    """Render the run directory's supervisord.conf for these options and exec supervisord on it."""
    export_options(args)
    try:
        cfg = launcher_config()
        check_keys(cfg, unit_processes(cfg))
        run = cfg.run_path
        (run / "logs").mkdir(parents=True, exist_ok=True)
        conf = run / "supervisord.conf"
        write_supervisord_conf(cfg, conf)
    except (OSError, ValueError, SecurityError) as exc:  # (stopped here, before supervisord restarts failing workers)
        sys.exit(f"vlm-serve: {exc}")
    print(f"supervisord: {conf} (supervisorctl -c {conf} status); logs in {run / 'logs'}", file=sys.stderr)
    supervisord = supervisord_argv()
    os.execv(supervisord[0], [*supervisord, "-c", str(conf)])


def export_options(args: argparse.Namespace) -> None:
    """The command's options that are settings (`SERVE_ENV`, those it has and was given) as the VLM_* variables the
    configuration is read with."""
    for option, variable in SERVE_ENV.items():
        value = getattr(args, option, None)
        if value is not None:
            os.environ[variable] = str(Path(value).resolve()) if option == "config" else str(value)


def keys(args: argparse.Namespace) -> None:
    export_options(args)
    try:
        keys_dir = args.dir.resolve() if args.dir is not None else load_config().keys_path
        written = write_keys(keys_dir)
    except (OSError, ValueError) as exc:
        sys.exit(f"vlm-serve keys: {exc}")
    for path in written:
        print(path)
    print(
        f"keys in {keys_dir} ({len(written) // 2} new): give every host public/, and each host the private/ keys of "
        "the roles it runs",
        file=sys.stderr,
    )


def render_kubernetes(args: argparse.Namespace) -> None:
    from ops.render_k8s import render, write

    export_options(args)
    try:
        if args.encoder_pods < 1:
            raise ValueError(f"--encoder-pods: expected >= 1, got {args.encoder_pods}")
        written = write(render(load_config(), args.image, args.encoder_pods, args.model_claim), args.out)
    except (OSError, ValueError) as exc:
        sys.exit(f"vlm-serve render-k8s: {exc}")
    for path in written:
        print(path)
    print(f"{args.out}/secret-keys-*.yaml hold private keys: keep them out of version control", file=sys.stderr)


def supervisord_argv() -> list[str]:
    """How to run supervisord: its script beside this interpreter (the virtualenv's), else the one on PATH, else this
    interpreter on the importable package (wheels installed with ``pip install --target`` put the script in a bin/
    that is on no PATH)."""
    beside = Path(sys.executable).with_name("supervisord")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("supervisord")
    if found is not None:
        return [found]
    try:
        import supervisor  # noqa: F401  (only whether it is there)
    except ImportError:
        sys.exit("vlm-serve: supervisord is not installed (pip install supervisor)")
    return [sys.executable, "-m", "supervisor.supervisord"]


def config(args: argparse.Namespace) -> None:
    if not args.defaults:
        sys.exit("vlm-serve config: say --defaults (every setting with its default and help text)")
    from common.config import main as config_main  # (the settings reference is the config module's to print)

    sys.exit(config_main(["--defaults"]))


if __name__ == "__main__":
    main()
