"""Token trees: several draft candidates per position, verified in one pass.

A tree of n drafts is given by `parents` (int [n]): the index of each draft's parent, an
earlier draft, or -1 for the last context token (the root, which the verifier feeds as
usual). Siblings come in order of preference, so following first children gives the
proposer's best chain. The verifier runs root + drafts in one pass (`LlamaModel.forward`
with `trees`: each node at the position of its depth, attending its ancestors only), then
walks from the root to the child matching its own argmax, and on (`greedy_accept_tree`).
A greedy output stays exactly the target's: every emitted token is an argmax of the
target given the tokens before it, as in a chain. Sampled requests use chains.

Example: drafts [a, b, a2, b2] with parents [-1, -1, 0, 1] are the two best next tokens,
each with its best continuation; if the target picks b and then b2, two drafts are
accepted (b, b2) and the target's token after b2 is the bonus.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def tree_depths(parents: Sequence[int]) -> list[int]:
    """The depth of each node of a tree (or forest) listed parents first: `parents[i]` is
    the index of node i's parent, -1 for a root (depth 0). Raises ValueError otherwise.

    >>> tree_depths([-1, 0, 0, 1, 2, 4])
    [0, 1, 1, 2, 2, 3]
    """
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] is {p}: a node's parent must be listed before it (or be -1)")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_ancestors(parents: Sequence[int]) -> torch.Tensor:
    """bool [n, n]: [a, b] is True when node b is node a or one of its ancestors.

    >>> tree_ancestors([-1, 0, 0, 1]).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    tree_depths(parents)  # validates the order
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def first_chain(parents: Sequence[int]) -> list[int]:
    """Indices of the chain that follows first children from the root.

    >>> first_chain([-1, -1, 0, 1, 2])
    [0, 2, 4]
    """
    chain, node = [], -1
    for i, p in enumerate(parents):
        if p == node:
            chain.append(i)
            node = i
    return chain


def tree_prefix(parents: Sequence[int], max_depth: int, max_nodes: int) -> int:
    """How many leading drafts to keep so that none is deeper than `max_depth` (1 = the
    root's children) and at most `max_nodes` remain; a kept prefix is a tree, since parents
    come first. Drafts must come in breadth-first order (depths non-decreasing) for the
    depth cut to be a prefix; ValueError otherwise.

    >>> tree_prefix([-1, -1, 0, 1, 2], max_depth=2, max_nodes=8), tree_prefix([-1, -1, 0], 5, 2)
    (4, 2)
    """
    depths = tree_depths(parents)
    if any(a > b for a, b in zip(depths, depths[1:])):
        raise ValueError(f"drafts must come in breadth-first order (depths {[d + 1 for d in depths]})")
    n = 0
    while n < min(len(depths), max_nodes) and depths[n] < max_depth:
        n += 1
    return n


def greedy_accept_tree(target_token_ids: Sequence[int] | np.ndarray, draft_token_ids: np.ndarray,
                       parents: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """Greedy acceptance over a token tree: (accepted path, output token ids).

    `target_token_ids`: int [n + 1], the target's argmax after the root (row 0) and after
    each draft (row i + 1). From the root, the walk moves to the first child whose token
    is the target's argmax there, until no child matches. The path lists the accepted
    drafts' indices; the output is their tokens, then the target's argmax after the last.

    >>> greedy_accept_tree([7, 1, 9, 2, 3], np.array([5, 7, 9, 8], np.int32), [-1, -1, 1, 1])
    ([1, 2], array([7, 9, 2], dtype=int32))
    """
    target = np.asarray(target_token_ids)
    assert target.shape == (len(draft_token_ids) + 1,), f"{target.shape=} {len(draft_token_ids)=}"
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, np.asarray(draft_token_ids).tolist())):
        children.setdefault((p, t), i)
    path, node = [], -1
    while True:
        nxt = children.get((node, int(target[node + 1])))
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    out = [int(draft_token_ids[i]) for i in path] + [int(target[node + 1])]
    return path, np.asarray(out, dtype=np.int32)
