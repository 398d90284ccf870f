"""`splitspec k8s render CONFIG`: the KubeRay `serveConfigV2` of a splitspec YAML config.

The same file that `splitspec serve` runs locally becomes the Serve config of a RayService
(`k8s/`): Serve's proxies on every pod (HTTP and gRPC on the config's ports, bound to the
pod IP), one application built by `cluster.deployments:app_builder` from the config's
sections inline, and Serve tracing when the config traces.

    splitspec k8s render k8s/configs/prod-gpu.yaml            # serveConfigV2 (YAML)
    splitspec k8s render k8s/configs/prod-gpu.yaml --patch    # a kustomize patch that sets it

The kustomize overlays in `k8s/overlays/` hold the `--patch` output of their config; a
test fails when they drift.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from cluster.config import SplitspecConfig, load_config

#: Serve's defaults, used when the config asks for "any free port" (0), which a Service cannot target.
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 9000
APP_BUILDER = "cluster.deployments:app_builder"


def serve_config(config: SplitspecConfig, app_name: str = "splitspec") -> dict[str, Any]:
    """The `serveConfigV2` mapping (Ray's `ServeDeploySchema`) that runs `config`."""
    from cluster.ingress import GENERATE_SERVICER
    from cluster.tracing import serve_tracing_config

    api = config.api
    app: dict[str, Any] = {
        "name": app_name,
        "route_prefix": "/",
        "import_path": APP_BUILDER,
        # Every field, defaults included: the image's splitspec version validates it back
        # into `config` whatever its own defaults are.
        "args": config.model_dump(mode="json"),
    }
    out: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": api.http_port or DEFAULT_HTTP_PORT},
        "grpc_options": {"port": api.grpc_port or DEFAULT_GRPC_PORT, "grpc_servicer_functions": [GENERATE_SERVICER]},
    }
    tracing = serve_tracing_config(config.tracing)
    if tracing is not None:
        # Every process's span processors read the tracing section from the pods' environment
        # (`render(..., patch=True)` sets it).
        out["tracing_config"] = tracing
    out["applications"] = [app]
    return out


def render(config: SplitspecConfig, app_name: str = "splitspec", patch: bool = False,
           worker_groups: int = 2) -> str:
    """`serve_config` as the YAML string KubeRay reads; with `patch`, a kustomize JSON patch
    (RFC 6902) for `k8s/base`'s RayService: it sets `spec.serveConfigV2` and, when the
    config traces, the `env` of the head's and each of the `worker_groups` groups' first
    container to `cluster.tracing.tracing_env` (Serve's proxies read only the environment)."""
    from cluster.tracing import tracing_env

    text = yaml.safe_dump(serve_config(config, app_name), sort_keys=False)
    if not patch:
        return text
    ops: list[dict[str, Any]] = [{"op": "add", "path": "/spec/serveConfigV2", "value": text}]
    env = [{"name": k, "value": v} for k, v in tracing_env(config.tracing).items()]
    if env:
        groups = ["headGroupSpec"] + [f"workerGroupSpecs/{i}" for i in range(worker_groups)]
        ops += [{"op": "add", "path": f"/spec/rayClusterConfig/{g}/template/spec/containers/0/env", "value": env}
                for g in groups]
    return yaml.dump(ops, Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings as `|` blocks, as people write serveConfigV2 by hand, and
    repeated values in full (no YAML anchors)."""

    def ignore_aliases(self, data) -> bool:
        return True


_BlockDumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def _render(args: argparse.Namespace) -> int:
    print(render(load_config(args.config), args.app_name, args.patch, args.worker_groups), end="")
    return 0


def add_parser(sub) -> None:
    k = sub.add_parser("k8s", help="Kubernetes (KubeRay) manifests")
    ksub = k.add_subparsers(dest="what", required=True)
    r = ksub.add_parser("render", help="print the RayService serveConfigV2 of a splitspec config")
    r.add_argument("config", help="splitspec YAML config (the one `splitspec serve` takes)")
    r.add_argument("--app-name", default="splitspec", help="Serve application name")
    r.add_argument("--patch", action="store_true",
                   help="print a kustomize JSON patch that sets spec.serveConfigV2, and the pods' tracing "
                        "environment when the config traces (k8s/overlays/*/serve-config.yaml)")
    r.add_argument("--worker-groups", type=int, default=2,
                   help="worker groups of the RayService the patch applies to (k8s/base has 2)")
    r.set_defaults(func=_render)
