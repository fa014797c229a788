"""The Kubernetes and KServe manifests in deploy/ render, validate and say what jitserve needs.

Each kustomization is rendered by a real kustomize (v5: ``kustomize build`` or ``kubectl kustomize``),
and every document is validated offline: Kubernetes' own kinds against the schemas the pinned
kubernetes-validate ships (strict: an unknown field fails), the custom resources (KServe, the
Prometheus Operator) against deploy/schemas/. No cluster and no network.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from server.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are meant for
OVERLAYS = ["base", "overlays/cpu", "overlays/cuda", "overlays/cpu-monitoring"]
KSERVE_FILES = ["clusterservingruntime.yaml", "inferenceservice.yaml"]
CUSTOM_RESOURCES = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "clusterservingruntime-serving.kserve.io-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving.kserve.io-v1beta1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}
PORT = 8000
GRPC_PORT = 8001  # JITSERVE_GRPC_PORT: the Open Inference Protocol's inference.GRPCInferenceService


# -- rendering ------------------------------------------------------------------------------------


@functools.cache
def kustomize_command() -> tuple[str, ...] | None:
    """``kustomize build`` or ``kubectl kustomize``, whichever is installed with kustomize v5 or later."""
    candidates = []
    if path := shutil.which("kustomize"):
        candidates.append(((path, "build"), (path, "version")))
    if path := shutil.which("kubectl"):
        candidates.append(((path, "kustomize"), (path, "version", "--client")))
    for command, version_command in candidates:
        result = subprocess.run(version_command, capture_output=True, text=True, timeout=60, check=False)
        # kustomize prints v5.5.0; kubectl "Kustomize Version: v5.5.0" (a kubectl before 1.21, none).
        line = next((ln for ln in result.stdout.splitlines() if "ustomize" in ln or ln.startswith("v")), "")
        match = re.search(r"v(\d+)\.\d+", line)
        if match and int(match.group(1)) >= 5:
            return command
    return None


def require_kustomize() -> tuple[str, ...]:
    command = kustomize_command()
    if command is None:
        reason = "needs kustomize v5 (kubectl 1.27+ or kustomize) on PATH: .ci/system-packages installs kubectl"
        pytest.fail(reason)  # a green run means every test ran: never a silent skip
    return command


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [*require_kustomize(), str(KUBERNETES / overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kustomize failed on {overlay}:\n{result.stderr}"
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    assert docs, f"{overlay} rendered nothing"
    return docs


def kserve_documents() -> list[dict]:
    return [doc for name in KSERVE_FILES for doc in yaml.safe_load_all((DEPLOY / "kserve" / name).read_text()) if doc]


def only(docs, kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_specs(docs) -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload's pod template."""
    return [(doc["metadata"]["name"], doc["spec"]["template"]["spec"]) for doc in docs if doc["kind"] == "Deployment"]


def container(docs, name: str = "jitserve") -> dict:
    (spec,) = [spec for _, spec in pod_specs(docs)]
    return next(c for c in spec["containers"] if c["name"] == name)


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# -- validation -----------------------------------------------------------------------------------


@functools.cache
def core_definitions() -> referencing.Resource:
    """Kubernetes' own definitions (strict), as kubernetes-validate ships them, for the custom resources'
    embedded core types (Container, Volume, ObjectMeta, ...)."""
    folder = f"v{KUBERNETES_VERSION}-local-strict"
    path = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / folder / "_definitions.json"
    return referencing.Resource.from_contents(json.loads(path.read_text()))


def validate(doc: dict) -> None:
    """Raise unless ``doc`` is valid: a custom resource against deploy/schemas/, any other kind against
    Kubernetes' schemas (a kind in neither raises too)."""
    schema_file = CUSTOM_RESOURCES.get((doc.get("apiVersion"), doc.get("kind")))
    if schema_file is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    schema = json.loads((DEPLOY / "schemas" / schema_file).read_text())
    registry = referencing.Registry().with_resource(core_definitions().id(), core_definitions())
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def test_kubernetes_schemas_are_the_pinned_ones():
    pin = next(d for d in project_dev_deps() if d.startswith("kubernetes-validate=="))
    assert kubernetes_validate.version.__version__ == pin.split("==")[1]
    assert core_definitions().id() == "https://kubernetes.io/api/_definitions.json"


def project_dev_deps() -> list[str]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_document_is_valid(overlay):
    docs = render(overlay)
    for doc in docs:
        validate(doc)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "Secret"} <= kinds


@pytest.mark.parametrize("name", KSERVE_FILES)
def test_kserve_documents_are_valid(name):
    docs = [doc for doc in yaml.safe_load_all((DEPLOY / "kserve" / name).read_text()) if doc]
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    ("kind", "break_it"),
    [
        # A misspelt field, a wrong type, a missing required field, in core and custom kinds alike.
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readynessProbe={})),
        ("Deployment", lambda d: d["spec"].update(replicas="three")),
        ("Service", lambda d: d["spec"]["ports"][0].update(port="http")),
        ("PersistentVolumeClaim", lambda d: d["spec"].update(accessModes="ReadWriteMany")),
        ("ClusterServingRuntime", lambda d: d["spec"].update(supportedModelFormat=d["spec"]["supportedModelFormats"])),
        ("ClusterServingRuntime", lambda d: d["spec"]["containers"][0].update(port=8000)),
        ("ClusterServingRuntime", lambda d: d["spec"].update(protocolVersions=["v3"])),
        ("ClusterServingRuntime", lambda d: d["spec"]["supportedModelFormats"][0].update(protocolVersions=["v2"])),
        ("Service", lambda d: d["spec"]["ports"][1].update(appProtocol=2)),
        ("InferenceService", lambda d: d["spec"]["predictor"]["model"].pop("modelFormat")),
        ("InferenceService", lambda d: d["spec"]["predictor"]["volumes"][0].update(pvc={})),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds")),
        ("ServiceMonitor", lambda d: d["spec"].pop("selector")),
    ],
)
def test_validation_rejects_a_broken_document(kind, break_it):
    docs = [*render("overlays/cpu-monitoring"), *kserve_documents()]
    doc = copy.deepcopy(next(doc for doc in docs if doc["kind"] == kind))
    validate(doc)
    break_it(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def test_an_unknown_kind_is_not_waved_through():
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


# -- what jitserve needs ----------------------------------------------------------------------------


def resolve_port(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p.get("name") == port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_readyz_and_healthz_on_8000(overlay):
    c = container(render(overlay))
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], resolve_port(c, ready["port"])) == ("/readyz", PORT)
    assert (live["path"], resolve_port(c, live["port"])) == ("/healthz", PORT)
    # Room to start: a startup probe, or a liveness probe that waits.
    if "startupProbe" in c:
        start = c["startupProbe"]
        assert (start["httpGet"]["path"], resolve_port(c, start["httpGet"]["port"])) == ("/healthz", PORT)
        assert start.get("periodSeconds", 10) * start.get("failureThreshold", 3) >= 120
    else:
        assert c["livenessProbe"].get("initialDelaySeconds", 0) >= 60
    assert {p["containerPort"] for p in c["ports"]} == {PORT, GRPC_PORT}
    assert env(c)["JITSERVE_PORT"]["value"] == str(PORT)
    assert env(c)["JITSERVE_HOST"]["value"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_token_comes_from_the_rendered_secret(overlay):
    docs = render(overlay)
    token = env(container(docs))["JITSERVE_ADMIN_TOKEN"]
    assert "value" not in token
    ref = token["valueFrom"]["secretKeyRef"]
    secrets = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Secret"}
    # kustomize renames the generated Secret (hash suffix) and the reference with it.
    assert ref["name"] in secrets, f"{ref['name']} is not among the rendered Secrets {sorted(secrets)}"
    assert ref["key"] in secrets[ref["name"]].get("data", {}) | secrets[ref["name"]].get("stringData", {})
    assert not ref.get("optional", False)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_share_one_read_write_many_volume_at_data(overlay):
    docs = render(overlay)
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    pvc = only(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    c = container(docs)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/data"]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert not mount.get("readOnly", False)
    assert env(c)["JITSERVE_DATA_DIR"]["value"] == "/data"
    assert float(env(c)["JITSERVE_MODEL_WATCH_SECONDS"]["value"]) > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_the_image_user_10001(overlay):
    (_, spec), *others = pod_specs(render(overlay))
    assert not others
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == 10001
    assert pod["fsGroup"] == 10001
    for c in spec["containers"]:
        assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_cpu_and_memory(overlay):
    for _, spec in pod_specs(render(overlay)):
        for c in spec.get("initContainers", []) + spec["containers"]:
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), c["name"]
            assert "memory" in resources.get("limits", {}), c["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_carry_scrape_annotations_and_the_service_port_8000(overlay):
    docs = render(overlay)
    annotations = only(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    service = only(docs, "Service")
    port = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert port["port"] == PORT
    assert resolve_port(container(docs), port["targetPort"]) == PORT
    labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_port_is_the_one_jitserve_listens_on_and_the_service_routes_to_it(overlay):
    docs = render(overlay)
    c = container(docs)
    listens = int(env(c)["JITSERVE_GRPC_PORT"]["value"])
    assert listens == GRPC_PORT != int(env(c)["JITSERVE_PORT"]["value"])
    # The container port named grpc is the one JITSERVE_GRPC_PORT binds; http and grpc, nothing else.
    ports = {p["name"]: p for p in c["ports"]}
    assert set(ports) == {"http", "grpc"}
    assert (ports["grpc"]["containerPort"], ports["grpc"].get("protocol", "TCP")) == (listens, "TCP")
    # The Service's grpc port reaches it, marked HTTP/2 over cleartext for Gateway API backends.
    service = only(docs, "Service")
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc["port"] == GRPC_PORT
    assert resolve_port(c, grpc["targetPort"]) == listens
    assert grpc.get("protocol", "TCP") == "TCP"
    assert grpc.get("appProtocol") == "kubernetes.io/h2c"
    # Each Service port goes to a different container port.
    targets = [resolve_port(c, p["targetPort"]) for p in service["spec"]["ports"]]
    assert sorted(targets) == sorted({p["containerPort"] for p in c["ports"]})


def test_cpu_overlay_runs_the_cpu_image_without_a_gpu():
    c = container(render("overlays/cpu"))
    assert c["image"] == "jitserve:latest"
    assert env(c)["JITSERVE_TARGET"]["value"] == "llvm"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_cuda_overlay_runs_the_cuda_image_on_one_gpu():
    c = container(render("overlays/cuda"))
    assert c["image"] == "jitserve:cuda"
    assert env(c)["JITSERVE_TARGET"]["value"] == "cuda"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    # The patch adds to the base: the token, the data dir and the CPU/memory requests stay.
    assert "secretKeyRef" in env(c)["JITSERVE_ADMIN_TOKEN"]["valueFrom"]
    assert env(c)["JITSERVE_DATA_DIR"]["value"] == "/data"
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])


def test_servicemonitor_is_optional_and_scrapes_the_service():
    for overlay in ["base", "overlays/cpu", "overlays/cuda"]:
        assert all(doc["kind"] != "ServiceMonitor" for doc in render(overlay)), overlay
    docs = render("overlays/cpu-monitoring")
    monitor, service = only(docs, "ServiceMonitor"), only(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_jitserve_variable_is_a_setting(overlay):
    """A misspelt JITSERVE_ variable would be ignored silently (pydantic-settings ignores extras)."""
    fields = {f"JITSERVE_{name.upper()}" for name in Settings.model_fields}
    for _, spec in pod_specs(render(overlay)):
        for c in spec["containers"]:
            unknown = {name for name in env(c) if name.startswith("JITSERVE_")} - fields
            assert not unknown, f"{c['name']}: not jitserve settings: {sorted(unknown)}"


# -- KServe ---------------------------------------------------------------------------------------


def test_kserve_runtime_serves_onnx_over_open_inference_protocol_v2():
    runtime = only(kserve_documents(), "ClusterServingRuntime")
    spec = runtime["spec"]
    assert {"name": "onnx", "autoSelect": True} in spec["supportedModelFormats"]
    # REST first: an InferenceService that names no protocolVersion gets v2.
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"  # KServe merges the InferenceService's model container into it
    assert c["image"] == "jitserve:latest"
    # One port, as Knative (Serverless) allows and KServe's own runtimes declare: the HTTP one.
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http1", PORT)]
    assert env(c)["JITSERVE_PORT"]["value"] == str(PORT)
    assert env(c)["JITSERVE_GRPC_PORT"]["value"] == str(GRPC_PORT)
    assert env(c)["JITSERVE_HOST"]["value"] == "0.0.0.0"
    assert "secretKeyRef" in env(c)["JITSERVE_ADMIN_TOKEN"]["valueFrom"]
    assert (c["readinessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["port"]) == ("/readyz", PORT)
    assert (c["livenessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["port"]) == ("/healthz", PORT)
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert spec["annotations"]["prometheus.kserve.io/port"] == str(PORT)
    fields = {f"JITSERVE_{name.upper()}" for name in Settings.model_fields}
    assert {name for name in env(c) if name.startswith("JITSERVE_")} <= fields


def test_kserve_inference_service_uses_the_runtime_and_its_secret_and_volume():
    docs = kserve_documents()
    runtime, service = only(docs, "ClusterServingRuntime"), only(docs, "InferenceService")
    predictor = service["spec"]["predictor"]
    model = predictor["model"]
    assert model["modelFormat"]["name"] == "onnx"
    assert model["runtime"] == runtime["metadata"]["name"] == "jitserve"
    assert model["protocolVersion"] == "v2"
    # jitserve does not load KServe's /mnt/models: no storageUri that would pretend it does.
    assert "storageUri" not in model
    pvc = only(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (volume,) = predictor["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert {"name": volume["name"], "mountPath": "/data"} in model["volumeMounts"]
    assert predictor["securityContext"]["fsGroup"] == 10001
    ref = env(runtime["spec"]["containers"][0])["JITSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = only(docs, "Secret")
    assert secret["metadata"]["name"] == ref["name"]
    assert ref["key"] in secret["stringData"]


def strategic_merge_ports(runtime: list[dict], model: list[dict]) -> list[dict]:
    """The predictor container's ports: KServe merges the InferenceService's model container into the
    runtime's with a strategic merge patch, ports keyed by containerPort (apimachinery's mergeSlice:
    the model's ports in its order, the runtime's others where they stood)."""
    keys = [p["containerPort"] for p in runtime]
    patched = [next((r for r in runtime if r["containerPort"] == p["containerPort"]), {}) | p for p in model]
    kept = [r for r in runtime if r["containerPort"] not in {p["containerPort"] for p in model}]
    merged = []
    while patched or kept:
        first = patched[0]["containerPort"] if patched else None
        if kept and (not patched or (first in keys and keys.index(first) > keys.index(kept[0]["containerPort"]))):
            merged.append(kept.pop(0))
        else:
            merged.append(patched.pop(0))
    return merged


def kserve_service_ports(ports: list[dict]) -> dict[int, tuple[int, str | None]]:
    """Service port -> (container port, appProtocol) of the Service KServe makes for a Standard-mode
    predictor (service_reconciler.go createDefaultSvc): the first container port on port 80, the others
    on their own number, kubernetes.io/h2c for a port whose name holds "grpc" or "h2c"."""

    def app_protocol(p):
        return "kubernetes.io/h2c" if "grpc" in p["name"] or "h2c" in p["name"] else None

    first, *others = ports
    return {80: (first["containerPort"], app_protocol(first))} | {
        p["containerPort"]: (p["containerPort"], app_protocol(p)) for p in others
    }


def test_kserve_standard_mode_routes_rest_and_grpc_to_the_ports_jitserve_listens_on():
    docs = kserve_documents()
    runtime, service = only(docs, "ClusterServingRuntime"), only(docs, "InferenceService")
    assert "grpc-v2" in runtime["spec"]["protocolVersions"]
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    (c,) = runtime["spec"]["containers"]
    model = service["spec"]["predictor"]["model"]
    rest, grpc = (int(env(c)[name]["value"]) for name in ("JITSERVE_PORT", "JITSERVE_GRPC_PORT"))
    ports = strategic_merge_ports(c["ports"], model.get("ports", []))
    assert {p["containerPort"] for p in ports} == {rest, grpc}
    assert all(p.get("protocol", "TCP") == "TCP" for p in ports)
    # REST on the Service's port 80 (the InferenceService's URL), gRPC on its own port as h2c.
    assert kserve_service_ports(ports) == {80: (rest, None), grpc: (grpc, "kubernetes.io/h2c")}


def test_strategic_merge_ports_keeps_the_runtime_port_first_only_when_the_model_lists_it():
    runtime = [{"name": "http1", "containerPort": PORT}]
    grpc = {"name": "grpc", "containerPort": GRPC_PORT}
    # A model that lists only the gRPC port puts it first: port 80 would be gRPC.
    assert [p["containerPort"] for p in strategic_merge_ports(runtime, [grpc])] == [GRPC_PORT, PORT]
    both = [{"name": "http1", "containerPort": PORT}, grpc]
    assert strategic_merge_ports(runtime, both) == both
    assert strategic_merge_ports(runtime, []) == runtime
