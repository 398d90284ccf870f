"""Every Kubernetes manifest renders with kustomize and validates offline.

- Plain kinds: the `kubernetes-validate` package (the Kubernetes OpenAPI schemas), strict.
- `RayService`: KubeRay's CRD schema with jsonschema, strict like `kubectl apply
  --validate=strict` (unknown fields are errors), `x-kubernetes-int-or-string` as
  integer-or-string. The schema is the `v1` `openAPIV3Schema` of KubeRay's
  `ray.io_rayservices.yaml` (ray-operator/config/crd/bases, commit feeaf72f, Apache-2.0),
  kept as gzipped JSON in `data/`; where the workspace's `shared/schemas/kuberay/` copy is
  present, a test checks the two are the same.
- `serveConfigV2`: Ray's own `ServeDeploySchema`, and equal to `splitspec k8s render` of the
  overlay's config (drift), whose application args validate back into that config.
- The same validators reject a manifest with a wrong type, so these checks can fail.
"""

from __future__ import annotations

import copy
import gzip
import json
import pathlib
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import SplitspecConfig, load_config
from cluster.k8s import render
from cluster.metrics import METRICS

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SHARED_CRD = ROOT.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayservices.yaml"
SCHEMA = pathlib.Path(__file__).parent / "data" / "rayservice-v1.openapi.json.gz"
KUBERNETES_VERSION = "1.30"
OVERLAYS = {"dev-cpu": K8S / "configs" / "dev-cpu.yaml", "prod-gpu": K8S / "configs" / "prod-gpu.yaml"}


def _kustomize_command() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("neither kubectl nor kustomize is installed")


def build(overlay: str) -> list[dict]:
    out = subprocess.run([*_kustomize_command(), str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(node):
    """A CRD's openAPIV3Schema as JSON Schema: int-or-string made explicit, and objects with
    declared properties closed to unknown fields (as the API server's strict validation)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) for k, v in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
    return node


def _schema() -> dict:
    return json.loads(gzip.decompress(SCHEMA.read_bytes()))


@pytest.fixture(scope="module")
def rayservice_schema():
    return _strict(_schema())


def test_the_kept_crd_schema_is_kuberays():
    if not SHARED_CRD.is_file():
        pytest.skip("the workspace's shared/schemas/kuberay/ is not here")
    crd = yaml.safe_load(SHARED_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["schema"]["openAPIV3Schema"] == _schema()


def validate(doc: dict, rayservice_schema) -> None:
    """Raise when `doc` is not a valid manifest of its kind."""
    if doc["kind"] == "RayService":
        assert doc["apiVersion"] == "ray.io/v1"
        jsonschema.validate(doc, rayservice_schema)
    elif doc["kind"] == "PodMonitor":  # Prometheus Operator CRD: no schema here; checked below
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request):
    return request.param, build(request.param), load_config(OVERLAYS[request.param])


def _one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _groups(rayservice) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_every_manifest_validates(overlay, rayservice_schema):
    name, docs, _ = overlay
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "NetworkPolicy", "PodDisruptionBudget", "PodMonitor", "ConfigMap"} <= kinds
    for doc in docs:
        validate(doc, rayservice_schema)
        assert doc["metadata"]["namespace"] == ("splitspec-dev" if name == "dev-cpu" else "splitspec")


def test_a_wrong_type_is_rejected(overlay, rayservice_schema):
    _, docs, _ = overlay
    rayservice = copy.deepcopy(_one(docs, "RayService"))
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        validate(rayservice, rayservice_schema)
    typo = copy.deepcopy(_one(docs, "RayService"))
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 8
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        validate(typo, rayservice_schema)
    service = copy.deepcopy(_one(docs, "Service", "splitspec-http"))
    service["spec"]["ports"][0]["port"] = "8000x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service, rayservice_schema)
    policy = copy.deepcopy(_one(docs, "NetworkPolicy", "splitspec-proposer-grpc"))
    policy["spec"]["ingress"][0]["ports"][0]["endPort"] = "20099"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(policy, rayservice_schema)


def test_serve_config_is_the_rendered_config(overlay):
    from ray.serve.schema import ServeDeploySchema

    name, docs, config = overlay
    rayservice = _one(docs, "RayService")
    text = rayservice["spec"]["serveConfigV2"]
    assert text == render(config), f"k8s/overlays/{name}/serve-config.yaml is stale: rerun `splitspec k8s render --patch`"
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    (app,) = serve_config.applications
    assert app.import_path == "cluster.deployments:app_builder"
    assert SplitspecConfig.model_validate(app.args) == config
    assert serve_config.http_options.port == config.api.http_port
    assert serve_config.grpc_options.port == config.api.grpc_port
    containers = [rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in _groups(rayservice).values()]
    if config.tracing.exporter == "none":
        assert serve_config.tracing_config is None or not serve_config.tracing_config.enabled
        assert all("env" not in c for c in containers)
        return
    assert serve_config.tracing_config.enabled
    assert serve_config.tracing_config.exporter_import_path == "cluster.tracing:span_processors"
    assert serve_config.tracing_config.sampling_ratio == config.tracing.sampling_ratio
    for c in containers:  # every Ray process, Serve's proxies included, reads the environment
        env = {e["name"]: e["value"] for e in c["env"]}
        assert type(config.tracing).model_validate_json(env["SPLITSPEC_TRACING"]) == config.tracing
        assert env["RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"] == "cluster.tracing:span_processors"
        assert float(env["RAY_SERVE_TRACING_SAMPLING_RATIO"]) == config.tracing.sampling_ratio


def test_cluster_matches_the_config(overlay):
    """The pods offer what the config's replicas ask for, and the policies use its ports."""
    _, docs, config = overlay
    rayservice = _one(docs, "RayService")
    groups = _groups(rayservice)
    verifier, proposers = groups["verifier"], groups["proposers"]
    v = config.verifier.resources
    for key in v.custom:
        assert key in verifier["resources"] and key not in proposers["resources"]
    for p in config.proposers:
        for key in p.resources.custom:
            assert key in proposers["resources"] and key not in verifier["resources"]
    container = verifier["template"]["spec"]["containers"][0]
    gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
    assert gpus == v.num_gpus == (config.verifier.tensor_parallel_size if v.num_gpus else 0)
    assert float(container["resources"]["limits"]["cpu"]) >= v.num_cpus
    max_verifiers = config.verifier.autoscaling.max_replicas if config.verifier.autoscaling else config.verifier.replicas
    assert verifier["maxReplicas"] >= max_verifiers  # one verifier replica per pod
    if config.model.path:
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert any(config.model.path.startswith(m + "/") for m in mounts), (config.model.path, mounts)
    # Ports: Services target Serve's proxies; the proposer policy admits exactly api.proposer_ports.
    assert _one(docs, "Service", "splitspec-http")["spec"]["ports"][0]["port"] == config.api.http_port
    assert _one(docs, "Service", "splitspec-grpc")["spec"]["ports"][0]["port"] == config.api.grpc_port
    rule = _one(docs, "NetworkPolicy", "splitspec-proposer-grpc")["spec"]["ingress"]
    assert len(rule) == 1 and rule[0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "splitspec", "splitspec.io/role": "verifier"}}}]
    (ports,) = rule[0]["ports"]
    assert (ports["port"], ports["endPort"]) == tuple(config.api.proposer_ports)
    open_ports = _one(docs, "NetworkPolicy", "splitspec-ingress")["spec"]["ingress"]
    assert open_ports == [{"ports": [{"protocol": "TCP", "port": config.api.http_port},
                                     {"protocol": "TCP", "port": config.api.grpc_port}]}]
    # Every pod exports metrics on the port the PodMonitor scrapes, with the label it selects.
    monitor = _one(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    templates = [rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [
        g["template"] for g in groups.values()]
    for template in templates:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        names = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert names[endpoint["port"]] == 8080
        assert template["spec"]["containers"][0]["readinessProbe"] and template["spec"]["containers"][0]["livenessProbe"]


def test_render_cli_prints_the_patch(capsys):
    from cluster.cli import main

    path = OVERLAYS["prod-gpu"]
    assert main(["k8s", "render", str(path), "--patch"]) == 0
    printed = capsys.readouterr().out
    assert printed == (K8S / "overlays" / "prod-gpu" / "serve-config.yaml").read_text()
    op, *env_ops = yaml.safe_load(printed)
    assert op["op"] == "add" and op["path"] == "/spec/serveConfigV2" and op["value"] == render(load_config(path))
    assert [o["path"].split("/template")[0] for o in env_ops] == [
        "/spec/rayClusterConfig/headGroupSpec", "/spec/rayClusterConfig/workerGroupSpecs/0",
        "/spec/rayClusterConfig/workerGroupSpecs/1"]
    assert main(["k8s", "render", str(path)]) == 0
    assert capsys.readouterr().out == render(load_config(path))


def test_dashboard_queries_only_exported_series():
    dashboard = json.loads((K8S / "base" / "grafana" / "splitspec-dashboard.json").read_text())
    known = set()
    for name, kind, _, _ in METRICS:
        series = f"ray_{name}"
        known |= {f"{series}_total"} if kind == "counter" else {series} if kind == "gauge" else {
            f"{series}_bucket", f"{series}_count", f"{series}_sum"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"ray_splitspec_\w+", e)}
    assert used <= known, f"series no metric exports: {sorted(used - known)}"
    # Acceptance rate, mean acceptance length and per-position acceptance are all on it.
    assert {"ray_splitspec_accepted_tokens_total", "ray_splitspec_draft_tokens_total", "ray_splitspec_drafts_total",
            "ray_splitspec_accepted_tokens_per_position_total"} <= used
