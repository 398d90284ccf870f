"""W3C Trace Context on the proposer wire (`SequenceDelta.trace_context`).

The verifier opens one span per sequence per proposer call and puts its context in the
delta (`inject`); the proposer server continues the trace from it (`extract`). Both use
OpenTelemetry's W3C propagator explicitly, whatever global propagator a process set, so
the two ends always agree: {"traceparent": "00-<trace id>-<span id>-<flags>"}.

With no tracer provider installed (tracing off) spans are non-recording and nothing is
injected, so untraced requests send an empty map.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_W3C = TraceContextTextMapPropagator()


def inject(span: trace.Span) -> dict[str, str]:
    """The W3C carrier of `span`, or {} when it is not recording."""
    if not span.is_recording():
        return {}
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, trace.set_span_in_context(span))
    return carrier


def extract(carrier) -> otel_context.Context | None:
    """The context a W3C carrier (a dict or a protobuf map) continues, or None when empty."""
    if not carrier:
        return None
    return _W3C.extract(dict(carrier))
