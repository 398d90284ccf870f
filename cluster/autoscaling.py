"""Autoscaling policy of proposer deployments.

Serve's default policy counts requests that pass through Serve handles, but proposer
traffic is a gRPC stream that bypasses Serve (see `cluster.discovery`), so that count is
always 0. Each proposer replica instead reports the sequences it holds state for
(`record_autoscaling_stats` -> `active_sequences`), and this policy sizes the deployment
so that each replica holds about `target_ongoing_requests` of them. Serve wraps it with
the usual `min_replicas`/`max_replicas` bounds and `upscale_delay_s`/`downscale_delay_s`.
"""

from __future__ import annotations

import math
from typing import Any

#: Name of the per-replica metric that proposer replicas report.
ACTIVE_SEQUENCES = "active_sequences"

#: Import path Serve uses to load the policy (in the Serve controller).
POLICY_PATH = "cluster.autoscaling:proposer_load_policy"


def desired_replicas(total_sequences: float, target_per_replica: float, min_replicas: int, max_replicas: int) -> int:
    """ceil(total / target), within [min_replicas, max_replicas]."""
    want = math.ceil(total_sequences / target_per_replica - 1e-9) if total_sequences > 0 else 0
    return max(min_replicas, min(max_replicas, want))


def proposer_load_policy(ctx) -> tuple[int, dict[str, Any]]:
    """Serve custom autoscaling policy (`ray.serve.config.AutoscalingContext` in)."""
    per_replica = (ctx.aggregated_metrics or {}).get(ACTIVE_SEQUENCES, {})
    total = float(sum(per_replica.values()))
    config = ctx.config
    return desired_replicas(
        total, config.get_target_ongoing_requests(), ctx.capacity_adjusted_min_replicas,
        ctx.capacity_adjusted_max_replicas,
    ), {}
