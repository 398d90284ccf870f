"""Token-tree helpers (verifier/token_tree.py), against trees worked out by hand."""

from __future__ import annotations

import collections
import doctest
import math

import numpy as np
import pytest
import torch

from verifier import token_tree
from verifier.token_tree import (first_chain, greedy_accept_tree, sample_accept_tree, tree_ancestors, tree_depths,
                                 tree_prefix)

#        root
#       /    \
#     0:a    1:b
#     / \      \
#  2:c  3:d    4:e
#   |
#  5:f
PARENTS = [-1, -1, 0, 0, 1, 2]
TOKENS = np.array([10, 11, 12, 13, 14, 15], np.int32)


def test_depths_ancestors_and_first_chain_by_hand():
    assert tree_depths(PARENTS) == [0, 0, 1, 1, 1, 2]
    anc = tree_ancestors(PARENTS)
    assert [row.nonzero().flatten().tolist() for row in anc] == [[0], [1], [0, 2], [0, 3], [1, 4], [0, 2, 5]]
    assert first_chain(PARENTS) == [0, 2, 5]
    assert first_chain([]) == [] and first_chain([-1, 0, 1]) == [0, 1, 2]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2]])
def test_a_parent_must_come_first(parents):
    with pytest.raises(ValueError, match="must be listed before it"):
        tree_depths(parents)


def test_prefix_cuts_by_depth_and_room():
    assert tree_prefix(PARENTS, max_depth=1, max_nodes=99) == 2  # a, b
    assert tree_prefix(PARENTS, max_depth=2, max_nodes=99) == 5  # + c, d, e
    assert tree_prefix(PARENTS, max_depth=3, max_nodes=4) == 4
    with pytest.raises(ValueError, match="breadth-first"):
        tree_prefix([-1, 0, -1], 3, 3)  # depth 2 listed before depth 1


@pytest.mark.parametrize("argmax, path, out", [
    # target rows: after the root, then after each draft 0..5
    ([10, 12, 0, 15, 0, 0, 7], [0, 2, 5], [10, 12, 15, 7]),  # down the first chain, bonus 7
    ([10, 13, 0, 0, 9, 0, 0], [0, 3], [10, 13, 9]),  # a then d (second child), then 9
    ([11, 0, 14, 0, 0, 3, 0], [1, 4], [11, 14, 3]),  # b (second root child), then e
    ([11, 0, 99, 0, 0, 0, 0], [1], [11, 99]),  # b, then no child of b matches 99
    ([42, 0, 0, 0, 0, 0, 0], [], [42]),  # nothing matches: the target's own token
])
def test_greedy_acceptance_walks_the_matching_children(argmax, path, out):
    got_path, emitted = greedy_accept_tree(argmax, TOKENS, PARENTS)
    assert got_path == path and emitted.tolist() == out


# --- sampled acceptance: emitted tokens follow the target's rows ----------------------------
#
#          root (row 0: P_ROOT)
#        /      |       \
#   0:tok 0  1:tok 1  2:tok 0 (a repeat: never accepted, its row never used)
#      |        |
#   3:tok 2  4:tok 3
#
# Rows 1..5 follow drafts 0..4. The bound is test_rejection_sampler.py's: the TV between the
# empirical distribution of N draws over V categories and the true one stays under
# 0.5 sqrt(V / N) + sqrt(ln(1000) / 2N) but for one seed in a thousand.
SAMPLED_PARENTS = [-1, -1, -1, 0, 1]
SAMPLED_TOKENS = np.array([0, 1, 0, 2, 3], np.int32)
P_ROOT = [0.30, 0.25, 0.20, 0.15, 0.10, 0.00]  # token 5 impossible
P_AFTER_0 = [0.05, 0.05, 0.40, 0.30, 0.10, 0.10]
P_AFTER_1 = [0.10, 0.30, 0.05, 0.25, 0.25, 0.05]
P_REPEAT = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # used by mistake, it would emit token 5
P_AFTER_0_2 = [0.50, 0.0, 0.0, 0.0, 0.0, 0.50]
P_AFTER_1_3 = [1 / 6] * 6
NUM_TREE_SAMPLES = 60_000


def _bound(n: int, v: int = 6) -> float:
    return 0.5 * math.sqrt(v / n) + math.sqrt(math.log(1000) / (2 * n))


def _tv(tokens, probs) -> float:
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=len(probs))
    return 0.5 * float(np.abs(counts / len(tokens) - np.asarray(probs)).sum())


def test_sampled_tree_acceptance_follows_each_row_of_the_target():
    """First token ~ row 0; given the walk took child 0 (token 0) or 1 (token 1), the next
    token ~ that child's row; after the leaf 3, the bonus ~ its row. The round accepts a
    first draft with probability P_ROOT(0) + P_ROOT(1) = 0.55, the target's mass on the
    root's children."""
    probs = torch.tensor([P_ROOT, P_AFTER_0, P_AFTER_1, P_REPEAT, P_AFTER_0_2, P_AFTER_1_3])
    generator = torch.Generator().manual_seed(11)
    first, after = [], {0: [], 1: [], (0, 2): []}
    accepted = 0
    for _ in range(NUM_TREE_SAMPLES):
        path, out = sample_accept_tree(probs, SAMPLED_TOKENS, SAMPLED_PARENTS, generator)
        assert out.tolist()[:-1] == SAMPLED_TOKENS[path].tolist()  # the accepted drafts, then one token
        assert 2 not in path  # the repeated token 0 is never accepted at its second sibling
        first.append(out[0])
        accepted += bool(path)
        if path[:1] in ([0], [1]):
            after[int(out[0])].append(out[1])
        if path == [0, 3]:
            after[(0, 2)].append(out[2])
    n = NUM_TREE_SAMPLES
    assert _tv(first, P_ROOT) <= _bound(n), _tv(first, P_ROOT)
    assert 5 not in first
    assert abs(accepted / n - 0.55) <= math.sqrt(math.log(2000) / (2 * n))  # Hoeffding
    for key, row in ((0, P_AFTER_0), (1, P_AFTER_1), ((0, 2), P_AFTER_0_2)):
        got = after[key]
        assert len(got) > 5000, (key, len(got))
        assert _tv(got, row) <= _bound(len(got)), (key, _tv(got, row), len(got))
    # The test can fail: emitting the first child (or any fixed draft) is 0.7 from P_ROOT;
    # taking the next token from the wrong child's row, e.g. row 2's after token 0, is 0.4.
    assert _tv([0] * 100, P_ROOT) > 10 * _bound(n)
    assert _tv(after[0], P_AFTER_1) > 10 * _bound(len(after[0]))


def test_sampled_tree_acceptance_tests_each_sibling_against_what_is_left():
    """The rule's middle step by hand: with row 0 [0.5, 0.5, 0, ...] and children tokens 0
    then 1, child 1 is reached only when 0 is rejected (u_0 >= 0.5), and then it is the
    only token left, so it is accepted whatever u_1 is; the next token is then drawn from
    row 2 (everything on token 4), and the round emits [1, 4]. A rule that tested child 1
    against its unrenormalised 0.5 would reject it about half the time and draw token 1
    (the only weight left) from the root's residual: [1] alone."""
    probs = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0, 1.0, 0]])
    outs = collections.Counter()
    for seed in range(400):
        path, out = sample_accept_tree(probs, np.array([0, 1], np.int32), [-1, -1],
                                       torch.Generator().manual_seed(seed))
        outs[tuple(out.tolist())] += 1
    assert set(outs) == {(0, 3), (1, 4)}
    assert 150 < outs[(1, 4)] < 250  # half of 400, up to 5 standard deviations (10)


def test_doctests():
    assert doctest.testmod(token_tree).failed == 0
