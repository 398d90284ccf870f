"""The engine's spans. OpenTelemetry API only: without an installed tracer provider every
span is non-recording and the engine keeps none (`start_request` returns None).

Per traced request (W3C context from the caller, `protos.trace_context`):

    splitspec.request            arrival to finish: prompt and output tokens, drafted, accepted
      splitspec.round            one per verifier pass the request takes part in (prefill too)
        splitspec.proposer_rpc   one per proposer call (client side); its context goes to the
                                 proposer in the request's `trace_context`
"""

from __future__ import annotations

from typing import Mapping

from opentelemetry import trace

from protos import trace_context
from verifier.sequence import FinishReason, SequenceStats

tracer = trace.get_tracer("splitspec.verifier")


def start_request(request_id: str, num_prompt_tokens: int, max_tokens: int, mode: str,
                  carrier: Mapping[str, str] | None):
    """The request's span, under `carrier`'s context (else the current one); None when untraced."""
    span = tracer.start_span("splitspec.request", context=trace_context.extract(carrier), attributes={
        "splitspec.request_id": request_id, "splitspec.num_prompt_tokens": num_prompt_tokens,
        "splitspec.max_tokens": max_tokens, "splitspec.speculation_mode": mode})
    return span if span.is_recording() else None


def start_round(request_span, prefill: bool):
    """A round's span under the request's, or None when the request is untraced."""
    if request_span is None:
        return None
    return tracer.start_span("splitspec.round", context=trace.set_span_in_context(request_span),
                             attributes={"splitspec.prefill": prefill})


def start_proposer_call(round_span, method: str, k: int) -> tuple[object, dict[str, str]]:
    """(the proposer call's client span, its W3C carrier for the proposer); (None, {}) untraced."""
    if round_span is None:
        return None, {}
    span = tracer.start_span("splitspec.proposer_rpc", context=trace.set_span_in_context(round_span),
                             kind=trace.SpanKind.CLIENT, attributes={"splitspec.method": method, "splitspec.k": k})
    return span, trace_context.inject(span)


def end_proposer_call(span, num_drafts: int, outcome: str) -> None:
    span.set_attributes({"splitspec.num_drafts": num_drafts, "splitspec.outcome": outcome})
    span.end()


def end_round(span, method: str | None, k: int, num_accepted: int, reason: str, num_emitted: int) -> None:
    span.set_attributes({"splitspec.method": method or "", "splitspec.k": k, "splitspec.num_accepted": num_accepted,
                         "splitspec.reason": reason, "splitspec.num_emitted": num_emitted})
    span.end()


def end_request(span, stats: SequenceStats, reason: FinishReason) -> None:
    span.set_attributes({
        "splitspec.finish_reason": reason.value, "splitspec.num_output_tokens": stats.num_output_tokens,
        "splitspec.rounds": stats.rounds, "splitspec.drafted": stats.drafted, "splitspec.accepted": stats.accepted,
        "splitspec.mean_acceptance_length": stats.mean_acceptance_length})
    span.end()
