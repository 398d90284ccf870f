"""A real local Ray cluster with Serve, shared by every `serve` test of the session.

Ray runs with auth disabled, its temp dir under pytest's, the dashboard off, and Serve's
HTTP and gRPC proxies on free ports (never the defaults). Applications are deployed on
first use, each under its own route prefix, and stay up for the session; teardown shuts
Serve down and then the Ray processes this session started (never `ray stop`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import pytest

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ServedApp:
    name: str
    route_prefix: str
    http: str  # http://host:port
    grpc: str  # host:port

    @property
    def base_url(self) -> str:
        return f"{self.http}{self.route_prefix.rstrip('/')}/v1"

    @property
    def health_url(self) -> str:
        return f"{self.http}{self.route_prefix.rstrip('/')}/health"

    @property
    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("application", self.name),)

    def verifier(self):
        from ray import serve

        return serve.get_deployment_handle("Verifier", self.name)

    def proposer(self, method: str = "ngram"):
        from ray import serve

        return serve.get_deployment_handle(f"Proposer-{method}", self.name)


#: The session cluster's Prometheus port (Ray metrics), set by `serve_cluster`.
METRICS = {}


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory):
    """(http_port, grpc_port) of Serve on a fresh local Ray cluster."""
    import ray
    from ray import serve

    from cluster.service import free_port, start_serve

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Short socket paths: Ray's temp dir must stay well under the 107-byte AF_UNIX limit.
    ray_tmp = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir=tempfile.gettempdir())
    # Metrics reach the node's exporter every 0.5 s instead of 10 s (the metrics test waits on it).
    os.environ["RAY_metrics_report_interval_ms"] = "500"
    METRICS["port"] = free_port()
    for attempt in range(2):
        try:
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS["port"])
            break
        except Exception as exc:
            # Seen once in a CI run on 2 busy cores: the head node timed out starting, and
            # every test of the session errored. A second start has a fresh chance.
            if attempt or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
    try:
        http_port, grpc_port = start_serve(HOST, 0, 0)
        yield http_port, grpc_port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)  # sockets, logs, spilled objects of this session


@pytest.fixture(scope="session")
def metrics_url(serve_cluster) -> str:
    """The session cluster's Prometheus endpoint (every Ray process's `ray.util.metrics`)."""
    return f"http://{HOST}:{METRICS['port']}/metrics"


def _deploy(serve_cluster, name: str, route_prefix: str, config: dict) -> ServedApp:
    from cluster.config import SplitspecConfig
    from cluster.service import deploy, wait_healthy

    http_port, grpc_port = serve_cluster
    deploy(SplitspecConfig.model_validate(config), app_name=name, route_prefix=route_prefix)
    app = ServedApp(name, route_prefix, f"http://{HOST}:{http_port}", f"{HOST}:{grpc_port}")
    wait_healthy(app.health_url, timeout_s=120)
    return app


#: Verifier settings shared by the test apps: 2 torch threads like the local engine.
_VERIFIER = {"num_threads": 2, "proposer_deadline_ms": 200}


@pytest.fixture(scope="session")
def main_app(serve_cluster) -> ServedApp:
    """n-gram speculation under the default goodput controller (k = 4 for `mode: on`),
    one proposer replica, room for 12 requests; Hermes tool calls for tool_choice auto."""
    return _deploy(serve_cluster, "main", "/", {
        "model": {"tool_call_parser": "hermes"},
        "proposers": [{"method": "ngram", "resources": {"num_cpus": 0.25}}],
        "verifier": {**_VERIFIER, "max_num_seqs": 8, "max_model_len": 1024, "max_waiting": 4,
                     "resources": {"num_cpus": 1}},
        "controller": {"policy": "goodput", "k": 4, "max_k": 8},
    })


def _deleted_after(serve_cluster, name: str, route_prefix: str, config: dict):
    """`_deploy`, as a fixture's body that deletes the app after its test, so that its
    replicas' CPU share and memory go back to the session's other apps (an idle app's
    replicas still take a few percent of a core each)."""
    from ray import serve

    app = _deploy(serve_cluster, name, route_prefix, config)
    try:
        yield app
    finally:
        serve.delete(app.name)


#: `tight_app`'s chat template (`model.chat_template`): ChatML without SmolLM2's system
#: turn, the contents upper-cased, so a prompt shows which template rendered it.
TIGHT_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tight_app(serve_cluster):
    """One KV slot and no queue (overload), no proposers (speculation not configured), a
    chat template of its own. Deleted after the module."""
    yield from _deleted_after(serve_cluster, "tight", "/tight", {
        "model": {"chat_template": TIGHT_CHAT_TEMPLATE},
        "proposers": [],
        "verifier": {**_VERIFIER, "max_num_seqs": 1, "max_model_len": 512, "max_waiting": 0,
                     "resources": {"num_cpus": 0.5}},
    })


@pytest.fixture
def autoscale_app(serve_cluster):
    """Proposers autoscale 1..2 at one sequence per replica; the verifier is fixed.
    Deleted after the test."""
    yield from _deleted_after(serve_cluster, "auto", "/auto", {
        "proposers": [{"method": "ngram", "resources": {"num_cpus": 0.25}, "autoscaling": {
            "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
            "upscale_delay_s": 0.0, "downscale_delay_s": 2.0, "look_back_period_s": 1.0}}],
        "verifier": {**_VERIFIER, "max_num_seqs": 4, "max_model_len": 512, "max_waiting": 4,
                     "resources": {"num_cpus": 0.5}},
        "controller": {"policy": "static", "k": 4},
    })


@pytest.fixture(scope="session")
def model_proposers_app(serve_cluster) -> ServedApp:
    """The trained draft model and EAGLE head (proposers/assets/; the eagle default, the
    EAGLE-3 head), each its own deployment talking gRPC to the verifier, which sends the
    EAGLE one the target's hidden states (entering layers 2, 15 and 27); and n-gram lookup
    placed in the verifier replica, called in-process; Llama 3 JSON tool calls for
    tool_choice auto."""
    return _deploy(serve_cluster, "models", "/models", {
        "model": {"tool_call_parser": "llama3_json"},
        "proposers": [{"method": "draft", "num_threads": 2, "resources": {"num_cpus": 0.25}},
                      {"method": "ngram", "placement": "verifier"},
                      {"method": "eagle", "resources": {"num_cpus": 0.25}}],
        "verifier": {**_VERIFIER, "max_num_seqs": 4, "max_model_len": 1024, "max_waiting": 4,
                     "proposer_deadline_ms": 2000, "resources": {"num_cpus": 0.5}},
        "controller": {"policy": "goodput", "k": 4, "max_k": 4},
    })


@pytest.fixture
def split_app(serve_cluster):
    """The target split over two processes (`tensor_parallel_size: 2` on CPU: the replica
    and a worker it starts, one torch thread each), n-gram lookup in the replica. Deleted
    after the test."""
    yield from _deleted_after(serve_cluster, "split", "/split", {
        "proposers": [{"method": "ngram", "placement": "verifier"}],
        "verifier": {**_VERIFIER, "tensor_parallel_size": 2, "max_num_seqs": 2, "max_model_len": 512,
                     "max_waiting": 4, "resources": {"num_cpus": 0.25}},
        "controller": {"policy": "static", "k": 4},
    })


@pytest.fixture
def eagle_in_verifier_app(serve_cluster):
    """The committed EAGLE head placed in the verifier replica (`placement: verifier`): built
    there beside the target, handed its hidden states in-process. Deleted after the test."""
    yield from _deleted_after(serve_cluster, "eagle-in-verifier", "/eagle-in-verifier", {
        "proposers": [{"method": "eagle", "placement": "verifier"}],
        "verifier": {**_VERIFIER, "max_num_seqs": 4, "max_model_len": 1024, "max_waiting": 4,
                     "resources": {"num_cpus": 0.25}},
        "controller": {"policy": "goodput", "k": 4, "max_k": 4},
    })
