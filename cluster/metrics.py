"""The verifier's metrics, through `ray.util.metrics`.

Ray exports them on every node's metrics port (`ray start --metrics-export-port`, or
`api.metrics_port` of `splitspec serve`) and the Ray dashboard's Grafana reads them from
Prometheus. Ray prefixes each name with `ray_`, counters end in `_total`, and every series
carries Ray's labels (`WorkerId`, `NodeAddress`, ...) plus `application` (the Serve app).

PromQL (sum over replicas; `[5m]` is the usual rate window):

    acceptance rate, per method:
        sum by (method) (rate(ray_splitspec_accepted_tokens_total[5m]))
          / sum by (method) (rate(ray_splitspec_draft_tokens_total[5m]))
    mean acceptance length (bonus token included), per method:
        1 + sum by (method) (rate(ray_splitspec_accepted_tokens_total[5m]))
              / sum by (method) (rate(ray_splitspec_drafts_total[5m]))
    acceptance at draft position i (how often the first i + 1 drafts all held):
        sum by (method, position) (rate(ray_splitspec_accepted_tokens_per_position_total[5m]))
          / ignoring(position) group_left sum by (method) (rate(ray_splitspec_drafts_total[5m]))
    output tokens/s:        sum(rate(ray_splitspec_output_tokens_total[1m]))
    p50 TTFT (ms):          histogram_quantile(0.5, sum by (le) (rate(ray_splitspec_ttft_ms_bucket[5m])))
    rounds off, by reason:  sum by (reason) (rate(ray_splitspec_controller_decisions_total{speculating="false"}[5m]))

`k8s/dashboards/splitspec.json` is a Grafana dashboard built on these series.
"""

from __future__ import annotations

from verifier.observer import EngineObserver
from verifier.sequence import FinishReason, SequenceStats

#: Histogram bucket bounds in milliseconds: 1 ms to 2 min, about x2 apart.
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 120_000)
#: Proposer round trips sit at 0.3-50 ms (a gRPC message ~0.3 ms, a draft model round ~60 ms).
RPC_BUCKETS_MS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000)

#: (name, kind, description, tag keys); kind is counter, gauge or a histogram's buckets.
METRICS: tuple[tuple[str, object, str, tuple[str, ...]], ...] = (
    ("splitspec_drafts", "counter",
     "Rounds that verified at least one draft token, by method. Mean acceptance length = "
     "1 + rate(accepted_tokens) / rate(drafts).", ("method",)),
    ("splitspec_draft_tokens", "counter",
     "Draft tokens sent to the verifier, by method. Acceptance rate = rate(accepted_tokens) / "
     "rate(draft_tokens).", ("method",)),
    ("splitspec_accepted_tokens", "counter",
     "Draft tokens the verifier accepted, by method (bonus and recovered tokens not included).", ("method",)),
    ("splitspec_accepted_tokens_per_position", "counter",
     "Rounds whose drafts at positions 0..position were all accepted, by method and position "
     "(non-increasing in position; divide by drafts for per-position acceptance).", ("method", "position")),
    ("splitspec_controller_decisions", "counter",
     "Per-sequence round decisions after prefill, by reason (verifier.controller.REASONS) and whether "
     "the round speculated.", ("reason", "speculating")),
    ("splitspec_rounds", "counter", "Verifier forward passes (prefill passes included).", ()),
    ("splitspec_output_tokens", "counter", "Tokens emitted to clients.", ()),
    ("splitspec_requests_finished", "counter", "Requests finished, by finish reason.", ("finish_reason",)),
    ("splitspec_proposer_rpc_failures", "counter", "Proposer calls that failed or missed the deadline.",
     ("method",)),
    ("splitspec_proposer_rpc_latency_ms", RPC_BUCKETS_MS,
     "Round trip of one batched proposer call, by method (milliseconds).", ("method",)),
    ("splitspec_round_latency_ms", LATENCY_BUCKETS_MS, "One verifier forward pass (milliseconds).", ()),
    ("splitspec_ttft_ms", LATENCY_BUCKETS_MS, "Time to first token, queueing included (milliseconds).", ()),
    ("splitspec_tpot_ms", LATENCY_BUCKETS_MS,
     "Time per output token after the first, per request (milliseconds).", ()),
    ("splitspec_e2e_latency_ms", LATENCY_BUCKETS_MS, "Request arrival to last token (milliseconds).", ()),
    ("splitspec_running_seqs", "gauge", "Sequences holding a KV slot.", ()),
    ("splitspec_waiting_seqs", "gauge", "Requests waiting for a KV slot.", ()),
    ("splitspec_kv_cache_usage_ratio", "gauge",
     "KV cache slots in use / slots (slots are preallocated at max_model_len each).", ()),
    ("splitspec_kv_cache_tokens_ratio", "gauge", "Tokens held in the KV cache / its token capacity.", ()),
)

#: Label of every series: the Serve application.
DEFAULT_TAGS = ("application",)


class RayEngineMetrics(EngineObserver):
    """The engine observer of a verifier replica: one `ray.util.metrics` object per metric.

    Each call records straight into Ray's core worker (a few microseconds), which exports
    every `RAY_metrics_report_interval_ms` (10 s by default)."""

    def __init__(self, application: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self._m = {}
        for name, kind, description, tags in METRICS:
            keys = DEFAULT_TAGS + tags
            if kind == "counter":
                metric = Counter(name, description=description, tag_keys=keys)
            elif kind == "gauge":
                metric = Gauge(name, description=description, tag_keys=keys)
            else:
                metric = Histogram(name, description=description, boundaries=list(kind), tag_keys=keys)
            metric.set_default_tags({"application": application})
            self._m[name.removeprefix("splitspec_")] = metric
        # Tag dicts built once per method (and position), not per call on the round path.
        self._tags: dict[str | None, dict[str, str]] = {}
        self._position_tags: dict[tuple[str | None, int], dict[str, str]] = {}

    def _method(self, method: str | None) -> dict[str, str]:
        tags = self._tags.get(method)
        if tags is None:
            tags = self._tags[method] = {"method": method or "none"}
        return tags

    def _position(self, method: str | None, i: int) -> dict[str, str]:
        tags = self._position_tags.get((method, i))
        if tags is None:
            tags = self._position_tags[(method, i)] = {**self._method(method), "position": str(i)}
        return tags

    def on_step(self, num_tokens: int, num_seqs: int, seconds: float, num_output_tokens: int) -> None:
        self._m["rounds"].inc()
        self._m["round_latency_ms"].observe(seconds * 1e3)
        if num_output_tokens:
            self._m["output_tokens"].inc(num_output_tokens)

    def on_load(self, num_running: int, num_waiting: int, num_used_slots: int, num_slots: int,
                num_cached_tokens: int, num_token_capacity: int) -> None:
        self._m["running_seqs"].set(num_running)
        self._m["waiting_seqs"].set(num_waiting)
        self._m["kv_cache_usage_ratio"].set(num_used_slots / num_slots)
        self._m["kv_cache_tokens_ratio"].set(num_cached_tokens / num_token_capacity)

    def on_round(self, method: str | None, k: int, num_accepted: int, reason: str) -> None:
        self._m["controller_decisions"].inc(tags={"reason": reason, "speculating": "true" if k else "false"})
        if not k:
            return
        tags = self._method(method)
        self._m["drafts"].inc(tags=tags)
        self._m["draft_tokens"].inc(k, tags=tags)
        if num_accepted:
            self._m["accepted_tokens"].inc(num_accepted, tags=tags)
        per_position = self._m["accepted_tokens_per_position"]
        for i in range(num_accepted):
            per_position.inc(tags=self._position(method, i))

    def on_proposer_call(self, method: str, seconds: float, ok: bool) -> None:
        tags = self._method(method)
        self._m["proposer_rpc_latency_ms"].observe(seconds * 1e3, tags=tags)
        if not ok:
            self._m["proposer_rpc_failures"].inc(tags=tags)

    def on_first_token(self, ttft_s: float) -> None:
        self._m["ttft_ms"].observe(ttft_s * 1e3)

    def on_finish(self, stats: SequenceStats, reason: FinishReason) -> None:
        self._m["requests_finished"].inc(tags={"finish_reason": reason.value})
        self._m["e2e_latency_ms"].observe(stats.elapsed_s * 1e3)
        if stats.num_output_tokens > 1:
            self._m["tpot_ms"].observe((stats.elapsed_s - stats.prefill_s) / (stats.num_output_tokens - 1) * 1e3)
