"""gRPC proposer server: hosts any `ProposalSource` behind `splitspec.v1.Proposer`.

A thin shell: protobuf in, `ProposalRequest`s to the source, protobuf out. One Propose
stream per verifier replica; each message is one round for a batch of sequences.
`grpc.health.v1` reports SERVING once the server is up.
"""

from __future__ import annotations

import logging
import time
from importlib import metadata

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace

from protos import trace_context
from protos.proposal import Proposal, ProposalRequest, ProposalSource, hidden_states_from_proto
from protos.splitspec.v1 import proposer_pb2, proposer_pb2_grpc

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("splitspec.proposer")

SERVICE_NAME = "splitspec.v1.Proposer"


def _version() -> str:
    try:
        return metadata.version("splitspec")
    except metadata.PackageNotFoundError:
        return "unknown"


class ProposerServicer(proposer_pb2_grpc.ProposerServicer):
    def __init__(self, source: ProposalSource, max_k: int, needs_hidden_states: bool = False,
                 tokenizer: proposer_pb2.TokenizerFingerprint | None = None, idle_ttl_s: float = 600.0) -> None:
        self._source = source
        # Sequences no round mentioned for idle_ttl_s are dropped: their verifier died
        # without releasing them (a live one releases every finished sequence).
        self._idle_ttl_s = idle_ttl_s
        self._last_seen: dict[str, float] = {}
        self._next_sweep = time.monotonic() + idle_ttl_s
        vocab = getattr(source, "vocab", None)  # model proposers draft in a vocabulary
        if tokenizer is None and vocab is not None:
            tokenizer = vocab.to_proto()
        self.info = proposer_pb2.InfoResponse(
            method=source.method, max_k=max_k,
            needs_hidden_states=needs_hidden_states or bool(getattr(source, "needs_hidden_states", False)),
            tokenizer=tokenizer, server_version=_version(),
            hidden_state_layers=getattr(source, "hidden_state_layers", None) or (),
        )

    async def Info(self, request: proposer_pb2.InfoRequest, context) -> proposer_pb2.InfoResponse:
        return self.info

    async def Propose(self, request_iterator, context):
        async for message in request_iterator:
            now = time.monotonic()
            if message.released_seq_ids:
                self._source.release(list(message.released_seq_ids))
                for seq_id in message.released_seq_ids:
                    self._last_seen.pop(seq_id, None)
            for s in message.sequences:
                self._last_seen[s.seq_id] = now
            if now >= self._next_sweep:
                self._sweep(now)
            # One server span per traced sequence, continuing the verifier's proposer-call span.
            spans = {s.seq_id: tracer.start_span("splitspec.propose", context=parent, kind=trace.SpanKind.SERVER,
                                                 attributes={"splitspec.method": self.info.method,
                                                             "splitspec.k": s.k, "splitspec.base_len": s.base_len})
                     for s in message.sequences if (parent := trace_context.extract(s.trace_context)) is not None}
            try:
                requests = [
                    ProposalRequest(
                        seq_id=s.seq_id,
                        base_len=s.base_len,
                        append_token_ids=np.fromiter(s.append_token_ids, np.int32, len(s.append_token_ids)),
                        k=s.k,
                        temperature=s.temperature,
                        hidden_states=hidden_states_from_proto(s.hidden_states),
                    )
                    for s in message.sequences
                ]
                proposals = await self._source.propose(requests)
            except ValueError as exc:
                # A malformed delta: drop those sequences' state and ask for the full
                # context (resync), keeping the stream and the other verifiers' rounds.
                logger.warning("proposer %s: bad round %d: %s", self.info.method, message.round_id, exc)
                seq_ids = [s.seq_id for s in message.sequences]
                self._source.release(seq_ids)
                proposals = [Proposal(seq_id, np.zeros(0, np.int32), resync=True) for seq_id in seq_ids]
            drafts = [_draft_message(p) for p in proposals]
            for p in proposals:
                span = spans.get(p.seq_id)
                if span is not None:
                    span.set_attributes({"splitspec.num_drafts": len(p.draft_token_ids), "splitspec.resync": p.resync})
                    span.end()
            yield proposer_pb2.ProposeResponse(round_id=message.round_id, sequences=drafts)


    def _sweep(self, now: float) -> None:
        stale = [seq_id for seq_id, seen in self._last_seen.items() if now - seen > self._idle_ttl_s]
        if stale:
            logger.info("proposer %s: dropping %d sequences idle for %.0f s", self.info.method, len(stale), self._idle_ttl_s)
            self._source.release(stale)
            for seq_id in stale:
                del self._last_seen[seq_id]
        self._next_sweep = now + min(self._idle_ttl_s, 10.0)


def _draft_message(p: Proposal) -> proposer_pb2.SequenceDraft:
    message = proposer_pb2.SequenceDraft(
        seq_id=p.seq_id, draft_token_ids=np.asarray(p.draft_token_ids, dtype=np.int32).tolist(), resync=p.resync)
    if p.draft_parents is not None:
        message.draft_parents.extend(np.asarray(p.draft_parents, dtype=np.int32).tolist())
    if p.draft_probs is None:
        return message
    probs = np.asarray(p.draft_probs, dtype="<f4")
    message.vocab_size = probs.shape[-1]
    width = int((probs > 0).sum(axis=-1).max(initial=0))
    if 2 * width < probs.shape[-1]:  # sparse: ids + values, a few KB instead of 4 bytes x vocab per draft
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :width]
        message.draft_probs_token_ids.extend(ids.astype(np.int32).ravel().tolist())
        message.draft_probs_values = np.take_along_axis(probs, ids, axis=-1).tobytes()
    else:
        message.draft_probs = probs.tobytes()
    return message


async def start_server(servicer: ProposerServicer, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on host:port (0 = a free port); return it and the bound port."""
    # No SO_REUSEPORT: a second replica on the node must not share (and split) a bound port.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    proposer_pb2_grpc.add_ProposerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind a proposer server to {host}:{port}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("proposer %s serving on %s:%d", servicer.info.method, host, bound)
    return server, bound
