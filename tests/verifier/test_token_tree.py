"""Token-tree helpers (verifier/token_tree.py), against trees worked out by hand."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from verifier import token_tree
from verifier.token_tree import first_chain, greedy_accept_tree, tree_ancestors, tree_depths, tree_prefix

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


def test_doctests():
    assert doctest.testmod(token_tree).failed == 0
