"""The proposer autoscaling policy: ceil(active sequences / target per replica), bounded."""

from __future__ import annotations

import types

import pytest

from cluster.autoscaling import ACTIVE_SEQUENCES, desired_replicas, proposer_load_policy


@pytest.mark.parametrize(
    "total, target, lo, hi, want",
    [
        (0, 2.0, 1, 8, 1),  # idle: the floor
        (0, 2.0, 0, 8, 0),  # idle with a floor of 0: scale to zero
        (4, 1.0, 1, 2, 2),  # 4 replicas wanted, capped at 2
        (3, 2.0, 1, 8, 2),  # 3 / 2 = 1.5 -> 2
        (4, 2.0, 1, 8, 2),  # 4 / 2 = 2 exactly: no extra replica
        (5, 2.0, 1, 8, 3),  # 2.5 -> 3
        (1, 2.0, 1, 8, 1),  # 0.5 -> 1
        (1, 10.0, 3, 8, 3),  # min bound: 1 wanted, floor 3
        (100, 2.0, 1, 8, 8),  # max bound: 50 wanted, ceiling 8
        (6.0, 1.5, 1, 8, 4),  # float totals and targets (metrics are averages): 6 / 1.5 = 4
    ],
)
def test_desired_replicas(total, target, lo, hi, want):
    assert desired_replicas(total, target, lo, hi) == want


def _ctx(per_replica, target=2.0, lo=1, hi=4):
    return types.SimpleNamespace(
        aggregated_metrics={ACTIVE_SEQUENCES: per_replica},
        config=types.SimpleNamespace(get_target_ongoing_requests=lambda: target),
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
    )


def test_policy_sums_the_replicas_sequences():
    assert ACTIVE_SEQUENCES == "active_sequences"
    # 3 + 2 = 5 sequences at 2 per replica -> ceil(2.5) = 3.
    assert proposer_load_policy(_ctx({"r1": 3.0, "r2": 2.0})) == (3, {})
    # 9 sequences -> ceil(4.5) = 5, capped at 4.
    assert proposer_load_policy(_ctx({"r1": 5.0, "r2": 4.0}))[0] == 4


def test_policy_without_metrics_keeps_the_floor():
    assert proposer_load_policy(_ctx({}, lo=2))[0] == 2
    ctx = _ctx({}, lo=1)
    ctx.aggregated_metrics = None  # before any replica reported
    assert proposer_load_policy(ctx)[0] == 1
