"""Penalties, logit bias, min_tokens and structured outputs, applied to each verified row
on its own context.

These change the target's logits z at a position from what came before it, as vLLM
applies them (and, for the repetition penalty, HF transformers' `repetition_penalty`):

    repetition r:  z_j / r if z_j > 0 else z_j * r,  for every token j of the prompt or output
    frequency f:   z_j - f * c_j,                     c_j: times j occurs in the output
    presence  s:   z_j - s * [c_j > 0]
    logit bias b:  z_j + b_j                          (OpenAI's `logit_bias`)
    min_tokens m:  z_j = -inf for the ids that would end the output (end of sequence,
                   `stop_token_ids`) while fewer than m tokens precede
    allowed ids A: z_j = -inf for j not in A (vLLM's `allowed_token_ids`)
    bad words:     z_j = -inf where j would complete a bad word's tokens w: j = w[-1] and
                   the output ends with w[:-1] (vLLM's `bad_words`; `bad_word_token_ids`)

    grammar:       z_j = -inf for the tokens a structured output's grammar refuses next
                   (`verifier.structured_output`)

(in that order; then temperature, top-k and top-p as `verifier.sampling` does). A verified
row's context is the output so far plus the drafts on its path: row 0 follows the last
committed token, row i of a chain follows the drafts d_0..d_{i-1}, and the row after a
token tree's node follows the drafts from the root down to it. Processing every row with
its own counts and position is what keeps speculation exact: the row that decides a token
sees what a plain decode step would at that position.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np
import torch

from verifier.sampling_params import SamplingParams
from verifier.structured_output import GrammarMatcher


def bad_word_token_ids(tokenizer, words: Iterable[str]) -> list[tuple[int, ...]]:
    """The token sequences `bad_words` refuse, as vLLM derives them: each word (leading
    spaces dropped) tokenised alone, and after a space where that gives other tokens of
    the same number (the word in the middle of a text, " Paris" beside "Paris").

    >>> bad_word_token_ids(tok, ["Paris"])  # doctest: +SKIP
    [(42, 7), (9, 7)]
    """
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


class RowContext:
    """What one sequence's processing reads: its output's token counts and length, its
    prompt's tokens (repetition penalty), the ids that would end it (min_tokens), the
    token sequences of its bad words with the output's last tokens, the ids it may hold
    (`allowed_token_ids`) and its grammar's matcher (structured outputs)."""

    def __init__(self, prompt_token_ids: Iterable[int], stop_token_ids: Iterable[int] = (),
                 grammar: GrammarMatcher | None = None, bad_words: Sequence[Sequence[int]] = (),
                 allowed_token_ids: Iterable[int] | None = None) -> None:
        self.prompt_tokens = frozenset(prompt_token_ids)
        self.stop_token_ids = sorted(stop_token_ids)
        self.counts: collections.Counter[int] = collections.Counter()
        self.num_output = 0
        self.grammar = grammar
        words = [tuple(w) for w in bad_words if w]
        self.bad_single = sorted({w[0] for w in words if len(w) == 1})
        self.bad_multi = [w for w in words if len(w) > 1]
        #: int64 [m], once per sequence, not per pass; None: every id.
        self.allowed = None if allowed_token_ids is None else np.array(sorted(set(allowed_token_ids)), np.int64)
        #: The output's last tokens, as many as the longest bad word's prefix.
        self.tail: list[int] = []
        self._tail_len = max((len(w) - 1 for w in self.bad_multi), default=0)

    def add(self, token_ids: Sequence[int]) -> None:
        """Committed output tokens."""
        self.counts.update(token_ids)
        self.num_output += len(token_ids)
        if self._tail_len:
            self.tail = (self.tail + list(token_ids))[-self._tail_len:]
        if self.grammar is not None:
            self.grammar.accept(token_ids)

    def banned(self, path: Sequence[int]) -> list[int]:
        """The bad words' last tokens refused after the output and then `path`."""
        banned = list(self.bad_single)
        if self.bad_multi:
            recent = self.tail + list(path)
            for w in self.bad_multi:
                n = len(w) - 1
                if len(recent) >= n and tuple(recent[-n:]) == w[:-1]:
                    banned.append(w[-1])
        return banned


def process_rows(logits: torch.Tensor, params: SamplingParams, context: RowContext,
                 paths: Sequence[Sequence[int]]) -> None:
    """Process `logits` (float32 [n, V]) in place, row i as if the output went on with
    `paths[i]` (the drafts between the committed output and that row)."""
    assert logits.shape[0] == len(paths), f"{logits.shape=} {len(paths)=}"
    r, f, s = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    penalised = r != 1.0 or f or s
    if context.allowed is not None:  # every row alike; numpy: one thread (see GrammarMatcher)
        z = logits.numpy()
        kept = z[:, context.allowed]
        z.fill(float("-inf"))
        z[:, context.allowed] = kept
    for i, path in enumerate(paths):
        # The output's counts with the path's drafts: a copy per row, so only for the penalties
        # (a request with a grammar alone, say, reads none of it).
        counts = context.counts + collections.Counter(path) if path and penalised else context.counts
        row = logits[i]
        if r != 1.0:
            seen = torch.tensor(sorted(context.prompt_tokens | counts.keys()), dtype=torch.int64)
            z = row[seen]
            row[seen] = torch.where(z > 0, z / r, z * r)
        if (f or s) and counts:
            ids = torch.tensor(list(counts.keys()), dtype=torch.int64)
            c = torch.tensor(list(counts.values()), dtype=torch.float32)
            row[ids] -= f * c + s
        if params.logit_bias:
            row[bias_ids] += bias
        if context.num_output + len(path) < params.min_tokens and context.stop_token_ids:
            row[context.stop_token_ids] = float("-inf")
        if (context.bad_single or context.bad_multi) and (banned := context.banned(path)):
            row[banned] = float("-inf")
    if context.grammar is not None:
        context.grammar.mask_rows(logits, paths)


def row_paths(drafts: np.ndarray, parents: np.ndarray | None) -> list[list[int]]:
    """The drafts before each verified row: none before row 0; d_0..d_{i-1} before row i
    of a chain; before a token tree node's row, the drafts from the root down to that node
    (`parents`: each draft's parent index, -1 for the root's children, parents first).

    >>> row_paths(np.array([5, 6, 7]), np.array([-1, -1, 1]))
    [[], [5], [6], [6, 7]]
    """
    tokens = drafts.tolist()
    if parents is None:
        return [tokens[:i] for i in range(len(tokens) + 1)]
    paths: list[list[int]] = []
    for token, parent in zip(tokens, parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return [[], *paths]
