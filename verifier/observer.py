"""What the engine reports as it runs: the hook `cluster.metrics` turns into Ray metrics.

The engine calls these methods on its event loop, never in the worker thread, with
figures it already has on the host (no device sync just for metrics). The default
observer does nothing, so the engine runs the same without Ray.

Counting rules (glossary in DESIGN.md):
- a *round* with drafts for one sequence calls `on_round(method, k, num_accepted, reason)`
  with k >= 1; a round without drafts calls it with k = 0, method None or the method that
  failed, and the reason (`verifier.controller.REASONS`);
- mean acceptance length = 1 + sum(num_accepted) / rounds with k >= 1 (the bonus or
  recovered token included), the figure of `SequenceStats.mean_acceptance_length`.
"""

from __future__ import annotations

from verifier.sequence import FinishReason, SequenceStats


class EngineObserver:
    """No-op base: subclass and override what you record."""

    def on_step(self, num_tokens: int, num_seqs: int, seconds: float, num_output_tokens: int) -> None:
        """One verifier pass over `num_tokens` inputs of `num_seqs` sequences took `seconds`
        and emitted `num_output_tokens` tokens to clients."""

    def on_load(self, num_running: int, num_waiting: int, num_used_slots: int, num_slots: int,
                num_cached_tokens: int, num_token_capacity: int) -> None:
        """Queue and KV cache state after a pass (slots are preallocated per sequence)."""

    def on_round(self, method: str | None, k: int, num_accepted: int, reason: str) -> None:
        """One sequence's round after prefill: k drafts verified, the first num_accepted kept."""

    def on_proposer_call(self, method: str, seconds: float, ok: bool) -> None:
        """One batched proposer call (one RPC per replica for remote proposers)."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request's first output token, `ttft_s` after it arrived (queueing included)."""

    def on_finish(self, stats: SequenceStats, reason: FinishReason) -> None:
        """A request finished (aborted ones included); `stats.elapsed_s` is its end-to-end time."""
