"""`vlm-serve render-k8s` (ops/render_k8s.py): the manifests it writes from a settings file and ./ops/keys' keys pass
kubernetes-validate in strict mode at a pinned Kubernetes version, and what they say is tied to the settings: the
ports, the GPUs, the probes, the keys in the Secrets (each unit only its own private keys), and the units' settings
files, which name the encoders' headless Service and load as this project's settings."""

from __future__ import annotations

import base64
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.config import load_config
from common.security import write_keys
from common.topology import check_unit

KUBERNETES = "1.33.0"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def rendered(tmp_path: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    keys = tmp_path / "keys"
    write_keys(keys)
    settings = tmp_path / "vlm.toml"
    settings.write_text(
        f'[server]\nport = 8400\n[model]\npath = "/models/qwen2-vl-7b"\n[encoder]\ncount = 2\n'
        f'[decoder]\ntensor_parallel = 2\n[security]\nkeys_dir = "{keys}"\n'
    )
    out = tmp_path / "k8s"
    command = [sys.executable, "-m", "ops.cli", "render-k8s", "--config", str(settings), "--out", str(out)]
    subprocess.run([*command, "--encoder-pods", "3", "--image", "registry.example/vlm:1"], check=True, cwd=REPO)
    return keys, {path.name: yaml.safe_load(path.read_text()) for path in sorted(out.glob("*.yaml"))}


def test_every_manifest_is_valid_kubernetes(rendered: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    _, manifests = rendered
    assert {m["kind"] for m in manifests.values()} == {"ConfigMap", "Secret", "Deployment", "Service", "NetworkPolicy"}
    for name, manifest in manifests.items():
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)  # (raises, naming what is wrong)
        assert manifest["metadata"]["labels"]["app.kubernetes.io/name"] == "vlm-serve", name


def container(manifests: dict[str, dict[str, Any]], unit: str) -> dict[str, Any]:
    return manifests[f"deployment-{unit}.yaml"]["spec"]["template"]["spec"]["containers"][0]


def test_ports_gpus_and_probes_follow_the_settings(rendered: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    _, manifests = rendered
    pd, encoder = container(manifests, "pd"), container(manifests, "encoder")
    assert pd["command"] == ["./ops/serve", "--role", "pd"] and encoder["command"][-1] == "encoder"
    assert pd["ports"] == [{"name": "http", "containerPort": 8400, "protocol": "TCP"}]
    assert pd["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8400}
    assert pd["resources"]["limits"]["nvidia.com/gpu"] == 2  # (one replica of two tensor-parallel ranks)
    assert encoder["resources"]["limits"]["nvidia.com/gpu"] == 2  # ([encoder] count: two a pod)
    assert [p["containerPort"] for p in encoder["ports"]] == [7100, 7101]
    assert encoder["readinessProbe"]["tcpSocket"] == {"port": 7100}
    assert manifests["deployment-encoder.yaml"]["spec"]["replicas"] == 3
    assert manifests["service-pd.yaml"]["spec"]["ports"][0]["port"] == 8400
    encoders = manifests["service-encoders.yaml"]["spec"]
    assert encoders["clusterIP"] == "None" and [p["port"] for p in encoders["ports"]] == [7100, 7101]
    policy = manifests["networkpolicy-encoders.yaml"]["spec"]
    assert [p["port"] for p in policy["ingress"][0]["ports"]] == [7100, 7101]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["vlm-serve/role"] == "pd"
    annotations = manifests["deployment-pd.yaml"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8400"


def test_the_secrets_hold_the_keys_and_each_unit_only_its_own(rendered: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    keys, manifests = rendered

    def files(name: str) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in manifests[name]["data"].items()}

    public = files("secret-keys-public.yaml")
    assert public == {p.name: p.read_bytes() for p in (keys / "public").iterdir()}
    pd, encoder = files("secret-keys-pd.yaml"), files("secret-keys-encoder.yaml")
    assert set(pd) == {f"{r}.key_secret" for r in ("gateway", "fetcher", "cache", "decoder")}
    assert set(encoder) == {"encoder.key_secret"}
    assert encoder["encoder.key_secret"] == (keys / "private" / "encoder.key_secret").read_bytes()


def test_the_units_settings_name_the_encoders_service_and_load(
    rendered: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    _, manifests = rendered
    for unit in ("pd", "encoder"):
        text = manifests[f"configmap-{unit}.yaml"]["data"]["vlm.toml"]
        path = tmp_path / f"{unit}.toml"
        path.write_text(text)
        cfg = load_config(path, env={})
        check_unit(cfg)  # (its encoder endpoints are tcp://, as a unit of that role needs)
        assert cfg.server.role == unit and cfg.server.port == 8400 and cfg.encoder.count == 2
        assert cfg.security.keys_dir == "/etc/vlm/keys" and cfg.model.path == "/models/qwen2-vl-7b"
        mounts = {m["name"]: m["mountPath"] for m in container(manifests, unit)["volumeMounts"]}
        assert mounts["keys-private"] == "/etc/vlm/keys/private" and mounts["model"] == "/models/qwen2-vl-7b"
        assert tomllib.loads(text)["server"]["host"] == "0.0.0.0"  # (the Service and the probes reach the pod)
    pd = load_config(tmp_path / "pd.toml", env={})
    assert [pd.endpoint(f"encoder.{k}") for k in (0, 1)] == ["tcp://vlm-encoders:7100", "tcp://vlm-encoders:7101"]


def test_without_keys_or_a_model_path_nothing_is_written(tmp_path: Path) -> None:
    settings = tmp_path / "vlm.toml"
    out = tmp_path / "k8s"
    for body, complaint in (
        (f'[model]\npath = "/m"\n[security]\nkeys_dir = "{tmp_path / "none"}"\n', "./ops/keys"),
        ("[server]\nport = 8400\n", "[model] path"),
    ):
        settings.write_text(body)
        command = [sys.executable, "-m", "ops.cli", "render-k8s", "--config", str(settings), "--out", str(out)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        assert result.returncode != 0 and complaint in result.stderr, result.stderr
        assert not out.exists()
