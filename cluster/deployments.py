"""Ray Serve deployments: one per configured proposer, the verifier, and the app graph.

    Ingress (HTTP + gRPC Generate) --Serve handle, one call per request--> Verifier
    Verifier --one gRPC stream per proposer replica, one message per round--> Proposer-<method>

Proposer replicas run a grpc.aio server in their own thread and announce its address in
the application's `ProposerDirectory`; the verifier polls the directory and routes each
sequence to one replica (`verifier.routing`). A proposer with `placement: verifier` has no
deployment: each verifier replica builds it and calls it in-process, through the same
`ProposalSource` protocol. Serve handles are used only once per request, never per round.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import sys
import threading
from typing import Any

import ray
from ray import serve

from cluster.autoscaling import ACTIVE_SEQUENCES, POLICY_PATH
from cluster.config import AutoscalingConfig, ProposerConfig, ResourcesConfig, SplitspecConfig
from cluster.discovery import HEARTBEAT_S, get_directory
from verifier.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def _answer(call, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`call`'s answer, or its `InvalidRequestError` as {"error": {"param", "message"}}
    (an answer the ingress turns into a 400, rather than an exception through Ray)."""
    try:
        return call(*args, **kwargs)
    except InvalidRequestError as exc:
        return {"error": {"param": exc.param, "message": str(exc)}}


#: How often a replica pushes its autoscaling metrics (Serve reads it at process start).
PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"

#: Verifier poll period of the proposer directory.
DISCOVERY_PERIOD_S = 0.5


def served_model_name(config: SplitspecConfig) -> str:
    """The name in /v1/models: configured, else the checkpoint's file or folder name."""
    if config.model.name:
        return config.model.name
    if config.model.path is None:
        return "SmolLM2-135M-Instruct"
    path = pathlib.Path(config.model.path)
    return path.stem if path.suffix == ".gguf" else path.name


# ---------------------------------------------------------------------- proposers
class ProposerReplica:
    """Hosts one proposal method behind `splitspec.v1.Proposer` (gRPC) in a Serve replica."""

    def __init__(self, config: dict[str, Any], ports: tuple[int, int] | None = None) -> None:
        from proposers.registry import build_proposer

        cfg = ProposerConfig.model_validate(config)
        self.method = cfg.method
        self._ports = ports
        self._source = build_proposer(cfg.method, dict(cfg.options))
        # torch threads as configured; else Ray's default (num_cpus rounded down, at least 1).
        torch = sys.modules.get("torch")  # loaded by model proposers only
        if cfg.num_threads and torch is not None:
            from verifier.models.threads import run_on_cpu_worker

            torch.set_num_threads(cfg.num_threads)
            # The model thread read torch's thread count when the proposer packed its
            # weights there (`build_proposer`), so it is told again.
            run_on_cpu_worker(torch.set_num_threads, cfg.num_threads)
        context = serve.get_replica_context()
        self._deployment = context.deployment
        self._replica_id = context.replica_id.unique_id
        self._directory = get_directory(context.app_name)
        self.address: str | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True,
                                        name=f"splitspec-proposer-{self.method}")
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"proposer {self.method}: the gRPC server did not start within 60 s")
        if self._error is not None:
            raise RuntimeError(f"proposer {self.method}: the gRPC server failed to start") from self._error

    async def _serve(self) -> None:
        from proposers.server import ProposerServicer

        try:
            max_k = int(getattr(getattr(self._source, "config", None), "max_k", 16))
            server, port = await _start_in_range(ProposerServicer(self._source, max_k), self._ports)
            self.address = f"{ray.util.get_node_ip_address()}:{port}"
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping.is_set():
                self._directory.announce.remote(self._deployment, self._replica_id, self.address)
                await asyncio.sleep(HEARTBEAT_S)
        finally:
            await server.stop(grace=0.5)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve custom autoscaling metric (see `cluster.autoscaling`)."""
        return {ACTIVE_SEQUENCES: float(getattr(self._source, "num_sequences", 0))}

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"proposer {self.method}: the gRPC server thread stopped")

    def info(self) -> dict[str, Any]:
        torch = sys.modules.get("torch")
        return {"method": self.method, "address": self.address, "replica_id": self._replica_id,
                "pid": os.getpid(), "active_sequences": getattr(self._source, "num_sequences", 0),
                "torch_threads": None if torch is None else torch.get_num_threads()}

    def __del__(self) -> None:
        stopping = getattr(self, "_stopping", None)
        if stopping is None:
            return
        stopping.set()
        try:
            self._directory.withdraw.remote(self._deployment, self._replica_id)
        except Exception:  # shutting down: the entry expires anyway
            pass


async def _start_in_range(servicer, ports: tuple[int, int] | None):
    """Start the proposer's gRPC server on the first free port of `ports` (any free port if None)."""
    from proposers.server import start_server

    if ports is None:
        return await start_server(servicer, "0.0.0.0", 0)
    for port in range(ports[0], ports[1] + 1):
        try:
            return await start_server(servicer, "0.0.0.0", port)
        except (OSError, RuntimeError):  # taken (grpc raises RuntimeError on some versions)
            continue
    raise OSError(f"api.proposer_ports: every port in {list(ports)} is taken on this node")


# ---------------------------------------------------------------------- verifier
class VerifierReplica:
    """Runs the engine; streams `verifier.server` events to the ingress."""

    async def __init__(self, config: dict[str, Any], *proposers) -> None:
        import torch

        from cluster.local import engine_from_config, load_model_and_tokenizer, load_tokenizer, verifier_threads
        from cluster.metrics import RayEngineMetrics
        from verifier.models.tensor_parallel import TensorParallelModel
        from verifier.models.vocab import VocabFingerprint
        from proposers.registry import NEEDS_HIDDEN_STATES, build_proposer, hidden_state_layers
        from verifier.routing import RoutedProposalSource
        from verifier.server import VerifierServer

        cfg = SplitspecConfig.model_validate(config)
        v = cfg.verifier
        threads = verifier_threads(v)
        if threads:
            torch.set_num_threads(threads)
        if v.tensor_parallel_size > 1:  # each rank reads only its share of the layers
            tokenizer = load_tokenizer(cfg.model.path, cfg.model.tokenizer, chat_template=cfg.model.chat_template)
            model = TensorParallelModel.start(cfg.model.path, cfg.model.dtype, v.tensor_parallel_size, threads)
        else:
            model, tokenizer = load_model_and_tokenizer(cfg.model.path, cfg.model.tokenizer, cfg.model.dtype,
                                                        cfg.model.chat_template)
        # deployment name of each deployed method, from the handles Serve passed in (`build_app`)
        deployed = [p for p in cfg.proposers if p.placement == "deployment"]
        self._proposer_deployments = {p.method: h.deployment_name for p, h in zip(deployed, proposers)}
        vocab = VocabFingerprint.of(tokenizer)  # model proposers with another vocabulary are refused
        self._routers = {
            p.method: RoutedProposalSource(
                p.method, deadline_s=v.proposer_deadline_ms / 1000.0, target_vocab=vocab,
                needs_hidden_states=p.method in NEEDS_HIDDEN_STATES,
                hidden_state_layers=hidden_state_layers(p.method, dict(p.options), model.config.num_layers))
            for p in deployed
        }
        # Proposers placed in this replica: called in-process, through the same protocol.
        self._in_process = {p.method: build_proposer(p.method, dict(p.options))
                            for p in cfg.proposers if p.placement == "verifier"}
        sources = {p.method: self._routers[p.method] if p.method in self._routers else self._in_process[p.method]
                   for p in cfg.proposers}  # in the config's order
        methods = tuple(self._routers)
        app_name = serve.get_replica_context().app_name
        engine = engine_from_config(cfg, model, tokenizer, sources, RayEngineMetrics(app_name))
        self.server = VerifierServer(engine, served_model_name(cfg))
        self._seen = {m: False for m in methods}
        self._directory = get_directory(app_name) if methods else None
        if methods:
            await self._discover()
        self._discovery = asyncio.get_running_loop().create_task(self._discovery_loop())

    async def _discover(self) -> None:
        for method, deployment in self._proposer_deployments.items():
            replicas = await self._directory.replicas.remote(deployment)
            router = self._routers[method]
            await router.set_replicas(sorted(replicas.values()))
            self._seen[method] = self._seen[method] or bool(replicas)
            await router.flush()

    async def _discovery_loop(self) -> None:
        while self._directory is not None:
            try:
                await self._discover()
            except Exception:  # the directory restarting: keep the last known set
                logger.warning("proposer discovery failed; keeping the last replica set", exc_info=True)
            await asyncio.sleep(DISCOVERY_PERIOD_S)

    async def generate(self, request):
        async for event in self.server.generate(request):
            yield event

    def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """`VerifierServer.tokenize`; a bad request answers {"error": {"param", "message"}}."""
        return _answer(self.server.tokenize, **request)

    def detokenize(self, token_ids: list[int]) -> dict[str, Any]:
        """`VerifierServer.detokenize`, answered as `tokenize` is."""
        return _answer(self.server.detokenize, token_ids)

    def stats(self) -> dict[str, Any]:
        out = self.server.stats()
        out["replica_id"] = serve.get_replica_context().replica_id.unique_id
        out["pid"] = os.getpid()
        out["proposers"] = {
            m: {"placement": "deployment", "replicas": r.addresses, "live": r.live_addresses(),
                "refused": dict(r.refused), **r.stats.__dict__}
            for m, r in self._routers.items()
        }
        for m, source in self._in_process.items():
            out["proposers"][m] = {"placement": "verifier", "active_sequences": getattr(source, "num_sequences", 0)}
        model = self.server.engine.model
        if hasattr(model, "worker_pids"):  # a `TensorParallelModel`
            out["tensor_parallel"] = {"size": model.world_size, "worker_pids": model.worker_pids,
                                      "problem": model.problem()}
        return out

    def health(self) -> dict[str, Any]:
        """Ready once every proposer deployment has been seen at least once. `proposers`:
        live replicas per method; a proposer placed in this replica counts as 1."""
        return {
            "ready": all(self._seen.values()),
            "proposers": {m: 1 if m in self._in_process else len(self._routers[m].live_addresses())
                          for m in self.server.engine.proposers},
            "num_running": self.server.engine.num_running,
            "num_waiting": self.server.engine.num_waiting,
        }

    def check_health(self) -> None:
        if self._discovery.done() and not self._discovery.cancelled() and self._discovery.exception():
            raise RuntimeError("proposer discovery stopped") from self._discovery.exception()
        problem = getattr(self.server.engine.model, "problem", lambda: None)()  # a `TensorParallelModel`'s
        if problem is not None:  # Serve replaces the replica (and so its workers)
            raise RuntimeError(problem)


# ---------------------------------------------------------------------- app graph
def _scaling_options(replicas: int, autoscaling: AutoscalingConfig | None, custom_policy: bool) -> dict[str, Any]:
    if autoscaling is None:
        return {"num_replicas": replicas}
    a = autoscaling.model_dump()
    # Serve still validates its deprecated scrape period against the look-back window.
    a["metrics_interval_s"] = min(10.0, a["look_back_period_s"] / 2)
    if custom_policy:
        a["policy"] = {"policy_function": POLICY_PATH}
    return {"autoscaling_config": a}


def _actor_options(resources: ResourcesConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.custom:
        options["resources"] = dict(resources.custom)
    return options


def build_app(config: SplitspecConfig):
    """The Serve application for `config` (`serve.run(build_app(cfg), name=...)`)."""
    from cluster.ingress import Ingress

    proposer_apps = []
    for p in config.proposers:
        if p.placement == "verifier":  # built inside each verifier replica
            continue
        actor_options = _actor_options(p.resources)
        if p.autoscaling is not None:
            # Report load twice per look-back window (Serve's default push is every 10 s,
            # read from the environment when the replica process starts).
            push_s = max(0.5, min(10.0, p.autoscaling.look_back_period_s / 2))
            actor_options["runtime_env"] = {"env_vars": {PUSH_INTERVAL_ENV: str(push_s)}}
        deployment = serve.deployment(ProposerReplica).options(
            name=f"Proposer-{p.method}",
            ray_actor_options=actor_options,
            # Proposer traffic is gRPC; Serve only sees health checks and info calls.
            max_ongoing_requests=16,
            health_check_period_s=2.0,
            graceful_shutdown_timeout_s=2.0,
            **_scaling_options(p.replicas, p.autoscaling, custom_policy=True),
        )
        proposer_apps.append(deployment.bind(p.model_dump(mode="json"), config.api.proposer_ports))
    v = config.verifier
    per_replica = v.max_num_seqs + v.max_waiting
    verifier = serve.deployment(VerifierReplica).options(
        name="Verifier",
        ray_actor_options=_actor_options(v.resources),
        # Room above the engine's own limit, so overload is the engine's clear 429.
        max_ongoing_requests=per_replica + 8,
        graceful_shutdown_timeout_s=5.0,
        health_check_period_s=2.0,  # a lost tensor-parallel worker fails passes until it is replaced
        **_scaling_options(v.replicas, v.autoscaling, custom_policy=False),
    ).bind(config.model_dump(mode="json"), *proposer_apps)
    max_verifiers = v.autoscaling.max_replicas if v.autoscaling else v.replicas
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(64, 2 * (per_replica + 8) * max_verifiers),
        graceful_shutdown_timeout_s=5.0,
    ).bind(verifier, served_model_name(config), v.max_model_len, config.model.tool_call_parser)
    return ingress


def app_builder(args: dict[str, Any]):
    """Serve application builder, for `serve run` and KubeRay's `serveConfigV2`:

        import_path: cluster.deployments:app_builder
        args: {config: path/to/config.yaml}      # or the config's sections inline

    Ports in the config's `api` section do not apply here: Serve's own `http_options` and
    `grpc_options` set them (list the servicer `GENERATE_SERVICER` of `cluster.ingress`).
    """
    from cluster.config import load_config

    if "config" in args:
        return build_app(load_config(args["config"]))
    return build_app(SplitspecConfig.model_validate(dict(args)))
