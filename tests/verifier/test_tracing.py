"""Traces of the verifier and a proposer over real gRPC, caught by an in-memory exporter.

Two requests run concurrently through `VerifierServer` and the real engine, with the
n-gram proposer behind a real grpc.aio server on loopback. Each request arrives under its
own caller span (as the ingress sends it: W3C context in `GenerateInput.trace_context`).
Spans go through a `BatchSpanProcessor` (the only processor the service uses) into an
`InMemorySpanExporter`. Expected structure, per request, counted from the engine's own
per-request stats:

    caller -> splitspec.request -> splitspec.round x (rounds + 1 prefill)
                                     -> splitspec.proposer_rpc (client) -> splitspec.propose (server)
"""

from __future__ import annotations

import asyncio
import collections

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

from cluster.workloads import load_prompts
from protos import trace_context
from proposers.ngram import NgramProposer
from proposers.server import ProposerServicer, start_server
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.proposer_client import GrpcProposalSource
from verifier.server import GenerateInput, VerifierServer


class _Switch(Sampler):
    """Samples while `on`: the global provider stays installed after this module (OpenTelemetry
    allows one per process), so it is switched off to leave other tests untraced."""

    on = True

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None):
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "switch"


@pytest.fixture(scope="module")
def exporter():
    sampler = _Switch()
    provider = TracerProvider(sampler=sampler)
    memory = InMemorySpanExporter()
    provider.add_span_processor(BatchSpanProcessor(memory, schedule_delay_millis=50))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another tracer provider was installed in this process first")
    yield memory, provider
    sampler.on = False
    provider.force_flush()


def test_one_trace_per_request_with_rounds_and_proposer_calls(model, tokenizer, exporter):
    memory, provider = exporter
    prompts = load_prompts("code_edit", tokenizer)[:2]  # quote their input: n-gram drafts
    caller = trace.get_tracer("test.caller")

    async def run():
        server, port = await start_server(ProposerServicer(NgramProposer(), max_k=8))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="ngram", deadline_s=1.0)
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=512), {"ngram": client},
                        Controller.static(4))
        verifier = VerifierServer(engine, "m")

        async def one(i: int, prompt: list[int]):
            with caller.start_as_current_span(f"caller-{i}") as span:
                inp = GenerateInput(request_id=f"r{i}", prompt_token_ids=tuple(prompt), max_tokens=24,
                                    temperature=0.0, trace_context=tuple(trace_context.inject(span).items()))
                events = [e async for e in verifier.generate(inp)]
            assert events[-1]["event"] == "final", events[-1]
            return span.get_span_context().trace_id, events[-1]["speculation"]

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await client.close()
            await server.stop(0)

    results = asyncio.run(run())
    assert provider.force_flush(10_000)
    spans = memory.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    by_trace = collections.defaultdict(list)
    for s in spans:
        by_trace[s.context.trace_id].append(s)
    assert set(by_trace) == {trace_id for trace_id, _ in results}, "a span outside the two requests' traces"

    def parent(s):
        assert s.parent is not None, f"{s.name} has no parent"
        p = by_id.get(s.parent.span_id)
        assert p is not None, f"{s.name}'s parent is not among the exported spans"
        assert p.context.trace_id == s.context.trace_id
        return p

    for trace_id, stats in results:
        named = collections.defaultdict(list)
        for s in by_trace[trace_id]:
            named[s.name].append(s)
        (root,) = [s for s in by_trace[trace_id] if s.parent is None]
        assert root.name.startswith("caller-")
        (request,) = named["splitspec.request"]
        assert parent(request) is root
        rounds = named["splitspec.round"]
        assert len(rounds) == stats["rounds"] + 1  # the prefill pass is a round too
        assert all(parent(r) is request for r in rounds)
        assert sum(1 for r in rounds if r.attributes["splitspec.prefill"]) == 1
        assert sum(r.attributes["splitspec.num_accepted"] for r in rounds) == stats["accepted"]
        assert sum(r.attributes["splitspec.k"] for r in rounds) == stats["drafted"] > 0
        rpcs = named["splitspec.proposer_rpc"]
        # A static k = 4 asks the proposer every round but the last ones, where at most one
        # token is left to emit; every drafting round had a call.
        assert stats["rounds_with_drafts"] <= len(rpcs) <= stats["rounds"]
        assert all(parent(c).name == "splitspec.round" and c.kind is trace.SpanKind.CLIENT for c in rpcs)
        served = named["splitspec.propose"]
        assert len(served) == len(rpcs), "every proposer call continues its trace on the proposer"
        assert sorted(parent(s).context.span_id for s in served) == sorted(c.context.span_id for c in rpcs)
        assert all(s.kind is trace.SpanKind.SERVER and s.attributes["splitspec.method"] == "ngram" for s in served)
        assert request.attributes["splitspec.accepted"] == stats["accepted"]
