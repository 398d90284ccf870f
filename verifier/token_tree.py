"""Token trees: several draft candidates per position, verified in one pass.

A tree of n drafts is given by `parents` (int [n]): the index of each draft's parent, an
earlier draft, or -1 for the last context token (the root, which the verifier feeds as
usual). Siblings come in order of preference, so following first children gives the
proposer's best chain. The verifier runs root + drafts in one pass (`LlamaModel.forward`
with `trees`: each node at the position of its depth, attending its ancestors only), then
walks from the root to the child matching its own argmax, and on (`greedy_accept_tree`).
A greedy output stays exactly the target's: every emitted token is an argmax of the
target given the tokens before it, as in a chain. A sampled request's walk tests the
children one after another against what is left of the target's distribution
(`sample_accept_tree`), so its output follows the target's distribution exactly too.

Example: drafts [a, b, a2, b2] with parents [-1, -1, 0, 1] are the two best next tokens,
each with its best continuation; if the target picks b and then b2, two drafts are
accepted (b, b2) and the target's token after b2 is the bonus.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from verifier.rejection_sampler import draw


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


def sample_accept_tree(target_probs: torch.Tensor, draft_token_ids: np.ndarray, parents: Sequence[int],
                       generator: torch.Generator | None) -> tuple[list[int], np.ndarray]:
    """Speculative sampling over a token tree: (accepted path, output token ids).

    `target_probs`: float32 [n + 1, V], the target's processed distribution after the root
    (row 0) and after each draft (row i + 1), rows summing to 1; `generator`: the request's
    seeded generator (one call draws n + 1 float32 uniforms, as `rejection_sample` does).

    The drafts count as one-hot q, whatever chose them (a proposer's top candidates). At a
    node whose row is p and whose children carry tokens t_1, t_2, ... in order, child j is
    accepted with probability r(t_j) / sum(r), r being p with the tokens of the children
    rejected before it zeroed (a token repeated among siblings is never accepted twice);
    the walk then goes on from that child's row. When every child is rejected, or the node
    has none (the bonus after a leaf), the next token is drawn from r and the round ends.
    So the token emitted after the node is t_j with probability p(t_j) (the product
    (1 - p(t_1)) ... (1 - sum_{i<j} p(t_i)) / ... telescopes: each factor is the chance of
    reaching t_j times r(t_j) / sum(r)), and any other token x with (1 - sum_j p(t_j)) *
    p(x) / (1 - sum_j p(t_j)) = p(x): exactly p, as SpecInfer's multi-candidate rule with
    one-hot drafts. Given the token, what follows is drawn from the target's row after it,
    so by induction the output follows the target's distribution. Acceptance at a node is
    the target's mass on its children's tokens (a chain's one-hot draft: on one token).

    Drafts [0, 2, 1] with parents [-1, -1, 1]: the root's children are 0 and 2, and 2 has
    child 1. The target's row 0 puts nothing on 0 and everything on 2; its row after 2 (row
    2) everything on 1, its row after that leaf (row 3) everything on 2:

    >>> p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    >>> sample_accept_tree(p, np.array([0, 2, 1], np.int32), [-1, -1, 1], torch.Generator().manual_seed(0))
    ([1, 2], array([2, 1, 2], dtype=int32))
    """
    n = len(draft_token_ids)
    assert target_probs.shape[0] == n + 1, f"{target_probs.shape=} {n=}"
    assert target_probs.dtype == torch.float32, f"{target_probs.dtype=}"
    tokens = np.asarray(draft_token_ids).tolist()
    uniform = torch.rand(n + 1, generator=generator, device=target_probs.device, dtype=torch.float32).tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(int(p), []).append(i)
    path: list[int] = []
    node, used = -1, 0
    while True:
        row = target_probs[node + 1]
        kids = children.get(node, [])
        rejected: list[int] = []
        if kids:
            p_kids = row.take(torch.tensor([tokens[i] for i in kids], device=row.device)).tolist()
            mass = float(row.sum(dtype=torch.float64))  # 1 up to rounding
            accepted = None
            for i, pk in zip(kids, p_kids):
                if tokens[i] in rejected:
                    continue  # no mass left on it
                u = uniform[used]
                used += 1
                if pk > 0 and u * mass < pk:  # u < r(t) / sum(r), without a division (and never p = 0)
                    accepted = i
                    break
                mass -= pk
                rejected.append(tokens[i])
            if accepted is not None:
                path.append(accepted)
                node = accepted
                continue
        weights = row
        if rejected:
            weights = row.clone()
            weights[torch.tensor(rejected, device=row.device)] = 0.0
        token = draw(weights, row, uniform[n])
        out = [tokens[i] for i in path] + [token]
        return path, np.asarray(out, dtype=np.int32)
