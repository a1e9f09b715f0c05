"""Kubernetes manifests of a deployment split in units (`vlm-serve render-k8s`, ``./ops/render-k8s``): from the
settings file and the CurveZMQ keys that ``./ops/keys`` wrote, into ``deploy/k8s/`` (one YAML file a resource):

- ``vlm-pd``: a Deployment of pd units (gateway, fetchers, cache daemon, decoders; ``./ops/serve --role pd``), the
  GPUs its decoders take, probed on ``/health``, behind the ClusterIP Service ``vlm-pd`` (the OpenAI API);
- ``vlm-encoder``: a Deployment of encoder units (``--role encoder``), ``[encoder] count`` GPUs a pod, probed on
  their ports, behind the headless Service ``vlm-encoders``: a pd unit's encoder endpoints name it, so every ready
  encoder pod is an address it uses (`common.discovery`), and pods that come or go join or drain;
- the settings of each unit (a ConfigMap: the file, its endpoints and security set for the pods), the keys as
  Secrets (every role's public key to both; each unit only its own roles' private keys), and NetworkPolicies that
  admit only pd pods to the encoders' ports.

The checkpoint comes from a PersistentVolumeClaim (``--model-claim``), mounted where ``[model] path`` says. Each pd
pod serves ``/metrics`` (annotated for Prometheus), with the two series an inference-extension endpoint picker
reads: ``vlm_decoder_requests_queued`` (the queue) and ``vlm_decoder_kv_usage`` (KV-cache utilisation, 0 to 1).
"""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from common.config import Config
from common.security import ROLES, public_key_path, secret_key_path
from common.topology import UNIT_PROCESSES

ENCODER_PORT = 7100  # encoder K of a pod listens on ENCODER_PORT + K
CONFIG_DIR = "/etc/vlm"
LABELS = {"app.kubernetes.io/name": "vlm-serve"}


def render(cfg: Config, image: str, encoder_pods: int, model_claim: str) -> dict[str, dict[str, Any]]:
    """Every manifest, by file name."""
    if not cfg.model.path:
        raise ValueError(
            "set [model] path: where the pods find the checkpoint (the --model-claim volume is mounted there)"
        )
    per_pod = cfg.encoder.count or 1
    ports = [ENCODER_PORT + k for k in range(per_pod)]
    raw = tomllib.loads(Path(cfg.source).read_text()) if cfg.source and Path(cfg.source).is_file() else {}
    pd_settings = unit_settings(
        raw, cfg, "pd", {f"encoder.{k}": f"tcp://vlm-encoders:{p}" for k, p in enumerate(ports)}
    )
    encoder_settings = unit_settings(
        raw, cfg, "encoder", {f"encoder.{k}": f"tcp://0.0.0.0:{p}" for k, p in enumerate(ports)}
    )
    manifests = {
        "configmap-pd.yaml": config_map("vlm-pd-settings", pd_settings),
        "configmap-encoder.yaml": config_map("vlm-encoder-settings", encoder_settings),
        "secret-keys-public.yaml": key_secret(
            "vlm-keys-public", {f"{r}.key": public_key_path(cfg.keys_path, r) for r in ROLES}
        ),
        "deployment-pd.yaml": pd_deployment(cfg, image, model_claim),
        "deployment-encoder.yaml": encoder_deployment(cfg, image, model_claim, encoder_pods, ports),
        "service-pd.yaml": service("vlm-pd", "pd", [("http", cfg.server.port)]),
        "service-encoders.yaml": service(
            "vlm-encoders", "encoder", [(f"encoder-{p - ENCODER_PORT}", p) for p in ports], True
        ),
        "networkpolicy-encoders.yaml": encoder_policy(ports),
    }
    for unit in ("pd", "encoder"):
        secrets = {f"{r}.key_secret": secret_key_path(cfg.keys_path, r) for r in UNIT_PROCESSES[unit]}
        manifests[f"secret-keys-{unit}.yaml"] = key_secret(f"vlm-keys-{unit}", secrets)
    return manifests


def unit_settings(raw: dict[str, Any], cfg: Config, role: str, endpoints: dict[str, str]) -> str:
    """The settings file of a unit's pods: the deployment's, with its role, its endpoints, the keys where the Secrets
    are mounted and the HTTP server on the pod's address (the Service and the probes reach it there)."""
    settings = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    server = settings.setdefault("server", {})
    server.update(role=role, host="0.0.0.0", port=cfg.server.port)
    settings["endpoints"] = endpoints
    settings.setdefault("security", {}).update(mode="curve", keys_dir=f"{CONFIG_DIR}/keys")
    if cfg.model.path:
        settings.setdefault("model", {})["path"] = cfg.model.path
    return tomli_w.dumps(settings)


def metadata(name: str, role: str | None = None) -> dict[str, Any]:
    labels = {**LABELS, **({"vlm-serve/role": role} if role else {})}
    return {"name": name, "labels": labels}


def config_map(name: str, settings: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(name), "data": {"vlm.toml": settings}}


def key_secret(name: str, files: dict[str, Path]) -> dict[str, Any]:
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"no CurveZMQ keys at {', '.join(missing)}: write them with ./ops/keys first")
    data = {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata(name), "type": "Opaque", "data": data}


def pod_spec(
    cfg: Config, image: str, model_claim: str, unit: str, gpus: int, ports: list[tuple[str, int]], probe: dict[str, Any]
) -> dict[str, Any]:
    mounts = [
        {"name": "settings", "mountPath": f"{CONFIG_DIR}/settings", "readOnly": True},
        {"name": "keys-public", "mountPath": f"{CONFIG_DIR}/keys/public", "readOnly": True},
        {"name": "keys-private", "mountPath": f"{CONFIG_DIR}/keys/private", "readOnly": True},
        {"name": "model", "mountPath": str(cfg.model_path()), "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},  # (the embedding pool and its spill tier live there)
    ]
    container = {
        "name": unit,
        "image": image,
        "command": ["./ops/serve", "--role", unit],
        "env": [{"name": "VLM_CONFIG", "value": f"{CONFIG_DIR}/settings/vlm.toml"}],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports],
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": ports[0][1]}, "periodSeconds": 10, "failureThreshold": 6},
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},  # (loading a 7B takes minutes)
        "volumeMounts": mounts,
    }
    volumes = [
        {"name": "settings", "configMap": {"name": f"vlm-{unit}-settings"}},
        {"name": "keys-public", "secret": {"secretName": "vlm-keys-public"}},
        {"name": "keys-private", "secret": {"secretName": f"vlm-keys-{unit}", "defaultMode": 0o400}},
        {"name": "model", "persistentVolumeClaim": {"claimName": model_claim, "readOnly": True}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    return {"containers": [container], "volumes": volumes}


def deployment(
    name: str, unit: str, replicas: int, spec: dict[str, Any], annotations: dict[str, str]
) -> dict[str, Any]:
    selector = {**LABELS, "vlm-serve/role": unit}
    template = {"metadata": {"labels": selector, "annotations": annotations}, "spec": spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, unit),
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "template": template},
    }


def pd_deployment(cfg: Config, image: str, model_claim: str) -> dict[str, Any]:
    gpus = cfg.decoder.replicas * cfg.decoder.tensor_parallel
    probe = {"httpGet": {"path": "/health", "port": cfg.server.port}}
    spec = pod_spec(cfg, image, model_claim, "pd", gpus, [("http", cfg.server.port)], probe)
    scrape = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(cfg.server.port),
        "prometheus.io/path": "/metrics",
    }
    return deployment("vlm-pd", "pd", 1, spec, scrape)


def encoder_deployment(cfg: Config, image: str, model_claim: str, pods: int, ports: list[int]) -> dict[str, Any]:
    named = [(f"encoder-{port - ENCODER_PORT}", port) for port in ports]
    spec = pod_spec(cfg, image, model_claim, "encoder", len(ports), named, {"tcpSocket": {"port": ports[0]}})
    return deployment("vlm-encoder", "encoder", pods, spec, {})


def service(name: str, unit: str, ports: list[tuple[str, int]], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {**LABELS, "vlm-serve/role": unit},
        "ports": [
            {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"} for port_name, port in ports
        ],
    }
    if headless:  # (an A record per ready pod: the pd units' encoder endpoints name it)
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name, unit), "spec": spec}


def encoder_policy(ports: list[int]) -> dict[str, Any]:
    pd_pods = {"podSelector": {"matchLabels": {**LABELS, "vlm-serve/role": "pd"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata("vlm-encoders-from-pd", "encoder"),
        "spec": {
            "podSelector": {"matchLabels": {**LABELS, "vlm-serve/role": "encoder"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [pd_pods], "ports": [{"protocol": "TCP", "port": port} for port in ports]}],
        },
    }


def write(manifests: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, manifest in sorted(manifests.items()):
        path = out / name
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        written.append(path)
    return written
