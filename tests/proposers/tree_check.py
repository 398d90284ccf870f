"""Shared by the draft model's and the EAGLE head's tree tests."""

from __future__ import annotations

from typing import Any, Callable

from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.sampling_params import SamplingParams

#: Chains, fixed widths (3, 2, 1) and dynamic trees of 4 nodes a depth, at k = 3.
SHAPES: tuple[dict[str, Any], ...] = ({}, {"tree": (3, 2, 1)}, {"dynamic_tree": 4})


def trees_are_exact_and_accept_more(model, tokenizer, prompts, method: str,
                                    make: Callable[[dict[str, Any]], object]) -> dict[str, float]:
    """Verify `make(shape)`'s drafts with the engine at static k = 3 for each of `SHAPES`:
    greedy output identical to plain decoding, and more drafts accepted per round with
    either tree than with chains (a (3, 2, 1) tree holds the chain: its first children).
    Returns accepted drafts per round by shape."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    config = EngineConfig(max_num_seqs=5, max_model_len=1024)
    want = [r.token_ids for r in Engine(model, tokenizer, config, None, Controller.off()).generate_sync(prompts, params)]
    accepted = {}
    for shape in SHAPES:
        engine = Engine(model, tokenizer, config, {method: make(shape)}, Controller.static(3, (method,)))
        results = engine.generate_sync(prompts, params)
        assert [r.token_ids for r in results] == want, f"{shape=}"
        accepted[str(shape)] = (sum(r.stats.accepted for r in results)
                                / sum(r.stats.rounds_with_drafts for r in results))
    chain, fixed, dynamic = (accepted[str(s)] for s in SHAPES)
    assert min(fixed, dynamic) > chain > 0, accepted
    return accepted
