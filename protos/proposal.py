"""The `ProposalSource` protocol: how the engine asks for draft tokens.

The same protocol is implemented by in-process proposers (injected by `cluster`) and by
the gRPC proposer client, so the engine never knows where drafts come from.

Delta contract (DESIGN.md, "Proposer RPC"): for each sequence the engine sends
`base_len` (how many leading context tokens the proposer may keep from its previous state
for this `seq_id`) and `append_token_ids` (the context tokens after `base_len`). The
proposer truncates its state to `base_len`, appends, and drafts at most `k` tokens that
continue the context. If it has fewer than `base_len` tokens for the sequence (unknown
`seq_id`, restart), it answers `resync=True`; the engine then sends the full context
(`base_len == 0`) next round and speculates 0 for that sequence this round.

Example: context so far `[5, 6, 7]` synced; a round commits `[8, 9]`; the next request is
`ProposalRequest(seq_id, base_len=3, append_token_ids=(8, 9), k=4, temperature=0.0)`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class ProposalRequest:
    """One sequence's share of a batched proposal call."""

    seq_id: str
    base_len: int
    # int32 [n_append]: context tokens after base_len (prompt tokens, then output tokens).
    append_token_ids: np.ndarray
    k: int
    temperature: float = 0.0
    # bfloat16 torch tensor [n, hidden], only for proposers that read the target's hidden
    # states (EAGLE): the target's final hidden states (the LM head's input) of the n
    # context positions before the last one, i.e. positions new_len - 1 - n .. new_len - 2
    # (new_len = base_len + len(append_token_ids)). In steady state n == len(append_token_ids);
    # with base_len 0 it is new_len - 1. The last token's state is computed by the round
    # being drafted for, so it arrives with the next round.
    hidden_states: object = None
    # W3C Trace Context of this sequence's proposer call ({"traceparent": ...}) when its
    # request is traced (`protos.trace_context`); empty otherwise.
    trace_context: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence.

    `draft_token_ids`: int32 [n], n <= k (n may be 0: nothing to propose).
    `draft_probs`: float32 [n, vocab] — the draft distribution q each token was sampled
    from — or None for a deterministic draft (treated as one-hot q by the verifier).
    `resync`: the proposer lacks `base_len` tokens of state; send the full context.
    `draft_parents`: int32 [n] or None. None: the drafts are a chain (draft i continues
    draft i - 1). Otherwise a token tree (its drafts count as one-hot q, `draft_probs`
    unread): `draft_parents[i]` is
    the index of draft i's parent (< i), or -1 for the last context token; the depth is at
    most k (n may exceed k) and siblings come in order of preference (the verifier reads
    the first child of each node as the chain when it needs one). Example: the top two
    candidates for the next token, each followed by its best continuation:
    `draft_token_ids [a, b, a2, b2]`, `draft_parents [-1, -1, 0, 1]`.
    `failed`: no answer came for this sequence this round (its replica erred or was late,
    `verifier.routing`): no drafts, and the request may not have reached the proposer, so
    the verifier keeps its delta's base where it was.
    """

    seq_id: str
    draft_token_ids: np.ndarray
    draft_probs: np.ndarray | None = None
    resync: bool = False
    draft_parents: np.ndarray | None = None
    failed: bool = False


@runtime_checkable
class ProposalSource(Protocol):
    """Anything that turns batched context deltas into draft tokens."""

    #: Short method name used in stats and metrics, e.g. "ngram".
    method: str

    async def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """Return one `Proposal` per request, in request order."""
        ...

    def release(self, seq_ids: Sequence[str]) -> None:
        """Forget the state of finished or aborted sequences (idempotent)."""
        ...


def hidden_states_to_proto(hidden, message) -> None:
    """Fill a `HiddenStates` message from a [n, hidden] tensor: bfloat16 bytes, little-endian."""
    import torch

    t = hidden.to(torch.bfloat16).contiguous()
    message.data = t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    message.shape[:] = list(t.shape)


def hidden_states_from_proto(message):
    """The bfloat16 tensor of a `HiddenStates` message, or None when it is empty.

    Raises `ValueError` when the bytes do not match the shape."""
    if not message.shape:  # before importing torch: an n-gram replica never needs it (~2 s)
        return None
    import torch

    shape = tuple(message.shape)
    if len(shape) != 2 or shape[0] * shape[1] * 2 != len(message.data):
        raise ValueError(f"hidden_states: {len(message.data)} bytes do not hold bfloat16 of shape {list(shape)}")
    raw = np.frombuffer(message.data, dtype="<i2").reshape(shape)
    return torch.from_numpy(raw.copy()).view(torch.bfloat16)
