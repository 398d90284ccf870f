"""Start and stop the service on a Ray cluster (used by `splitspec serve` and the tests)."""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.error
import urllib.request

from cluster.config import SplitspecConfig, TracingConfig

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_serve(host: str, http_port: int, grpc_port: int, tracing: TracingConfig | None = None) -> tuple[int, int]:
    """Start Serve's HTTP and gRPC proxies (ports 0 = pick free ones), tracing as `tracing`
    says (Ray processes need `cluster.tracing.tracing_env` too); return the ports."""
    from ray import serve

    from cluster.ingress import GENERATE_SERVICER
    from cluster.tracing import serve_tracing_config

    http_port = http_port or free_port(host)
    grpc_port = grpc_port or free_port(host)
    serve.start(
        http_options={"host": host, "port": http_port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": [GENERATE_SERVICER]},
        tracing_config=serve_tracing_config(tracing or TracingConfig()),
    )
    return http_port, grpc_port


def deploy(config: SplitspecConfig, app_name: str = "splitspec", route_prefix: str = "/") -> None:
    """Deploy (or update) the application and wait until its deployments are running."""
    from ray import serve

    from cluster.deployments import build_app

    serve.run(build_app(config), name=app_name, route_prefix=route_prefix, blocking=False)


def wait_healthy(url: str, timeout_s: float = 120.0) -> dict:
    """Poll `url` (/health) until it answers 200; raise TimeoutError otherwise."""
    import json

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s (last: {last!r})")


def init_ray(address: str | None, num_cpus: int | None = None, metrics_port: int = 0,
             env: dict[str, str] | None = None) -> int | None:
    """Join `address`, or start a local cluster with this process as its owner, exporting
    Ray metrics on `metrics_port` (0 = a free port). `env` reaches every Ray process of
    this job (and, for a local cluster, the proxies Serve starts). Returns the local
    cluster's metrics port (None when joining)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = dict(env or {})
    os.environ.update(env)  # a local cluster's processes inherit this environment
    runtime_env = {"env_vars": env} if env else None
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
        return None
    metrics_port = metrics_port or free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env,
             _metrics_export_port=metrics_port)
    return metrics_port


def stop(app_name: str, owns_cluster: bool) -> None:
    """Remove the application; on a cluster this process started, stop Serve and Ray too."""
    import ray
    from ray import serve

    from cluster.discovery import kill_directory

    try:
        if owns_cluster:
            serve.shutdown()
        else:
            serve.delete(app_name)
        kill_directory(app_name)
    finally:
        ray.shutdown()
