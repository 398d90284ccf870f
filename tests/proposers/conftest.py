"""A draft trained in miniature by the real recipe, shared by the recipe tests."""

from __future__ import annotations

import pytest

from proposers import train

#: The draft recipe in miniature (~30 s): 8 prompts, 12-token answers, 4 steps.
TINY = train.TrainDraftConfig(
    init_layers=(0, 29), vocab_subset=600, num_prompts=6, num_docstring_prompts=1, num_function_prompts=1,
    max_answer_tokens=12, source_tokens=200, source_chunk=100, eval_sequences=2, steps=4, tokens_per_step=512,
    warmup_steps=2, checkpoint_every=2, eval_every=2, generate_batch=4, answer_cache=False,
)


@pytest.fixture(scope="session")
def tiny_draft(model, tokenizer, tmp_path_factory):
    """(directory, train_info) of the miniature draft; its corpus.pt is reused by EAGLE tests."""
    out = tmp_path_factory.mktemp("draft")
    info = train.train_draft(model, tokenizer, out, TINY, base="bundled", command="splitspec train draft (test)",
                             log=lambda *a: None)
    return out, info
