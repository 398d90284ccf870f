"""Proposal methods by name: one registry instead of `if method == ...` chains."""

from __future__ import annotations

from typing import Any, Callable

from protos.proposal import ProposalSource
from proposers.ngram import NgramConfig, NgramProposer


def _ngram(options: dict[str, Any]) -> ProposalSource:
    return NgramProposer(NgramConfig(**options))


#: method name -> factory(options) building an in-process ProposalSource.
PROPOSERS: dict[str, Callable[[dict[str, Any]], ProposalSource]] = {"ngram": _ngram}


def build_proposer(method: str, options: dict[str, Any] | None = None) -> ProposalSource:
    """Build a registered proposer; unknown names raise `ValueError` listing the known ones."""
    try:
        factory = PROPOSERS[method]
    except KeyError:
        raise ValueError(f"unknown speculation method {method!r}; known: {sorted(PROPOSERS)}") from None
    return factory(dict(options or {}))
