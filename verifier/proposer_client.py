"""`ProposalSource` over gRPC: the verifier's side of one `splitspec.v1.Proposer` stream.

Each `propose` call is one round: one ProposeRequest carrying every sequence's delta,
one ProposeResponse back, within `deadline_s`. Any failure — deadline passed, server
gone, stream broken — raises `ProposerUnavailableError`, which the engine treats as
k = 0 for the round (fail open), and drops the stream so the next round opens a fresh
one. A missed deadline raises the subclass `ProposerLateError` (the replica may only be
slow this round; see `verifier.routing`). The proposer's per-sequence state lives in the
server, not in the stream, so a new stream continues where the old one stopped; a
restarted server answers `resync`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc
import numpy as np

from protos.proposal import Proposal, ProposalRequest, hidden_states_to_proto
from protos.splitspec.v1 import proposer_pb2, proposer_pb2_grpc
from verifier.errors import SplitspecError

logger = logging.getLogger(__name__)


class ProposerUnavailableError(SplitspecError):
    """The proposer did not answer this round in time, or at all."""


class ProposerLateError(ProposerUnavailableError):
    """The proposer did not answer this round within the deadline."""


class GrpcProposalSource:
    def __init__(self, address: str, method: str = "remote", deadline_s: float = 0.1,
                 needs_hidden_states: bool = False, hidden_state_layers: Sequence[int] | None = None) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.address = address
        self.method = method
        #: Whether the engine should attach hidden states to this source's requests (EAGLE).
        self.needs_hidden_states = needs_hidden_states
        #: Which (`Info.hidden_state_layers`): None for the final states, else target layers.
        self.hidden_state_layers = tuple(hidden_state_layers) if hidden_state_layers else None
        self.deadline_s = deadline_s
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._round_id = 0
        self._released: list[str] = []

    def _stub(self) -> proposer_pb2_grpc.ProposerStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        return proposer_pb2_grpc.ProposerStub(self._channel)

    async def info(self, timeout_s: float = 5.0) -> proposer_pb2.InfoResponse:
        return await self._stub().Info(proposer_pb2.InfoRequest(), timeout=timeout_s)

    async def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        loop = asyncio.get_running_loop()
        self._round_id += 1
        message = proposer_pb2.ProposeRequest(
            round_id=self._round_id,
            sequences=[_delta(r) for r in requests],
            released_seq_ids=self._released,
        )
        released, self._released = self._released, []
        try:
            # asyncio.timeout, not wait_for: no extra task per await on the per-round path.
            async with asyncio.timeout_at(loop.time() + self.deadline_s):
                if self._call is None:
                    self._call = self._stub().Propose()
                await self._call.write(message)
                while True:
                    response = await self._call.read()
                    if response is grpc.aio.EOF:
                        raise ConnectionError("the proposer closed the stream")
                    if response.round_id == self._round_id:
                        break  # older round ids are late answers of rounds that timed out
        except (asyncio.TimeoutError, asyncio.InvalidStateError, grpc.RpcError, ConnectionError, ValueError) as exc:
            self._released = released + self._released  # not delivered: send again
            self._drop_stream()
            if isinstance(exc, asyncio.TimeoutError):
                raise ProposerLateError(f"proposer {self.method} at {self.address} missed the round's "
                                        f"{self.deadline_s * 1000:.0f} ms deadline") from exc
            raise ProposerUnavailableError(f"proposer {self.method} at {self.address}: {exc!r}") from exc
        return _to_proposals(requests, response)

    def release(self, seq_ids: Sequence[str]) -> None:
        """Forget finished sequences; sent with the next round."""
        self._released.extend(seq_ids)

    @property
    def has_pending_releases(self) -> bool:
        return bool(self._released)

    def _drop_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self._drop_stream()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _delta(r: ProposalRequest) -> proposer_pb2.SequenceDelta:
    delta = proposer_pb2.SequenceDelta(
        seq_id=r.seq_id, base_len=r.base_len, append_token_ids=np.asarray(r.append_token_ids).tolist(),
        k=r.k, temperature=r.temperature, trace_context=r.trace_context,
    )
    if r.hidden_states is not None:
        hidden_states_to_proto(r.hidden_states, delta.hidden_states)
    return delta


def _to_proposals(requests: Sequence[ProposalRequest], response: proposer_pb2.ProposeResponse) -> list[Proposal]:
    by_id = {d.seq_id: d for d in response.sequences}
    proposals = []
    for r in requests:
        d = by_id.get(r.seq_id)
        if d is None:  # an answer without this sequence: nothing to verify this round
            proposals.append(Proposal(r.seq_id, np.zeros(0, np.int32)))
            continue
        drafts = np.fromiter(d.draft_token_ids, np.int32, len(d.draft_token_ids))
        probs = None
        if d.draft_probs:
            probs = np.frombuffer(d.draft_probs, dtype="<f4").reshape(drafts.size, d.vocab_size)
        elif d.draft_probs_token_ids:
            ids = np.fromiter(d.draft_probs_token_ids, np.int64, len(d.draft_probs_token_ids)).reshape(drafts.size, -1)
            probs = np.zeros((drafts.size, d.vocab_size), np.float32)
            np.put_along_axis(probs, ids, np.frombuffer(d.draft_probs_values, dtype="<f4").reshape(ids.shape), axis=-1)
        parents = np.fromiter(d.draft_parents, np.int32, len(d.draft_parents)) if d.draft_parents else None
        proposals.append(Proposal(r.seq_id, drafts, probs, d.resync, parents))
    return proposals
