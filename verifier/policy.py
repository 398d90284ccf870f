"""Speculation policies: how many draft tokens (k) each running sequence gets this round.

The engine clamps whatever a policy returns to the sequence's own limits (its request's
`max_k`, the tokens it may still emit, the proposer's availability), so a policy only
expresses intent. The adaptive controller implements the same `plan` signature.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class SequenceView:
    """What a policy may look at for one running sequence."""

    seq_id: str
    num_context_tokens: int
    num_output_tokens: int
    # The request's own cap on k (None: no cap); 0 turns speculation off for it.
    max_k: int | None


class SpeculationPolicy(Protocol):
    name: str

    def plan(self, seqs: Sequence[SequenceView]) -> list[int]:
        """Return k >= 0 for each sequence, in order."""
        ...


@dataclasses.dataclass(frozen=True)
class OffPolicy:
    """Never speculate: every round is one plain decode step per sequence."""

    name: str = "off"

    def plan(self, seqs: Sequence[SequenceView]) -> list[int]:
        return [0] * len(seqs)


@dataclasses.dataclass(frozen=True)
class StaticPolicy:
    """Always ask for `k` draft tokens (vLLM's `num_speculative_tokens`)."""

    k: int
    name: str = "static"

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"StaticPolicy.k must be >= 0, got {self.k}")

    def plan(self, seqs: Sequence[SequenceView]) -> list[int]:
        return [self.k] * len(seqs)
