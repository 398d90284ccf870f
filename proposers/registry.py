"""Proposal methods by name: one registry instead of `if method == ...` chains."""

from __future__ import annotations

import pathlib
from typing import Any, Callable

from protos.proposal import ProposalSource
from proposers.ngram import NgramConfig, NgramProposer

#: The project's root: a relative proposer `path` not found from the working directory is
#: looked up here, so `proposers/assets/...` names a committed asset wherever a replica runs.
PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent


def resolve_path(path: str | pathlib.Path | None) -> pathlib.Path | None:
    """A configured file or directory: a leading ~ expanded; a relative path that does not
    exist from the working directory but does from `PROJECT_ROOT` is taken from there."""
    if path is None:
        return None
    path = pathlib.Path(path).expanduser()
    if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
        return PROJECT_ROOT / path
    return path


def _ngram(options: dict[str, Any]) -> ProposalSource:
    return NgramProposer(NgramConfig(**options))


def _draft(options: dict[str, Any]) -> ProposalSource:
    """Options: `path` (a directory written by `splitspec train draft`, a GGUF file or an
    HF directory; default the draft trained for the bundled model, committed under
    `proposers/assets/`), `base` (the target whose embeddings a trained draft uses; default
    the bundled model), `tokenizer` (a directory, else the model's own), `dtype`, `layers`
    (run only these layer indices of a plain model, e.g. a self-speculative draft of the
    target), `vocab_subset` (a plain model's LM head cut to its N most frequent tokens,
    `ranked_vocabulary`; a trained draft has its own), and the fields of `DraftModelConfig`."""
    import torch

    from proposers.draft_model import (DraftModelConfig, DraftModelProposer, is_trained_draft, load_trained_draft,
                                       ranked_vocabulary, with_layers, with_vocab_subset)
    from proposers.train import BUNDLED_DRAFT_DIR
    from verifier.errors import ModelLoadError
    from verifier.models.loader import DTYPES, load_model_and_tokenizer
    from verifier.models.vocab import VocabFingerprint

    options = dict(options)
    path, base = resolve_path(options.pop("path", None)), options.pop("base", None)
    tokenizer_dir = options.pop("tokenizer", None)
    dtype, layers = options.pop("dtype", "float32"), options.pop("layers", None)
    subset = options.pop("vocab_subset", None)
    if subset is not None and (isinstance(subset, bool) or not isinstance(subset, int) or subset < 1):
        raise ValueError(f"vocab_subset must be a number of tokens >= 1, got {subset!r}")
    config = DraftModelConfig(**options)
    if path is None:
        if not is_trained_draft(BUNDLED_DRAFT_DIR):
            raise ModelLoadError(f"no trained draft in {BUNDLED_DRAFT_DIR}: run `splitspec train draft`, "
                                 f"or set the draft proposer's `path`")
        path = BUNDLED_DRAFT_DIR
    if is_trained_draft(path):
        if layers is not None or subset is not None:
            raise ValueError("options `layers` and `vocab_subset` apply to a plain model, not to a trained draft "
                             "(whose LM head already covers a subset)")
        target, tokenizer = load_model_and_tokenizer(base, tokenizer_dir, "float32")
        vocab = VocabFingerprint.of(tokenizer)
        model, token_map = load_trained_draft(path, target, vocab, DTYPES.get(dtype, torch.float32))
        return DraftModelProposer(model, vocab, config, token_map=token_map)
    model, tokenizer = load_model_and_tokenizer(str(path), tokenizer_dir, dtype)
    if layers is not None:
        model = with_layers(model, [int(i) for i in layers])
    token_map = None
    if subset is not None and subset < model.lm_head.shape[0]:
        token_map = ranked_vocabulary(tokenizer, subset)
        model = with_vocab_subset(model, token_map)
    return DraftModelProposer(model, VocabFingerprint.of(tokenizer), config, token_map=token_map)


def _eagle(options: dict[str, Any]) -> ProposalSource:
    """Options: `path` (an EAGLE head directory: config.json + *.safetensors, the published
    EAGLE-1 or EAGLE-3 layout or one written by `splitspec train eagle`; default the EAGLE-3
    head trained for the bundled model, committed under `proposers/assets/`, which drafts
    better than the EAGLE-1 head beside it at the same cost), `base` (the target; default the
    bundled model), `tokenizer`, `dtype`, and the fields of `DraftModelConfig`."""
    import torch

    from proposers.draft_model import DraftModelConfig
    from proposers.eagle import EagleProposer, load_eagle
    from proposers.train import DEFAULT_EAGLE_DIR
    from verifier.errors import ModelLoadError
    from verifier.models.loader import DTYPES, load_model_and_tokenizer
    from verifier.models.vocab import VocabFingerprint

    options = dict(options)
    path, base = resolve_path(options.pop("path", None)), options.pop("base", None)
    tokenizer_dir, dtype = options.pop("tokenizer", None), options.pop("dtype", "float32")
    config = DraftModelConfig(**options)
    if path is None:
        if not (DEFAULT_EAGLE_DIR / "config.json").is_file():
            raise ModelLoadError(f"no trained EAGLE head in {DEFAULT_EAGLE_DIR}: run `splitspec train eagle "
                                 f"--arch eagle3`, or set the eagle proposer's `path`")
        path = DEFAULT_EAGLE_DIR
    target, tokenizer = load_model_and_tokenizer(base, tokenizer_dir, "float32")
    vocab = VocabFingerprint.of(tokenizer)
    return EagleProposer(load_eagle(path, target, vocab, DTYPES.get(dtype, torch.float32)), vocab, config)


#: method name -> factory(options) building an in-process ProposalSource.
PROPOSERS: dict[str, Callable[[dict[str, Any]], ProposalSource]] = {"ngram": _ngram, "draft": _draft, "eagle": _eagle}
#: Methods whose proposers read the target's hidden states (sent in the proposer stream).
NEEDS_HIDDEN_STATES = frozenset({"eagle"})


def hidden_state_layers(method: str, options: dict[str, Any] | None, target_layers: int) -> tuple[int, ...] | None:
    """Which target states a configured proposer reads (`Info.hidden_state_layers`): None
    for the final ones or for a method that reads none; an EAGLE-3 head's layers."""
    from proposers.eagle import head_hidden_state_layers
    from proposers.train import DEFAULT_EAGLE_DIR

    if method != "eagle":
        return None
    path = resolve_path((options or {}).get("path")) or DEFAULT_EAGLE_DIR
    return head_hidden_state_layers(path, target_layers)
#: Methods whose proposers draft token trees (option `tree`, `DraftModelConfig.tree`).
DRAFTS_TREES = frozenset({"draft", "eagle"})

#: Speculation method that means "no proposer".
OFF = "off"


def build_proposer(method: str, options: dict[str, Any] | None = None) -> ProposalSource:
    """Build a registered proposer; unknown names raise `ValueError` listing the known ones."""
    try:
        factory = PROPOSERS[method]
    except KeyError:
        raise ValueError(f"unknown speculation method {method!r}; known: {sorted(PROPOSERS)}") from None
    return factory(dict(options or {}))
