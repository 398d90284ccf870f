"""The one YAML file that describes a deployment, validated once at the boundary.

The same file feeds `splitspec serve` locally and the RayService `serveConfigV2` on
Kubernetes. Every field has a description; validation errors name the field and say what
was given. Defaults run on a 2-core laptop with the bundled model.

    model: {path: null, dtype: float32}
    proposers:
      - {method: ngram, replicas: 1}
    verifier: {max_num_seqs: 8, max_model_len: 2048}
    controller: {policy: goodput, max_k: 8}
    api: {http_port: 8000, grpc_port: 9000}
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from verifier.errors import ModelLoadError, SplitspecError


#: What `splitspec serve` runs without a CONFIG argument: a 2-core laptop, bundled model.
LOCAL_CONFIG_PATH = pathlib.Path(__file__).parent / "configs" / "local-cpu.yaml"


class ConfigError(SplitspecError):
    """The configuration file is missing, not YAML, or fails validation."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingConfig(_Strict):
    """Ray Serve `autoscaling_config` of one deployment (same field names as Serve)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running (0 allows scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas the autoscaler may start.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica the autoscaler aims for; lower scales up sooner.")
    upscale_delay_s: float = Field(2.0, ge=0, description="How long load must stay high before scaling up.")
    downscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay low before scaling down.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window over which the load metric is averaged.")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class ResourcesConfig(_Strict):
    """Resources of one replica, as Ray counts them."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica; fractions share a core.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (the verifier's tensor-parallel size on GPUs).")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per replica, e.g. {proposer_slot: 1} to keep "
        "proposers on the worker group that declares that resource (k8s/).")


#: Proposer options that name files or directories (a leading ~ is the user's home).
PATH_OPTIONS = ("path", "base", "tokenizer")


class TargetConfig(_Strict):
    """The target model."""

    path: str | None = Field(None, description="A .gguf file or HF checkpoint directory (a leading ~ is the user's "
                             "home); null = bundled SmolLM2-135M-Instruct.")
    tokenizer: str | None = Field(None, description="Local tokenizer directory; null = from the model.")
    name: str | None = Field(None, description="Name served in /v1/models; null = derived from the path.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="float32 is exact; bfloat16 is faster on GPUs and bf16 CPUs.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template used instead of the model's own (vLLM's --chat-template), or the "
        "path of a file holding one, read when the config is loaded; null = the model's.")
    tool_call_parser: Literal["hermes", "llama3_json", "pythonic"] | None = Field(
        None, description="Reads tool calls out of free text, so the chat API's tool_choice 'auto' (its default when "
        "tools are given) works (vLLM's --enable-auto-tool-choice --tool-call-parser): 'hermes' reads "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks, as Hermes 2 Pro and Qwen2.5 write "
        "them; 'llama3_json' an output that is all {\"name\": ..., \"parameters\": {...}} objects separated by ';', "
        "as Llama 3.1+ writes them; 'pythonic' an output that is a Python list of calls [name(arg=value, ...)], as "
        "Llama 3.2 and 4 write them; null = none, and 'auto' is a 400.")

    @field_validator("path", "tokenizer")
    @classmethod
    def _home(cls, path: str | None) -> str | None:
        return None if path is None else os.path.expanduser(path)

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from verifier.models.tokenizer import read_chat_template

        try:
            return read_chat_template(value)
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None


class ProposerConfig(_Strict):
    """One proposer: its own Serve deployment, or built inside the verifier (`placement`)."""

    method: str = Field(..., description="Registered proposal method, e.g. 'ngram'.")
    placement: Literal["deployment", "verifier"] = Field(
        "deployment", description="'deployment': its own Serve deployment, reached over gRPC, with its own "
        "replicas, resources and autoscaling; 'verifier': built inside each verifier replica and called "
        "in-process (no round trip, as vLLM runs n-gram lookup in its worker), sharing the verifier's CPUs and "
        "scaling with it. Suits n-gram lookup, which drafts in well under a millisecond; a model proposer "
        "placed there takes its compute from the verifier's passes.")
    options: dict[str, Any] = Field(default_factory=dict, description="Method options, e.g. {min_n: 2, max_n: 4} for ngram, {tree: [3, 2, 1]}, {dynamic_tree: 4} or {dynamic_tree: 4, tree_budget: 15} for draft or eagle.")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of a model proposer (draft, eagle); null = Ray's default, "
        "resources.num_cpus rounded down, at least 1. N-gram never uses torch.")
    replicas: int = Field(1, ge=1, description="Replicas when autoscaling is not set.")
    fallback: str | None = Field(
        None, description="Another configured method that drafts, in the same round, for the sequences this one "
        "has no draft for (e.g. ngram with fallback: eagle: the head drafts wherever n-gram lookup finds no "
        "match); null = none.")
    resources: ResourcesConfig = Field(ResourcesConfig(num_cpus=0.5), description="Per-replica resources.")
    autoscaling: AutoscalingConfig | None = Field(None, description="Serve autoscaling; overrides replicas.")

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        from proposers.registry import PROPOSERS

        if method not in PROPOSERS:
            raise ValueError(f"unknown method {method!r}; known: {sorted(PROPOSERS)}")
        return method

    @field_validator("options")
    @classmethod
    def _home(cls, options: dict[str, Any]) -> dict[str, Any]:
        return {k: os.path.expanduser(v) if k in PATH_OPTIONS and isinstance(v, str) else v
                for k, v in options.items()}

    @field_validator("options")
    @classmethod
    def _tree_widths(cls, options: dict[str, Any]) -> dict[str, Any]:
        tree = options.get("tree")
        if tree is not None and not (isinstance(tree, list) and tree and all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in tree)):
            raise ValueError(f"tree must be a list of widths >= 1, e.g. [3, 2, 1] (given: {tree!r})")
        dynamic = options.get("dynamic_tree")
        if dynamic is not None and not (isinstance(dynamic, int) and not isinstance(dynamic, bool) and dynamic >= 1):
            raise ValueError(f"dynamic_tree must be a number of nodes a depth >= 1, e.g. 4 (given: {dynamic!r})")
        if tree is not None and dynamic is not None:
            raise ValueError("tree and dynamic_tree exclude each other: fixed widths or a dynamic tree")
        budget = options.get("tree_budget")
        if budget is not None:
            if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
                raise ValueError(f"tree_budget must be a number of nodes >= 1, e.g. 15 (given: {budget!r})")
            if dynamic is None:
                raise ValueError("tree_budget reranks a dynamic tree's nodes: set dynamic_tree too")
        return options

    @model_validator(mode="after")
    def _vocab_subset_is_for_drafts(self) -> "ProposerConfig":
        subset = self.options.get("vocab_subset")
        if subset is not None:
            if self.method != "draft":
                raise ValueError(f"options.vocab_subset: cuts a plain draft model's LM head, method draft only "
                                 f"(method {self.method!r})")
            if isinstance(subset, bool) or not isinstance(subset, int) or subset < 1:
                raise ValueError(f"options.vocab_subset must be a number of tokens >= 1, e.g. 32768 "
                                 f"(given: {subset!r})")
        return self

    @model_validator(mode="after")
    def _placed_in_the_verifier(self) -> "ProposerConfig":
        if self.placement == "verifier":
            default = ProposerConfig.model_fields
            for name in ("replicas", "num_threads", "resources", "autoscaling"):
                if getattr(self, name) != default[name].default:
                    raise ValueError(f"{name}: a proposer with placement 'verifier' runs inside each verifier "
                                     f"replica, with its CPUs, threads and replicas; remove {name} or use "
                                     f"placement 'deployment'")
        return self

    @model_validator(mode="after")
    def _trees_are_drafted_by_models(self) -> "ProposerConfig":
        from proposers.registry import DRAFTS_TREES

        for name in ("tree", "dynamic_tree", "tree_budget"):
            if self.options.get(name) is not None and self.method not in DRAFTS_TREES:
                raise ValueError(f"options.{name}: token trees are drafted by the model proposers, draft and eagle, "
                                 f"only (method {self.method!r})")
        return self


class VerifierConfig(_Strict):
    """The verifier deployment (runs the engine)."""

    max_num_seqs: int = Field(8, ge=1, description="Sequences decoded together per replica (KV cache slots).")
    max_model_len: int = Field(2048, ge=16, description="Context length per sequence: prompt + output tokens.")
    max_waiting: int = Field(64, ge=0, description="Requests queued per replica before new ones get 429.")
    max_num_batched_tokens: int | None = Field(
        2048, ge=1, description="Tokens one verifier pass takes before drafts: one per decoding sequence, the rest "
        "prompt tokens (vLLM's max_num_batched_tokens). A prompt that does not fit is prefilled in chunks over "
        "several passes beside the running sequences' rounds, so a long prompt does not stall them. At least "
        "max_num_seqs; null = no limit (every admitted prompt whole in one pass).")
    proposer_deadline_ms: float = Field(100.0, gt=0, description="Per-round deadline of proposer calls; late = no drafts.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks one replica's target is split over (tensor parallelism: each holds a share of "
        "every layer's heads and MLP units, and of the KV cache): the replica and tensor_parallel_size - 1 worker "
        "processes it starts beside it. At most the model's key/value heads. On CPU, num_threads is split between them.")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads; null = every core of the machine on a CPU-only replica "
        "(Ray would otherwise cap it to resources.num_cpus), Ray's default on GPU replicas.")
    replicas: int = Field(1, ge=1, description="Replicas when autoscaling is not set.")
    resources: ResourcesConfig = Field(ResourcesConfig(num_cpus=1.0), description="Per-replica resources.")
    autoscaling: AutoscalingConfig | None = Field(None, description="Serve autoscaling; overrides replicas.")

    @model_validator(mode="after")
    def _batched_tokens_fit(self) -> "VerifierConfig":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): a pass of decoding sequences would leave no token for a prompt")
        return self

    @model_validator(mode="after")
    def _gpus_match_tp(self) -> "VerifierConfig":
        tp, gpus = self.tensor_parallel_size, self.resources.num_gpus
        if tp > 1 and gpus not in (0, tp):
            raise ValueError(f"tensor_parallel_size {tp} needs resources.num_gpus == {tp} (or 0: ranks on CPU), "
                             f"got {gpus}")
        return self


class ControllerConfig(_Strict):
    """How many draft tokens each sequence gets per round (`verifier/controller.py`)."""

    policy: Literal["off", "static", "batch_table", "goodput"] = Field(
        "goodput", description="'goodput' picks (method, k) per sequence per round to maximise tokens per second "
        "of verifier time; 'static' always asks for k; 'batch_table' takes k from the batch size; 'off' never "
        "speculates (a request's speculation.mode 'on' still does).")
    k: int = Field(4, ge=0, le=16, description="k of 'static', and of requests with speculation.mode 'on' and no max_k.")
    max_k: int = Field(8, ge=1, le=16, description="The most draft tokens 'goodput' gives a sequence in one round.")
    batch_table: dict[int, int] = Field(
        {1: 4, 8: 2, 32: 0}, description="'batch_table': {min batch size: k}; the row with the largest batch size "
        "not above the running batch applies. Must have a row for 1.")
    probe_interval: int = Field(8, ge=1, description="Rounds between cheap probes of an off sequence or unused method.")
    probe_k: int = Field(2, ge=1, le=16, description="Draft tokens of a probe.")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="Share by which an off sequence's acceptance is "
                              "discounted when deciding to turn it back on.")
    acceptance_ewma: float = Field(0.3, gt=0, le=1, description="Weight of the newest round in each sequence's "
                                   "per-position acceptance average.")
    costly_acceptance_ewma: float = Field(0.1, gt=0, le=1, description="The same for a method that is not cheap "
                                          "(a model proposer), which has no shadow drafts to come back by.")
    sequence_share: float = Field(0.5, ge=0, le=1, description="For a cheap method, the share of a sequence's "
                                  "departure from the method-wide acceptance that 'goodput' believes (1: all of it).")
    shadow: bool = Field(True, description="'goodput': a greedy sequence that is off keeps asking a cheap "
                         "proposer for drafts that are not verified but scored against the tokens it emits next, "
                         "so it comes back as soon as its acceptance does; unused methods are measured the same way.")
    shadow_latency_share: float = Field(0.25, ge=0, description="A method whose round trip is at most this share "
                                        "of a lone decode step is cheap: 'goodput' asks it for max_k and trims the "
                                        "drafts once they are in, and only cheap methods shadow-draft.")
    shadow_interval: int = Field(4, ge=1, description="Passes between calls of a method made for shadow drafts "
                                 "only (none verified that pass): such a call runs beside the pass but takes CPU "
                                 "from it where they share cores.")

    @field_validator("policy", mode="before")
    @classmethod
    def _unquoted_off(cls, policy: Any) -> Any:
        # YAML 1.1 reads a bare `policy: off` as the boolean false.
        return "off" if policy is False else policy

    @model_validator(mode="after")
    def _valid(self) -> "ControllerConfig":
        self.settings()  # the controller's own checks, e.g. batch_table
        return self

    def settings(self):
        """The `verifier.controller.ControllerSettings` these fields describe."""
        from verifier.controller import ControllerSettings

        return ControllerSettings(
            policy=self.policy, k=self.k, max_k=self.max_k, batch_table=tuple(sorted(self.batch_table.items())),
            probe_interval=self.probe_interval, probe_k=self.probe_k, hysteresis=self.hysteresis,
            acceptance_ewma=self.acceptance_ewma, costly_acceptance_ewma=self.costly_acceptance_ewma,
            sequence_share=self.sequence_share,
            shadow=self.shadow, shadow_latency_share=self.shadow_latency_share, shadow_interval=self.shadow_interval,
        )


class ApiConfig(_Strict):
    """Where the service listens."""

    host: str = Field("127.0.0.1", description="Bind address of the HTTP and gRPC ingress.")
    http_port: int = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port (0 = any free port).")
    grpc_port: int = Field(9000, ge=0, le=65535, description="gRPC Generate port (0 = any free port).")
    proposer_ports: tuple[int, int] | None = Field(
        None, description="[first, last] TCP ports proposer replicas bind their gRPC server to (the first free "
        "one), so a NetworkPolicy can admit only verifier pods to them; null = any free port.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus port of the local Ray node's metrics (`splitspec serve` "
        "starting a cluster; 0 = any free port, printed at start). On KubeRay every pod exports on 8080.")


    @field_validator("proposer_ports")
    @classmethod
    def _port_range(cls, ports: tuple[int, int] | None) -> tuple[int, int] | None:
        if ports is not None and not 1 <= ports[0] <= ports[1] <= 65535:
            raise ValueError(f"must be [first, last] with 1 <= first <= last <= 65535, got {list(ports)}")
        return ports


class TracingConfig(_Strict):
    """OpenTelemetry traces (`cluster/tracing.py`): one trace per request, from Serve's proxy
    through the ingress, the verifier's rounds and every proposer call."""

    exporter: Literal["none", "console", "otlp_http"] = Field(
        "none", description="'otlp_http' sends to an OTLP/HTTP collector (Jaeger, Tempo, the OpenTelemetry "
        "Collector); 'console' prints spans to each process's stdout (Ray's worker logs); 'none' is off.")
    endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces; null = the "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT environment variable, else http://localhost:4318/v1/traces.")
    sampling_ratio: float = Field(1.0, ge=0, le=1, description="Share of requests traced (parent-based: a "
                                  "request arriving with a sampled traceparent is always traced).")
    service_name: str = Field("splitspec", min_length=1, description="`service.name` of every span.")
    export_delay_ms: int = Field(2000, ge=1, description="How often the batch span processor exports.")

    @field_validator("endpoint")
    @classmethod
    def _url(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {endpoint!r}")
        return endpoint


class SplitspecConfig(_Strict):
    """A whole deployment."""

    model: TargetConfig = Field(TargetConfig(), description="The target model.")
    proposers: tuple[ProposerConfig, ...] = Field(
        (ProposerConfig(method="ngram"),), description="Proposers, each its own deployment unless placed in the verifier; empty = no speculation.")
    verifier: VerifierConfig = Field(VerifierConfig(), description="The verifier deployment.")
    controller: ControllerConfig = Field(ControllerConfig(), description="The speculation policy.")
    api: ApiConfig = Field(ApiConfig(), description="Ingress and metrics ports.")
    tracing: TracingConfig = Field(TracingConfig(), description="OpenTelemetry tracing.")

    @model_validator(mode="after")
    def _distinct(self) -> "SplitspecConfig":
        methods = [p.method for p in self.proposers]
        if len(set(methods)) != len(methods):
            raise ValueError(f"proposers: each method may appear once, got {methods}")
        from verifier.controller import fallback_problem

        problem = fallback_problem({p.method: p.fallback for p in self.proposers if p.fallback is not None}, methods)
        if problem is not None:
            raise ValueError(f"proposers: {problem}")
        if self.api.http_port and self.api.http_port == self.api.grpc_port:
            raise ValueError(f"api: http_port and grpc_port must differ, both are {self.api.http_port}")
        return self


def load_config(path: str | pathlib.Path | None = None) -> SplitspecConfig:
    """Read and validate a YAML config; None gives the defaults. Errors are `ConfigError`s
    whose message lists each bad field as a dotted path, e.g. `verifier.max_num_seqs`."""
    if path is None:
        return SplitspecConfig()
    p = pathlib.Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(p)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return SplitspecConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']} (given: {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ConfigError(f"{p}: {problems}") from exc
