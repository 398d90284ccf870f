"""Tracing wiring: Ray Serve's own OpenTelemetry tracing, with our exporter.

Serve traces each request from its proxy (HTTP or gRPC, continuing an incoming W3C
`traceparent`) into the replicas it calls, and asks an *exporter function* (its
`tracing_config.exporter_import_path`, no arguments) for the span processors of every
process it traces. `span_processors` is that function: one `BatchSpanProcessor` (never a
synchronous one) around the exporter the YAML's `tracing` section names. The section
reaches every Ray process as the `SPLITSPEC_TRACING` environment variable (JSON), set by
`splitspec serve` or by the pod templates on Kubernetes (`splitspec k8s render --patch`).

The spans of one request, each the parent of the next:

    proxy_http_request / proxy_grpc_request      Serve's proxy
      replica_handle_request Ingress ...         Serve, in the ingress replica
        splitspec.ingress                        cluster/ingress.py
          splitspec.request                      verifier/engine.py (W3C context in GenerateInput)
            splitspec.round                      one per verifier pass the request takes part in
              splitspec.proposer_rpc             one per proposer call (client)
                splitspec.propose                proposers/server.py (W3C context in SequenceDelta)
"""

from __future__ import annotations

import os

from cluster.config import TracingConfig

#: Environment variable holding the `tracing` section as JSON in every Ray process.
ENV = "SPLITSPEC_TRACING"
#: Serve's `exporter_import_path` for `span_processors`.
EXPORTER_IMPORT_PATH = "cluster.tracing:span_processors"


def tracing_env(config: TracingConfig) -> dict[str, str]:
    """Environment variables every Ray process needs for `config` (empty when tracing is off).

    Serve's proxies read their tracing settings only from Serve's own variables (Ray 2.60
    does not hand them `tracing_config`), so those are set too."""
    if config.exporter == "none":
        return {}
    return {
        ENV: config.model_dump_json(),
        "OTEL_SERVICE_NAME": config.service_name,
        "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH": EXPORTER_IMPORT_PATH,
        "RAY_SERVE_TRACING_SAMPLING_RATIO": repr(config.sampling_ratio),
    }


def serve_tracing_config(config: TracingConfig) -> dict | None:
    """Serve's `tracing_config` (`serve.start` or `serveConfigV2`) for `config`; None when off."""
    if config.exporter == "none":
        return None
    return {"enabled": True, "exporter_import_path": EXPORTER_IMPORT_PATH, "sampling_ratio": config.sampling_ratio}


def make_exporter(config: TracingConfig):
    """The span exporter `config` names."""
    if config.exporter == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.endpoint)  # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or localhost
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    raise ValueError(f"tracing.exporter {config.exporter!r} exports nothing")


def span_processors() -> list:
    """Serve's exporter function: [BatchSpanProcessor(the configured exporter)]."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    raw = os.environ.get(ENV)
    # Tracing enabled in Serve without our variable (e.g. a hand-written serveConfigV2):
    # OTLP/HTTP to the endpoint of the standard OTEL_* variables.
    config = TracingConfig.model_validate_json(raw) if raw else TracingConfig(exporter="otlp_http")
    return [BatchSpanProcessor(make_exporter(config), schedule_delay_millis=config.export_delay_ms)]
