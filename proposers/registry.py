"""Proposal methods by name: one registry instead of `if method == ...` chains."""

from __future__ import annotations

from typing import Any, Callable

from protos.proposal import ProposalSource
from proposers.ngram import NgramConfig, NgramProposer


def _ngram(options: dict[str, Any]) -> ProposalSource:
    return NgramProposer(NgramConfig(**options))


def _draft(options: dict[str, Any]) -> ProposalSource:
    """Options: `path` (GGUF file or HF directory; default the bundled model), `tokenizer`
    (a directory, else the model's own), `dtype`, `layers` (run only these layer indices,
    e.g. for a self-speculative draft of the target), and the fields of `DraftModelConfig`."""
    from proposers.draft_model import DraftModelConfig, DraftModelProposer, with_layers
    from verifier.models.loader import load_model_and_tokenizer
    from verifier.models.vocab import VocabFingerprint

    options = dict(options)
    path, tokenizer_dir = options.pop("path", None), options.pop("tokenizer", None)
    dtype, layers = options.pop("dtype", "float32"), options.pop("layers", None)
    config = DraftModelConfig(**options)
    model, tokenizer = load_model_and_tokenizer(path, tokenizer_dir, dtype)
    if layers is not None:
        model = with_layers(model, [int(i) for i in layers])
    return DraftModelProposer(model, VocabFingerprint.of(tokenizer), config)


#: method name -> factory(options) building an in-process ProposalSource.
PROPOSERS: dict[str, Callable[[dict[str, Any]], ProposalSource]] = {"ngram": _ngram, "draft": _draft}


def build_proposer(method: str, options: dict[str, Any] | None = None) -> ProposalSource:
    """Build a registered proposer; unknown names raise `ValueError` listing the known ones."""
    try:
        factory = PROPOSERS[method]
    except KeyError:
        raise ValueError(f"unknown speculation method {method!r}; known: {sorted(PROPOSERS)}") from None
    return factory(dict(options or {}))
