"""deploy/k8s/gateway: the InferencePool and its endpoint picker. The built-in kinds pass
kubernetes-validate; the custom resources (InferencePool, HTTPRoute) have no schema there, so the
pool is checked against the fields of the GAIE v1 CRD written out below, and every reference
between the objects (labels, ports, names, the config file) is followed to its target."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.referenced_metrics import legacy_flag_specs, parse_selector, picker_config
from tests.deploy.referenced_metrics import picker_specs as load_picker_specs

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
GATEWAY_DIR = K8S_DIR / "gateway"
KUBERNETES_VERSION = "1.30.0"
POOL_GROUP = "inference.networking.k8s.io"
CRD_API_VERSIONS = {
    "InferencePool": f"{POOL_GROUP}/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}

# inferencepools.inference.networking.k8s.io, version v1 (GAIE v1.0 to v1.5): the spec's
# openAPIV3Schema without descriptions and status. additionalProperties is false here, not in
# the CRD: the API server would prune a misspelt field silently, the test names it.
_PORT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
INFERENCE_POOL_SPEC_SCHEMA = {
    "type": "object",
    "required": ["endpointPickerRef", "selector", "targetPorts"],
    "additionalProperties": False,
    "properties": {
        "selector": {
            "type": "object",
            "required": ["matchLabels"],
            "additionalProperties": False,
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 64,
                    "additionalProperties": _LABEL_VALUE,
                }
            },
        },
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},  # v1.5 only; default http
        "endpointPickerRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "group": {"type": "string", "maxLength": 253},
                "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
                "port": _PORT,
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}


def _resources() -> dict[str, dict]:
    """Objects by kind from every manifest the gateway kustomization applies."""
    kustomization = yaml.safe_load((GATEWAY_DIR / "kustomization.yaml").read_text())
    resources = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((GATEWAY_DIR / name).read_text()):
            assert doc["kind"] not in resources, f"two {doc['kind']} objects: key them by name"
            resources[doc["kind"]] = doc
    return resources


def _kvshare_deployment() -> dict:
    return yaml.safe_load((K8S_DIR / "deployment.yaml").read_text())


def _picker_container() -> dict:
    (container,) = _resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], name: str) -> str:
    """The value of `--name value` or `--name=value` in a container's args."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise KeyError(name)


def test_kustomization_applies_every_manifest():
    listed = set(yaml.safe_load((GATEWAY_DIR / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in GATEWAY_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_manifests_pass_kubernetes_validate():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate"
    )
    validated = []
    for kind, resource in _resources().items():
        if kind in CRD_API_VERSIONS:
            assert resource["apiVersion"] == CRD_API_VERSIONS[kind]
            continue
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        validated.append(kind)
    assert sorted(validated) == [
        "ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"
    ]  # fmt: skip


def test_inference_pool_fits_the_v1_crd():
    jsonschema = pytest.importorskip("jsonschema")
    pool = _resources()["InferencePool"]
    assert set(pool) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pool["metadata"]["name"])
    jsonschema.validate(pool["spec"], INFERENCE_POOL_SPEC_SCHEMA)
    # The CRD's CEL rules: unique port numbers; a port when the picker is a Service (the default).
    numbers = [port["number"] for port in pool["spec"]["targetPorts"]]
    assert len(set(numbers)) == len(numbers)
    picker_ref = pool["spec"]["endpointPickerRef"]
    if picker_ref.get("kind", "Service") == "Service":
        assert "port" in picker_ref


def test_the_schema_check_can_fail():
    jsonschema = pytest.importorskip("jsonschema")
    spec = _resources()["InferencePool"]["spec"]
    broken = [
        {**spec, "targetPorts": []},
        {**spec, "targetPort": spec["targetPorts"]},  # misspelt: the API server would prune it
        {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"}},
        {k: v for k, v in spec.items() if k != "selector"},
    ]
    for case in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(case, INFERENCE_POOL_SPEC_SCHEMA)


def test_pool_selects_the_kvshare_pods_on_their_server_port():
    pool = _resources()["InferencePool"]["spec"]
    kvshare_pod = _kvshare_deployment()["spec"]["template"]
    labels = kvshare_pod["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    picker_labels = _resources()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not pool["selector"]["matchLabels"].items() <= picker_labels.items()
    (server,) = kvshare_pod["spec"]["containers"]
    (http,) = [port for port in server["ports"] if port["name"] == "http"]
    assert [port["number"] for port in pool["targetPorts"]] == [http["containerPort"]]
    # The picker scrapes the target port on the app's /metrics path.
    from app.routes import metrics

    (data_source,) = [p for p in picker_config()["plugins"] if p["type"] == "metrics-data-source"]
    assert data_source["parameters"]["path"] in {route.path for route in metrics.router.routes}


def test_pool_names_the_picker_service_and_port():
    resources = _resources()
    pool, service = resources["InferencePool"], resources["Service"]
    picker_ref = pool["spec"]["endpointPickerRef"]
    assert picker_ref["name"] == service["metadata"]["name"]
    (service_port,) = [
        p for p in service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"]
    ]
    container_ports = {port["name"]: port["containerPort"] for port in _picker_container()["ports"]}
    assert container_ports[service_port["targetPort"]] == 9002  # the EPP's ext_proc (gRPC) port
    pod = resources["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    args = _picker_container()["args"]
    assert _flag(args, "--pool-name") == pool["metadata"]["name"]
    assert _flag(args, "--pool-group") == POOL_GROUP == pool["apiVersion"].split("/")[0]
    (backend,) = resources["HTTPRoute"]["spec"]["rules"][0]["backendRefs"]
    assert backend == {"group": POOL_GROUP, "kind": "InferencePool", "name": "kvshare"}


def test_picker_reads_the_mounted_config_with_its_service_account():
    resources = _resources()
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    container = _picker_container()
    config_path = Path(_flag(container["args"], "--config-file"))
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = resources["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert config_path.name in configmap["data"]
    assert pod["serviceAccountName"] == resources["ServiceAccount"]["metadata"]["name"]
    binding = resources["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert binding["roleRef"]["name"] == resources["Role"]["metadata"]["name"]
    granted = {(group, resource) for rule in resources["Role"]["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               if {"get", "list", "watch"} <= set(rule["verbs"])}  # fmt: skip
    assert {("", "pods"), (POOL_GROUP, "inferencepools")} <= granted


def test_picker_config_is_complete():
    config = picker_config()
    assert (config["apiVersion"], config["kind"]) == (
        "inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig"
    )  # fmt: skip
    defined = {plugin.get("name", plugin["type"]) for plugin in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {ref["pluginRef"] for ref in profile["plugins"]} <= defined
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    engines = {engine["name"] for engine in extractor["parameters"]["engineConfigs"]}
    assert extractor["parameters"]["defaultEngine"] in engines  # else the EPP refuses to start
    # EPP v1.4+ refuses the legacy metric flags: the names live in the config only.
    assert not [arg for arg in _picker_container()["args"] if arg.endswith("-metric")]


def test_picker_specs_are_kvshare_selectors_the_picker_parses():
    specs = load_picker_specs()
    assert specs["loraSpec"] == ""  # kvshare serves no LoRA adapters
    refs = {key: parse_selector(spec, key) for key, spec in specs.items() if spec}
    assert refs["queuedRequestsSpec"].labels == (("state", "waiting"),)
    assert refs["runningRequestsSpec"].labels == (("state", "running"),)
    assert all(ref.name.startswith("kvshare_") for ref in refs.values())
    flags = [spec for spec in legacy_flag_specs() if spec]
    assert sorted(flags) == sorted(spec for spec in specs.values() if spec)  # same names
    with pytest.raises(ValueError):
        parse_selector('kvshare_requests{state=~"wait.*"}', "a regex the picker ignores")
