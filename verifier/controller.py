"""The adaptive speculation controller: (method, k) per running sequence per round.

Pure Python, no Ray or torch. The engine asks `plan` once per round and reports back:
`observe_round` (a sequence's drafted and accepted tokens), `observe_step` (the verifier's
pass time for its number of tokens) and `observe_proposer` (a method's round-trip time).

What it maximises (DESIGN.md, "Controller") is batch goodput, tokens emitted per second
of verifier time:

    G(k_1..k_B) = sum_i E[tokens_i(k_i)] / (T(sum_i (k_i + 1)) + L)

where T is the step-time curve, L the slowest proposer call of the round (the methods are
asked in parallel, before the pass; a call's time grows with the largest k asked of it,
`ProposerLatency`) and

    E[tokens_i(k)] = 1 + p_i (alpha_i(1) + ... + alpha_i(k)),   alpha_i(j) = c_i(1) * ... * c_i(j)

with c_i(j) the sequence's estimate of the conditional acceptance at position j (the share
of rounds that accepted draft j among those that accepted drafts 1..j-1: an EWMA that
starts as a running mean from the method-wide estimate, `AcceptanceEstimate`) and p_i the EWMA of
the share of rounds in which the proposer had a draft at all (an n-gram proposer often has
none; such a round costs the verifier nothing, so the k tokens count p_i k in T too).
alpha_i(j) does not grow with j, so for a fixed budget the best split gives draft tokens to
the largest alpha_i(j) over all sequences; the controller walks that order, evaluates G at
every prefix and keeps the best: exact for a given method per sequence, whatever T's shape.

Worked example: one sequence, T(n) = 20 ms + 0.5 ms * n, L = 1 ms. k = 1 pays when
(1 + alpha(1)) / (T(2) + L) > 1 / T(1), i.e. alpha(1) > (0.5 + 1) / 20.5 = 0.073.

Prompts prefilled in the same pass (n tokens) are not in the baseline the drafts compete
with: the pass is priced as the running sequences' decode pass, T(B), plus what the drafts
add to the real one, read off the one-sequence token curve alone: T_tokens(n + sum_i
(k_i + 1)) - T_tokens(n + B) (`Controller._pass_time`). Counted in the baseline, the
prefill made the pass's own goodput low and any draft look good beside it (measured in
the engine at 32 slots on code_edit: auto verified about 76 drafts in each pass that
carried prompts, where a decode pass of 32 took 0-11, and lost to `off`). The step-time
model's per-draft extra X(b) is left out there: it is learned in decode passes, where the
curve's rows are cheap ones (32-64 tokens: 0.75 ms a token on the bundled model), and a
pass with prompts already runs at the dear rows further up (1.3-1.5 ms a token past 100).
With X(b) on top a draft beside a prompt was priced at 2.6-4.1 ms, where a least-squares
fit over such passes gave 1.4-1.6 (in one process at 32 clients on code_edit), and auto
drafted in few of them while `static:2` gained there.

Cheap methods are asked first and trimmed after. Weighing a draft by p_i before knowing
whether it comes spreads its cost over the step of T: on a CPU verifier whose GEMMs run
through MKL a pass of 9-16 tokens costs the same (rows padded to 16,
`LlamaModel.gemm_rows`; with oneDNN T is flat from 1 to about 8 tokens), so a draft that comes
one round in ten is worth verifying in full, yet T(1 + 0.1 k) makes it look expensive. So a method whose round trip
is at most `shadow_latency_share` of T(1) (n-gram lookup) is asked for the whole cap
whenever its drafts would pay given that they come: the same walk over every cheap
sequence's alphas with p = 1, asking each sequence that appears in the longest prefix
that beats no drafts. Whether they pay is judged over the batch, not sequence by sequence:
a full batch of 32 decodes fills two 16-row steps, so one draft pads a third, which no
sequence's drafts pay for alone and a batch's do. Once the drafts are in, `trim` shares
the pass out again by the same maximisation with p = 1 for the sequences that got drafts
(and their true counts), and cuts the rest. Costly methods are sized in `plan`, where
asking for fewer drafts saves proposer time, and trimmed the same way.

Asking still holds the pass back by the cheap method's round trip, so the call itself must
pay (`Controller._pays_for_call`): the drafts that would pay given that they come, each
weighed by its sequence's p, against no call. Otherwise the sequences are off
(`proposer_slow`) and, greedy, shadow-draft: a call made for shadows only runs beside the
pass. On free chat at 32 clients (served, `bench-cpu.yaml`) the n-gram proposer had a
draft for under one ask in ten; asked every round for the cap, it cost a 3 ms round trip
on a 135 ms pass and gave back under one token a pass.

Policies (`ControllerSettings.policy`):
- `off`: never speculate (a request's `mode: on` still does);
- `static`: k = `k` every round (vLLM's `num_speculative_tokens`);
- `batch_table`: k by batch size, e.g. ((1, 4), (8, 2), (32, 0)): batches of 1-7 get 4,
  8-31 get 2, 32 and up get 0 (vLLM / TensorRT-LLM style schedules);
- `goodput` (default): the maximisation above, with hysteresis and probes.

Shadow drafts (`shadow`, on by default): a greedy sequence that is off for low acceptance
(or compute bound) still asks its proposer for drafts every round it has none pending, but
the verifier does not check them; the engine compares them with the tokens the sequence
then emits and reports the match as an ordinary round (for greedy decoding a draft token
is accepted exactly when it equals the target's next token). So an off sequence keeps
measuring its acceptance without spending verifier time, and comes back as soon as the
measure recovers instead of waiting for a probe; greedy sequences measure the methods they
do not use the same way, once per `probe_interval` rounds. Drafts that `trim` cut whole
become the sequence's shadow draft likewise (when none is pending). Sampled sequences use
probes.

Probes of a costly method (a model proposer) share calls: its call costs the round the
proposer's time whatever the number of sequences in it, so a sequence due for a probe
waits until `probe_interval` rounds have passed since the method's last probe round, and
every sequence due then is probed in that one call. One probe call per method per
`probe_interval` rounds, not one per sequence. A round admits only as many probes as would
pay if all their drafts were accepted: a token tree's probe adds its nodes to the pass
(8 for a (4, 1, 1) tree at depth 2), and a full batch of them can cost the pass several
times what they could give back.

Token trees (a proposer that drafts several candidates per position, `verifier.token_tree`):
k is the tree's depth, c_i(j) the acceptance of depth j given depths 1..j-1 (a tree round
counts as a chain of its depth), and depth j costs the pass as many tokens as the tree has
nodes there: `trim` reads them from the trees received (`levels`), and the controller keeps
each method's last ones to price its depths in `plan` (a method not seen drafting a tree
costs one token per depth; `_why_nobody` likewise prices a batch's drafts at a tree's
nodes). On a CPU verifier whose GEMMs run through MKL depths of many
nodes seldom pay: rows past 4 cost (`LlamaModel.gemm_rows`).

A request's own `speculation` always wins: `mode: off` (or `max_k: 0`) gives k = 0,
`mode: on` a fixed k = its `max_k` (else `k`), `method` pins the method, and `max_k`
caps whatever the policy chooses. Every decision carries a reason (`REASONS`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from typing import Callable, Mapping, Sequence

POLICIES = ("off", "static", "batch_table", "goodput")

#: Why a sequence got the k it got this round. k = 0 reasons first.
REASONS = (
    "request_off",  # the request asked for mode off or max_k 0
    "policy_off",  # controller policy `off`, or a fixed k of 0 (`static` k 0, a `batch_table` row of 0)
    "proposer_unavailable",  # no live proposer for the method (none configured, all failing)
    "low_acceptance",  # the sequence's acceptance does not pay for its drafts
    "batch_compute_bound",  # the drafts would pay if verifying them were free, but the batch is compute bound
    "proposer_slow",  # acceptance is fine but the proposer's round trip costs more than it saves
    "length",  # at most one token left to emit (engine)
    "resync",  # the proposer lost the sequence's state; it is resent this round (engine)
    "proposer_failed",  # the proposer call failed or was late this round (engine)
    "no_draft",  # the proposer had nothing to propose, e.g. no n-gram match (engine)
    # k > 0
    "request_on",  # the request asked for mode on (fixed k)
    "static",
    "batch_table",
    "goodput",
    "probe",  # a cheap periodic draft to re-measure an off sequence or an unused method
    "grammar_forced",  # the tokens a structured output's grammar forces next, drafted without a proposer (engine)
)

#: What the method-wide acceptance estimate counts as, in observations, in a new sequence's
#: estimate: sequences differ (on the Qwen2.5-Coder pair a code_edit sequence accepted 0.86
#: of its drafts, a chat one about 0.6), so a sequence's own first rounds soon outweigh it.
#: With the full weight of a well-measured method-wide estimate, a costly method's
#: sequence moved only by `costly_acceptance_ewma` (0.1) a round from its start.
SEQUENCE_PRIOR_OBSERVATIONS = 2.0

#: Drafts added to one sequence's ask of a costly method whose call line is not known
#: yet, or has not been re-measured for `REFIT_CALLS` calls (`Controller._explore_k`).
EXPLORE_DRAFTS = 2
REFIT_CALLS = 32

#: Off reasons under which a greedy sequence keeps shadow-drafting (see the module docstring).
SHADOW_REASONS = ("low_acceptance", "batch_compute_bound", "proposer_slow")


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """Tunables (the `controller` section of the YAML maps onto these)."""

    policy: str = "goodput"
    #: k of `static`, and of a `mode: on` request that gives no `max_k`.
    k: int = 4
    #: The most draft tokens `goodput` gives one sequence in one round.
    max_k: int = 8
    #: (min batch size, k) rows of `batch_table`, sorted by batch size.
    batch_table: tuple[tuple[int, int], ...] = ((1, 4), (8, 2), (32, 0))
    #: Weight of the newest observation in the per-sequence acceptance EWMA (at least: an
    #: estimate of few observations moves as their running mean, `AcceptanceEstimate`).
    #: At 0.3 a sequence whose drafts all fail drops from a well-measured c = 0.6 to 0.07
    #: in 6 rounds (from the bare prior 0.6: 0.3, 0.2, 0.14, ..., 0.05).
    acceptance_ewma: float = 0.3
    #: For a cheap method, the share of a sequence's departure from the method-wide
    #: acceptance (per position) that its decisions believe: a sequence's estimate moves
    #: by `acceptance_ewma` a round and so swings with chance. Measured in one process at
    #: 32 clients on code_edit (n-gram, about 960 rounds with drafts a run): whether a
    #: round's first draft was accepted was foretold worse by the sequence's own estimate
    #: than by the method-wide one (Brier score 0.246-0.250 against 0.239-0.240), and best
    #: by the method-wide one plus 0.3-0.5 of the sequence's departure (0.231-0.235).
    sequence_share: float = 0.5
    #: The same for a costly method (not cheap, see `shadow_latency_share`: a model
    #: proposer). It has no shadow drafts, so a sequence it turned off is re-measured only
    #: by a probe every `probe_interval` rounds, and a noisy estimate that dips below
    #: break-even costs many rounds. Measured (EAGLE head, chat, batch 1, 8 requests): at
    #: 0.3, 191 of 355 decisions were off for low acceptance, at 0.1, 15 (about 0.45
    #: acceptance per draft on average, break-even about 0.2).
    costly_acceptance_ewma: float = 0.1
    #: Conditional acceptance assumed before a method has any observation (optimistic, so
    #: new sequences try speculation and measure it), worth one observation. A sequence
    #: it keeps off (a costly method, below break-even) is probed at once.
    prior_acceptance: float = 0.6
    #: A sequence turned off for low acceptance, or a method a sequence does not use, is
    #: probed with `probe_k` drafts once every `probe_interval` rounds.
    probe_interval: int = 8
    probe_k: int = 2
    #: An off sequence's acceptance counts (1 - hysteresis) times when deciding to turn it
    #: back on, so one lucky round does not flip it.
    hysteresis: float = 0.2
    #: Weight of the newest step and proposer-latency measurement in their EWMAs.
    timing_ewma: float = 0.2
    #: Greedy sequences measure acceptance from unverified (shadow) drafts while off, and
    #: methods they do not use likewise, instead of verified probes.
    shadow: bool = True
    #: ... for methods whose round trip is at most this share of a lone decode step.
    shadow_latency_share: float = 0.25
    #: A method called for shadow drafts only (none verified this round) is called once
    #: every this many passes, every sequence due riding along (`Engine`): beside the pass
    #: the call still takes CPU from it where they share cores.
    shadow_interval: int = 4

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.k < 0 or self.max_k < 0 or self.probe_k < 0:
            raise ValueError(f"k, max_k and probe_k must be >= 0, got {self.k}, {self.max_k}, {self.probe_k}")
        if self.probe_interval < 1 or self.shadow_interval < 1:
            raise ValueError(f"probe_interval and shadow_interval must be >= 1, got {self.probe_interval}, "
                             f"{self.shadow_interval}")
        if not 0 <= self.sequence_share <= 1:
            raise ValueError(f"sequence_share must be in [0, 1], got {self.sequence_share}")
        for name in ("acceptance_ewma", "costly_acceptance_ewma", "timing_ewma"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.shadow_latency_share < 0:
            raise ValueError(f"shadow_latency_share must be >= 0, got {self.shadow_latency_share}")
        if not 0 <= self.prior_acceptance <= 1 or not 0 <= self.hysteresis < 1:
            raise ValueError(f"prior_acceptance in [0, 1] and hysteresis in [0, 1) required, "
                             f"got {self.prior_acceptance}, {self.hysteresis}")
        rows = [b for b, _ in self.batch_table]
        if not rows or rows != sorted(rows) or len(set(rows)) != len(rows) or rows[0] != 1 or any(
                k < 0 for _, k in self.batch_table):
            raise ValueError(f"batch_table must be (batch size, k) rows with distinct increasing batch sizes "
                             f"starting at 1 and k >= 0, got {self.batch_table}")


@dataclasses.dataclass(frozen=True)
class SequenceView:
    """What the controller sees of one running sequence."""

    seq_id: str
    #: The request's `speculation.mode`: auto | off | on.
    mode: str = "auto"
    #: The request's pinned method, or None.
    method: str | None = None
    #: The request's cap on k (None: no cap).
    max_k: int | None = None
    #: Tokens the sequence may still emit; a round emits up to k + 1.
    remaining_tokens: int = 1 << 30
    #: Greedy decoding: an unverified draft's acceptance is known from the output alone.
    greedy: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    method: str | None
    k: int
    reason: str
    #: A shadow draft to ask for besides (`shadow_k` tokens of `shadow_method`), compared by
    #: the engine with the tokens the sequence emits next and never verified.
    shadow_method: str | None = None
    shadow_k: int = 0


class StepTimeModel:
    """T(n, b): seconds of one verifier pass over n tokens of b sequences,

        T(n, b) = T_tokens(n) + S(b) + X(b) * (n - b) + Z(b) * min(n - b, 1)   (n > b)

    T_tokens piecewise linear between points measured on one sequence (extrapolated along
    the last segment). S(b) is what b sequences cost beyond one sequence of the same token
    count (their attention over their own contexts, per-sequence work): learned at each
    batch size the verifier runs, `per_seq_s * (b - 1)` (profiled) at those it has not run
    yet. Drafts add tokens, not sequences, so their cost is T_tokens' slope plus X(b), what a
    draft costs beyond it in a pass of b sequences (its attention over its own sequence's
    context, the verification rounds' attention apart from the decodes'): 0 until learned.
    Z(b) is what a pass pays once for verifying any draft at all (its rounds' attention
    runs as groups of its own, their keys and values gathered, in every layer: measured
    at 8 sequences over 300 positions, 24 tokens a pass, 84.0 ms as 8 rounds of 3 against
    86.7-90.4 ms spread as 9-9-1-..., 7-7-5-1-... or 9-5-4-2-1-...): 0 until learned.
    `rows(n)` is the row count a pass of n tokens really runs at (the CPU verifier pads its GEMMs,
    `LlamaModel.gemm_rows`): an integer n is priced at `rows(n)`, so T is flat between
    padded sizes, and a fractional (expected) n between its two integer neighbours.

    `observe` refreshes T by EWMA: a pass of b sequences, one included, corrects S(b) only,
    or, when it reports its draft count d (no prompt prefilled in it), S(b) and X(b)
    together: a least squares line of the error against d over the recent passes at b
    (moments decayed by `fit_decay` per pass), X(b) >= 0 and kept as it is while d has
    varied too little to tell (variance under `FIT_MIN_VAR`). So X(b) is learned where
    drafts come and go. Where the recent passes at b hold both passes without drafts and
    passes with drafts of varied count (each side `FIT_MIN_WEIGHT` passes' weight and
    `FIT_MIN_SHARE` of the whole), the fit adds Z(b): S(b) is then the mean error of the
    passes without drafts, X(b) the slope among those with drafts and Z(b) >= 0 what
    their line lies above S(b). Fitted as one line through both kinds, that step tilts
    the line: on chat at 32 clients in one process, where auto drafted in one pass in
    three, a pass of 1-4 drafts ran 2-3 ms over its price: the first drafts of a pass
    looked cheaper than they were. Elsewhere the line is fitted to the error less the
    last learned Z(b). (S(b) moving while only passes with drafts come, the other side's
    mean goes stale: the move is read as one of Z(b) for the few passes until that
    side's share falls under `FIT_MIN_SHARE`, and undone once passes without drafts come
    back.) A batch size with no X(b) of its own takes it from the nearest that have one
    (linearly between them, flat beyond; Z(b) likewise), and one never run without
    prompts takes S(b) the same way from those that have (with S(1) as the lowest; beyond the largest,
    that one's plus the profiled `per_seq_s` a sequence). The profile's S(b) is one
    sequence's attention times b and far below a batch's: at 32 clients on code_edit in
    one process (`engine-bench --continuous`, every pass logged), the batch sizes first
    met as the run drained were priced at S(21) = 5 ms and X(21) = 0, and their passes
    with drafts at about half what they took (21 sequences and 19 drafts: 73 ms priced,
    213 measured), where the controller drafted the most. The points stay as profiled.
    Corrected by one-sequence passes (as they once were), they followed the
    context of whichever sequence ran alone, and kept T_tokens non-decreasing by raising
    every later point: served on mix at 8 clients, the last requests decoding alone over
    300-400 tokens of context (70-120 ms a pass, against 60 ms profiled at 64) raised T
    from 2 to 64 tokens to one flat 135 ms, which a decode pass of 8 and one of 8 with 24
    drafts then shared, and X(8), the only slope left, rose from 4 to 7 ms a draft.
    Correcting the points, or one shared per-sequence slope, from many-sequence passes is
    not identifiable: at a steady batch of 32 every pass has b = 32, so any error fits
    either term, and wide verification passes that ran slower than priced drove a shared
    slope up until a plain decode step of 32 looked 3x dearer than it is (measured in the
    engine: 13 ms per sequence learned against 0.45 profiled), which made drafts look
    cheap beside it. A pass with no point within 20% of its n (a long prefill) is ignored:
    blaming its error on either term would skew the decode-sized passes the controller
    plans.

    >>> m = StepTimeModel([(1, 0.02), (16, 0.03)], per_seq_s=0.004)
    >>> round(m(8.5), 4), round(m(8.5, b=4), 4)
    (0.025, 0.037)
    >>> padded = StepTimeModel([(1, 0.02), (16, 0.03)], rows=lambda n: 16 if n > 1 else n)
    >>> round(padded(2), 4), round(padded(1.5), 4)
    (0.03, 0.025)
    """

    FIT_MIN_VAR = 4.0  # draft tokens squared
    FIT_MIN_WEIGHT = 3.0  # decayed passes
    FIT_MIN_SHARE = 0.2  # of the decayed passes, on each side

    def __init__(self, points: Sequence[tuple[int, float]], per_seq_s: float = 0.0, ewma: float = 0.2,
                 rows: Callable[[int], int] | None = None, fit_decay: float = 0.05) -> None:
        pts = sorted((int(n), float(t)) for n, t in points)
        if not pts or pts[0][0] < 1 or per_seq_s < 0:
            raise ValueError(f"need points with n >= 1 and per_seq_s >= 0, got {points}, {per_seq_s}")
        self.n = [n for n, _ in pts]
        self.t = [t for _, t in pts]
        self.per_seq_s = per_seq_s
        self.ewma = ewma
        self.rows = rows
        self._rows_s: dict[int, float] = {}  # `_row_s`
        #: S(b) learned from passes of b > 1 sequences (`observe`).
        self.seq_s_by_batch: dict[int, float] = {}
        #: X(b): what a draft token adds beyond T_tokens' slope at b sequences (learned).
        self.draft_s_by_batch: dict[int, float] = {}
        #: Z(b): what verifying any draft adds to a pass of b sequences, once (learned).
        self.drafts_step_s_by_batch: dict[int, float] = {}
        self.fit_decay = fit_decay
        # Per b: decayed moments (weight, d, e, d^2, d e, g, g e) of the draft count d, the
        # error e and g = 1 for a pass with drafts (g d = d: the moments of g d are d's).
        self._moments: dict[int, list[float]] = {}
        for j in range(1, len(self.t)):  # non-decreasing
            self.t[j] = max(self.t[j], self.t[j - 1])

    @classmethod
    def linear(cls, base_s: float, per_token_s: float, max_tokens: int = 4096) -> "StepTimeModel":
        """T(n) = base_s + per_token_s * n, sequences free."""
        return cls([(1, base_s + per_token_s), (max_tokens, base_s + per_token_s * max_tokens)])

    def tokens_s(self, n: float) -> float:
        if self.rows is None:
            return self._interp(n)
        lo = math.floor(n)
        t_lo = self._row_s(lo)
        if n == lo:
            return t_lo
        return t_lo + (self._row_s(lo + 1) - t_lo) * (n - lo)

    def _row_s(self, n: int) -> float:
        """T_tokens at a whole token count, padded to `rows(n)`; remembered, as the points
        never change after `__init__` (a plan prices hundreds of counts)."""
        t = self._rows_s.get(n)
        if t is None:
            t = self._rows_s[n] = self._interp(self.rows(n)) if n >= 1 else self._interp(1)
        return t

    def _interp(self, n: float) -> float:
        ns, ts = self.n, self.t
        if len(ns) == 1:
            return ts[0] * max(n, 1) / ns[0] if n > ns[0] else ts[0]
        if n <= ns[0]:
            return ts[0]
        i = min(bisect.bisect_left(ns, n), len(ns) - 1)
        n0, n1, t0, t1 = ns[i - 1], ns[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def seq_s(self, b: int) -> float:
        """S(b): what b sequences add to a pass beyond the profiled curve of one sequence
        of the same tokens (S(1): what a running sequence's context, and the load, add).
        At a batch size not yet learned from a pass without prompts, interpolated between
        the nearest that are (see the class docstring)."""
        if b < 1:
            return 0.0
        if b in self._moments or not self._moments:
            learned = self.seq_s_by_batch.get(b)
            return self.per_seq_s * (b - 1) if learned is None else learned
        anchors = {k: self.seq_s_by_batch[k] for k in self._moments}
        if 1 not in anchors:
            anchors[1] = self.seq_s_by_batch.get(1, 0.0)
        top = max(anchors)
        if b > top:  # beyond every batch size run: the profiled slope per sequence
            return anchors[top] + self.per_seq_s * (b - top)
        return _between(anchors, b)

    def draft_s(self, b: int) -> float:
        """X(b): what a draft token adds beyond T_tokens' slope in a pass of b sequences
        (interpolated between the batch sizes it is learned at; 0 before any)."""
        return _learned_at(self.draft_s_by_batch, b)

    def drafts_step_s(self, b: int) -> float:
        """Z(b): what verifying any draft adds once to a pass of b sequences (interpolated
        between the batch sizes it is learned at, as X(b); 0 before any)."""
        return _learned_at(self.drafts_step_s_by_batch, b)

    def __call__(self, n: float, b: int = 1) -> float:
        return _priced(self.tokens_s(n), n - b, self.seq_s(b), self.draft_s(b), self.drafts_step_s(b))

    def at_batch(self, b: int) -> Callable[[float], float]:
        """n -> T(n, b), the same values, for one plan's many evaluations at one batch size:
        S(b), X(b) and Z(b) are read once (the model must not learn meanwhile)."""
        seq, draft, step, tokens_s = self.seq_s(b), self.draft_s(b), self.drafts_step_s(b), self.tokens_s
        return lambda n: _priced(tokens_s(n), n - b, seq, draft, step)

    def observe(self, n: int, b: int, seconds: float, num_drafts: int | None = None) -> None:
        """A pass of n tokens of b sequences took `seconds`; `num_drafts`: its draft tokens
        when it prefilled no prompt (None: unknown or a prompt was in it)."""
        n = n if self.rows is None else self.rows(n)
        if min(abs(math.log(p / n)) for p in self.n) > math.log(1.2):
            return
        b = max(b, 1)
        if num_drafts is not None:
            self._fit(b, num_drafts, seconds - self.tokens_s(n))
            return
        # S(b) only; it may go negative (many short contexts beat one long one). Prompt
        # tokens are priced by the token curve alone (profiled on one sequence).
        seq = self.seq_s(b)
        self.seq_s_by_batch[b] = seq + self.ewma * (seconds - self.tokens_s(n) - seq)

    def _fit(self, b: int, d: float, error: float) -> None:
        """S(b), X(b) and Z(b) from the decayed recent passes at b (the first pass at b
        starts from S(b)'s prior, weight 1, as a pass without drafts): see the class
        docstring."""
        m = self._moments.get(b)
        if m is None:
            s0 = self.seq_s(b)
            m = self._moments[b] = [1.0, 0.0, s0, 0.0, 0.0, 0.0, 0.0]
        keep = 1.0 - self.fit_decay
        g = 1.0 if d > 0 else 0.0
        for j, v in enumerate((1.0, d, error, d * d, d * error, g, g * error)):
            m[j] = keep * m[j] + v
        w, sd, se, sdd, sde, sg, sge = m
        # The passes with drafts alone: their weight, mean draft count and error, d's variance.
        mean_d1 = sd / sg if sg > 0 else 0.0
        var_d1 = sdd / sg - mean_d1**2 if sg > 0 else 0.0
        if min(w - sg, sg) >= max(self.FIT_MIN_WEIGHT, self.FIT_MIN_SHARE * w) and var_d1 >= self.FIT_MIN_VAR:
            mean_e1 = sge / sg
            x = self.draft_s_by_batch[b] = max((sde / sg - mean_d1 * mean_e1) / var_d1, 0.0)
            s = self.seq_s_by_batch[b] = (se - sge) / (w - sg)
            self.drafts_step_s_by_batch[b] = max(mean_e1 - x * mean_d1 - s, 0.0)
            return
        # One line through every pass, less the step they paid as last learned.
        z = self.drafts_step_s(b)
        mean_d, mean_e = sd / w, (se - z * sg) / w
        var = sdd / w - mean_d**2
        if var >= self.FIT_MIN_VAR:
            self.draft_s_by_batch[b] = max(((sde - z * sd) / w - mean_d * mean_e) / var, 0.0)
        self.seq_s_by_batch[b] = mean_e - self.draft_s(b) * mean_d

    def points(self) -> list[tuple[int, float]]:
        return list(zip(self.n, self.t))


class ProposerLatency:
    """One method's round trip as a function of the largest k asked in the call,
    L(k) = a + b k: a model proposer runs one pass per draft position (an EAGLE head here:
    ~2.5 ms per draft beside the verifier's ~52 ms decode step, so L(8) is about three
    times L(2)); an n-gram lookup costs about the same for any k.

    Fitted from the recent calls (decayed moments of k and the seconds, weight `ewma`):
    once their k have varied (variance >= `FIT_MIN_VAR`), b is the least-squares slope
    (never negative) and kept while k stops varying; before, the time is taken as
    proportional to k (a = 0), which prices fewer drafts lower than a flat figure would.
    Calls of unknown k update only the plain average, which is L when no call had a k.

    A call in which a sequence catches up on more context than a round emits (its first
    call, which fills a draft model's KV cache with the prompt, a resync, or a return after
    rounds without drafts) is not a round's cost: once it ends, the sequence's later rounds
    cost L(k) again. Such a call is left out of the line (`catch_up`), or, while the method
    has had no other, taken until the first other replaces it. What catching up adds to
    the line, `catch_up_s`, is an EWMA of its own: a fallback's ask (`Controller.fallback_ks`)
    is mostly such a call, since the sequence has drafted with another method since it last
    asked this one. Measured with the Qwen2.5-Coder-0.5B
    draft served (dynamic trees): a sequence's first call took 0.65-1.2 s, its later calls
    about 0.1 s per draft (0.3 s at k = 3); taken in, one first call at k = 5 among calls
    at k = 3 fitted a slope that priced one draft at nothing and three at more than they
    paid, and the controller drafted one token a round through a request whose drafts
    were all accepted.

    >>> lat = ProposerLatency(ewma=0.5)
    >>> lat.observe(0.020, k=8); round(lat(2), 4)  # one call: proportional
    0.005
    >>> lat.observe(0.008, k=2); round(lat(2), 4), round(lat(8), 4)  # the line through both
    (0.008, 0.02)
    >>> lat.observe(0.500, k=2, catch_up=True); round(lat(2), 4)  # left out of the line
    0.008
    >>> round(lat.catch_up_s, 4)  # what catching up added: 0.500 - L(2)
    0.492
    """

    FIT_MIN_VAR = 0.25  # k squared

    def __init__(self, ewma: float) -> None:
        self.ewma = ewma
        #: The plain EWMA of the call's seconds, whatever k (what `Controller.latency_s` reports).
        self.mean_s: float | None = None
        self._moments: list[float] | None = None  # EWMAs of k, k^2, seconds, k * seconds
        #: b once the calls' k have varied; None before (L proportional to k).
        self.slope: float | None = None
        #: Whether every call observed so far was a catch-up (the first other replaces them).
        self.catch_up_only = False
        #: EWMA of what a catch-up call took beyond L(k) (0 until one is seen beside the line).
        self.catch_up_s = 0.0
        self._seen_catch_up = False
        #: Calls of known k since the line was last fitted (their k varied too little since).
        self.calls_since_fit = 0

    def observe(self, seconds: float, k: int | None = None, catch_up: bool = False) -> None:
        if catch_up and self.mean_s is not None and not self.catch_up_only:
            extra = max(seconds - self(k), 0.0)
            self.catch_up_s = extra if not self._seen_catch_up else self.catch_up_s + self.ewma * (
                extra - self.catch_up_s)
            self._seen_catch_up = True
            return
        if self.catch_up_only and not catch_up:
            self.mean_s, self._moments, self.slope, self.calls_since_fit = None, None, None, 0
        self.catch_up_only = catch_up
        w = self.ewma
        self.mean_s = seconds if self.mean_s is None else self.mean_s + w * (seconds - self.mean_s)
        if k is None or k < 1:
            return
        x = (float(k), float(k * k), seconds, k * seconds)
        m = self._moments = list(x) if self._moments is None else [
            old + w * (new - old) for old, new in zip(self._moments, x)]
        mean_k, mean_kk, mean_s, mean_ks = m
        var = mean_kk - mean_k**2
        if var >= self.FIT_MIN_VAR:
            self.slope = max((mean_ks - mean_k * mean_s) / var, 0.0)
            self.calls_since_fit = 0
        else:
            self.calls_since_fit += 1

    @property
    def mean_k(self) -> float | None:
        """The recent calls' average largest k (None before a call of known k)."""
        return None if self._moments is None else self._moments[0]

    def __call__(self, k: int | None = None) -> float:
        """L(k); k None: the plain average."""
        if self.mean_s is None:
            return 0.0
        if k is None or self._moments is None:
            return self.mean_s
        mean_k, _, mean_s, _ = self._moments
        if self.slope is None:
            return mean_s * k / mean_k
        return max(mean_s + self.slope * (k - mean_k), 0.0)


class AcceptanceEstimate:
    """Estimates of the conditional acceptance c(j) at each draft position j = 1..max_k,
    and an EWMA of the share p of asks that returned any draft.

    Each c(j) carries its evidence: how many observations it stands for. The prior a
    method starts from (`prior_acceptance`, a guess) counts as one; a sequence's first
    estimate copies the method-wide one, which counts as `SEQUENCE_PRIOR_OBSERVATIONS` at
    most. An observation adds one and moves c(j) by max(weight, 1 / evidence): a running
    mean while the evidence is thin, the EWMA of `weight` once it is not (a bias-corrected
    EWMA). So a guess gives way to the first observations, and an estimate of many
    observations keeps the EWMA's steadiness. A position with no observation yet (evidence
    1 at most) takes the value of the position before it: a method's acceptance at position
    j + 1 is better guessed by its acceptance at j than by the prior (otherwise a costly
    method whose prior lies below break-even never drafts deep enough to measure the
    positions it does not).

    >>> est = AcceptanceEstimate([0.6] * 4, evidence=[1.0] * 4)
    >>> est.observe(2, 2, weight=0.1)  # a round of 2 drafts, both accepted
    >>> [round(c, 2) for c in est.values()]  # (0.6 + 1) / 2 at positions 1-2, then borrowed
    [0.8, 0.8, 0.8, 0.8]
    >>> est.observe(2, 0, weight=0.1); [round(c, 3) for c in est.values()]  # (0.6 + 1 + 0) / 3
    [0.533, 0.8, 0.8, 0.8]
    """

    __slots__ = ("c", "p", "evidence", "rounds", "toward", "own_share")

    def __init__(self, initial: Sequence[float], p: float = 1.0, evidence: Sequence[float] | None = None) -> None:
        self.c = list(initial)
        self.p = p
        #: Observations each c(j) stands for; None: values known well (plain EWMA).
        self.evidence = [math.inf] * len(self.c) if evidence is None else list(evidence)
        #: Rounds observed by this estimate itself.
        self.rounds = 0
        #: `values` gives toward's value plus `own_share` of this estimate's departure from
        #: it (a sequence's estimate shrunk toward its method-wide one); None: its own.
        self.toward: AcceptanceEstimate | None = None
        self.own_share = 1.0

    def copy(self, max_evidence: float = math.inf) -> "AcceptanceEstimate":
        """A new estimate starting where this one is: its values, and its evidence up to
        `max_evidence` observations a position."""
        return AcceptanceEstimate(self.c, self.p, [min(e, max_evidence) for e in self.evidence])

    def observe(self, k: int, num_accepted: int, weight: float) -> None:
        """A round that drafted k tokens (0: the proposer had none) and accepted the first
        `num_accepted`: positions 1..num_accepted saw an acceptance, position
        num_accepted + 1 (if <= k) a rejection, later positions nothing."""
        self.rounds += 1
        self.p += weight * ((1.0 if k else 0.0) - self.p)
        n = min(num_accepted + 1, k, len(self.c))
        for j, taken in enumerate(self.own_values(n)):
            self.c[j] = taken  # a position never observed starts from the one before it
            x = 1.0 if j < num_accepted else 0.0
            self.evidence[j] += 1.0
            self.c[j] += max(weight, 1.0 / self.evidence[j]) * (x - self.c[j])

    def measured(self) -> bool:
        """Whether it rests on more than a new sequence's prior: rounds of its own, or a
        first position of more evidence than the prior (an estimate given as well known)."""
        return self.rounds > 0 or self.evidence[0] > SEQUENCE_PRIOR_OBSERVATIONS

    def seen(self, j: int) -> bool:
        """Whether position j + 1's estimate rests on any observation."""
        return self.evidence[j] > 1.0

    def values(self, k: int | None = None) -> list[float]:
        """c(1..k) (default: every position) as the controller uses them: the estimate,
        or for a position never observed the value of the one before it, shrunk toward
        `toward`'s when there is one."""
        out = self.own_values(k)
        if self.toward is None or self.own_share == 1.0:
            return out
        return [self._shrunk(c, g) for c, g in zip(out, self.toward.values(len(out)))]

    def believed_p(self) -> float:
        """p as `values` gives c: `toward`'s plus `own_share` of this estimate's departure
        from it. A sequence's own p, an EWMA of 0.3 a round, falls to nothing over a dozen
        rounds without a match (n-gram on chat: 0.002 within 20 rounds of one request)
        while matches come again later."""
        if self.toward is None or self.own_share == 1.0:
            return self.p
        return self._shrunk(self.p, self.toward.p)

    def _shrunk(self, own: float, toward: float) -> float:
        """`toward` plus `own_share` of `own`'s departure from it."""
        return toward + self.own_share * (own - toward)

    def own_values(self, k: int | None = None) -> list[float]:
        out: list[float] = []
        for j in range(len(self.c) if k is None else k):
            out.append(self.c[j] if self.seen(j) or not j else out[-1])
        return out

    def alphas(self, k: int) -> list[float]:
        """alpha(1..k): probability that the first j drafts are all accepted."""
        out, a = [], 1.0
        for c in self.values(k):
            a *= c
            out.append(a)
        return out

    def expected_tokens(self, k: int) -> float:
        return 1.0 + self.p * sum(self.alphas(k))


@dataclasses.dataclass
class _SeqState:
    by_method: dict[str, AcceptanceEstimate] = dataclasses.field(default_factory=dict)
    #: Whether the last auto decision gave drafts (for hysteresis), and if not, why.
    on: bool = True
    off_reason: str = ""
    #: Whether it was turned off on its own measurements (else on the method-wide prior
    #: alone, before it drafted: no hysteresis then, there is no flip-flop to damp, and
    #: probes come sooner).
    off_measured: bool = True
    #: Rounds since the sequence last drafted (or shadow-drafted) with each method.
    idle: dict[str, int] = dataclasses.field(default_factory=dict)


class Controller:
    """Decides (method, k) per sequence each round; see the module docstring.

    `methods` lists the configured proposal methods in preference order (ties go to the
    earlier one). `step_time` is the verifier's T(n); `goodput` needs one, the engine
    profiles it at start when it is missing.
    """

    def __init__(self, settings: ControllerSettings | None = None, methods: Sequence[str] = (),
                 step_time: StepTimeModel | None = None) -> None:
        self.settings = settings or ControllerSettings()
        self.step_time = step_time
        s = self.settings
        self._max_positions = max(s.max_k, s.k, s.probe_k, max(k for _, k in s.batch_table), 1)
        # Method-wide estimates: the prior of every new sequence.
        self._global: dict[str, AcceptanceEstimate] = {}
        self.set_methods(methods)
        self._latency: dict[str, ProposerLatency] = {}
        self._seqs: dict[str, _SeqState] = {}
        #: Per method, the drafts per depth of its last token tree (`trim`'s `levels`).
        self._levels: dict[str, list[int]] = {}
        #: `_cheap` per method while `plan` runs (nothing it reads changes meanwhile).
        self._cheap_memo: dict[str, bool] | None = None
        #: Rounds planned, and per costly method the last round that probed it.
        self._round = 0
        self._probe_round: dict[str, int] = {}
        #: Decisions since start, by reason (the source of the controller metrics).
        self.decisions: collections.Counter[str] = collections.Counter()

    def set_methods(self, methods: Sequence[str]) -> None:
        """The configured methods, in preference order (the engine sets them from its proposers)."""
        s = self.settings
        self.methods = tuple(methods)
        for m in self.methods:
            self._global.setdefault(m, AcceptanceEstimate([s.prior_acceptance] * self._max_positions,
                                                           evidence=[1.0] * self._max_positions))

    @classmethod
    def off(cls) -> "Controller":
        return cls(ControllerSettings(policy="off"))

    @classmethod
    def static(cls, k: int, methods: Sequence[str] = ()) -> "Controller":
        return cls(ControllerSettings(policy="static", k=k), methods)

    @property
    def needs_step_time(self) -> bool:
        return self.settings.policy == "goodput" and self.step_time is None

    # ------------------------------------------------------------------ observations
    def observe_round(self, seq_id: str, method: str, num_drafted: int, num_accepted: int) -> None:
        """A round in which `method` returned `num_drafted` drafts (0: it had none) for the
        sequence and the verifier accepted the first `num_accepted`."""
        if method not in self._global:
            return
        k = num_drafted
        assert 0 <= num_accepted <= k, f"{num_accepted=} {k=}"
        s = self.settings
        w = s.acceptance_ewma if self._cheap(method) else s.costly_acceptance_ewma
        self._estimate(self._state(seq_id), method).observe(k, num_accepted, w)
        # The method-wide prior moves slower: it summarises many sequences.
        self._global[method].observe(k, num_accepted, w / 4)

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float, num_drafts: int | None = None) -> None:
        """A verifier pass over `num_tokens` tokens of `num_seqs` sequences took `seconds`;
        `num_drafts`: its draft tokens when it prefilled no prompt (None otherwise)."""
        if self.step_time is not None and num_tokens > 0:
            self.step_time.observe(num_tokens, num_seqs, seconds, num_drafts)

    def observe_proposer(self, method: str, seconds: float, k: int | None = None, catch_up: bool = False) -> None:
        """A proposer round trip (a failure counts as the time it took to fail); `k`: the
        largest k asked in the call; `catch_up`: a sequence in it caught up on more context
        than a round emits (`ProposerLatency`)."""
        lat = self._latency.get(method)
        if lat is None:
            lat = self._latency[method] = ProposerLatency(self.settings.timing_ewma)
        lat.observe(seconds, k, catch_up)

    def latency_s(self, method: str, k: int | None = None) -> float:
        """The method's round trip for a call whose largest k is `k` (None: the average call)."""
        lat = self._latency.get(method)
        return 0.0 if lat is None else lat(k)

    def proposer_slope_s(self, method: str) -> float | None:
        """What each further draft adds to the method's call, once its k have varied (else None)."""
        lat = self._latency.get(method)
        return None if lat is None else lat.slope

    def _calls_s(self, methods: Mapping[str, int]) -> float:
        """The slowest of the calls {method: largest k} (they run in parallel)."""
        return max((self.latency_s(m, k) for m, k in methods.items()), default=0.0)

    def tokens(self, method: str | None, k: int) -> int:
        """Draft tokens a round of depth k costs the pass with `method`: k for a chain, the
        nodes of depths 1..k of the method's last tree (its deepest level repeated below).

        >>> c = Controller(methods=("eagle",)); c.tokens("eagle", 3)
        3
        >>> _ = c.trim([("s", "eagle", 2, "static")], levels=[[3, 6]]); c.tokens("eagle", 3)
        15
        """
        if method is None or not self._levels.get(method):
            return k  # a chain (no tree seen): one token a depth
        return sum(self._level(method, j) for j in range(k))

    def _level(self, method: str, j: int) -> int:
        """Draft tokens at depth j + 1 of `method`'s rounds (1 for a chain)."""
        levels = self._levels.get(method)
        if not levels:
            return 1
        return levels[j] if j < len(levels) else levels[-1]

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def acceptance(self, seq_id: str, method: str, believed: bool = False) -> list[float]:
        """The sequence's conditional acceptance per position for `method` (a copy): its own
        estimate, or with `believed` as the decisions use it (a cheap method's shrunk toward
        the method-wide estimate, `ControllerSettings.sequence_share`)."""
        est = self._estimate(self._state(seq_id), method)
        return est.values() if believed else est.own_values()

    def _state(self, seq_id: str) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqState()
        return state

    def _estimate(self, state: _SeqState, method: str) -> AcceptanceEstimate:
        est = state.by_method.get(method)
        if est is None:
            est = state.by_method[method] = self._global[method].copy(SEQUENCE_PRIOR_OBSERVATIONS)
        est.toward = self._global[method]
        est.own_share = self.settings.sequence_share if self._cheap(method) else 1.0
        return est

    # ------------------------------------------------------------------ planning
    def plan(self, seqs: Sequence[SequenceView], available: Mapping[str, bool] | None = None,
             num_prefill_tokens: int = 0, num_prefill_seqs: int = 0) -> list[Decision]:
        """One decision per sequence, in order. `available[m]` False: method m has no live
        proposer right now. `num_prefill_*`: prompts prefilled in the same pass."""
        self._cheap_memo = {}
        try:
            return self._plan(seqs, available, num_prefill_tokens, num_prefill_seqs)
        finally:
            self._cheap_memo = None

    def _plan(self, seqs: Sequence[SequenceView], available: Mapping[str, bool] | None,
              num_prefill_tokens: int, num_prefill_seqs: int) -> list[Decision]:
        live = [m for m in self.methods if available is None or available.get(m, False)]
        s = self.settings
        self._round += 1
        decisions: list[Decision | None] = [None] * len(seqs)
        auto: list[int] = []  # sequences the policy decides
        for i, v in enumerate(seqs):
            state = self._state(v.seq_id)
            for m in live:
                state.idle[m] = state.idle.get(m, 0) + 1
            cap = self._cap(v)
            if v.mode == "off" or v.max_k == 0:
                decisions[i] = Decision(None, 0, "request_off")
            elif cap == 0:
                decisions[i] = Decision(None, 0, "length")
            elif s.policy == "off" and v.mode != "on":  # off whatever proposers there are
                decisions[i] = Decision(None, 0, "policy_off")
            elif not (live if v.method is None else [m for m in live if m == v.method]):
                decisions[i] = Decision(None, 0, "proposer_unavailable")
            elif v.mode == "on":
                decisions[i] = self._fixed(v, live, v.max_k or s.k, "request_on")
            elif s.policy == "static":
                decisions[i] = self._fixed(v, live, s.k, "static")
            elif s.policy == "batch_table":
                row = bisect.bisect_right([b for b, _ in s.batch_table], len(seqs)) - 1
                decisions[i] = self._fixed(v, live, s.batch_table[row][1], "batch_table")
            else:
                auto.append(i)
        if auto:
            self._goodput(seqs, auto, decisions, live, self._pass_time(len(seqs), num_prefill_tokens, num_prefill_seqs))
        out = [d for d in decisions if d is not None]
        assert len(out) == len(seqs), f"{len(out)=} {len(seqs)=}"
        for d in out:
            self.decisions[d.reason] += 1
        return out

    def fallback_ks(self, rounds: Sequence[tuple[str, str | None, int, str]], asks: Sequence[tuple[int, str, int]],
                    num_prefill_tokens: int = 0, num_prefill_seqs: int = 0,
                    catch_ups: Sequence[bool] | None = None) -> list[int]:
        """How many drafts to ask each fallback for (`Engine.fallbacks`), once the methods
        have answered: `rounds` as `trim` takes them (every running sequence: seq_id, method,
        drafts received, reason), `asks[i]` = (index into `rounds` of a sequence whose method
        had no draft, the fallback, the most it may be asked). Each ask gets the k <= its
        most that maximises the pass's goodput, (E + alpha(1) + ... + alpha(k)) /
        (T(n + tokens(k)) + L(k)), E and n the expected tokens and the tokens of the pass
        with the drafts already received and the asks before it; 0 when none beats no
        draft. `catch_ups[i]`: the ask's sequence is behind on the fallback's context (it
        drafted with another method since), so the call costs L(k) plus the method's
        `ProposerLatency.catch_up_s`. Every most as it is before the step time is known."""
        if self.step_time is None:
            return [k for _, _, k in asks]
        t = self._pass_time(len(rounds), num_prefill_tokens, num_prefill_seqs)
        tokens = float(len(rounds) + sum(n for _, _, n, _ in rounds))
        expected = float(len(rounds)) + sum(
            sum(self._estimate(self._state(seq_id), m).alphas(min(n, self._max_positions)))
            for seq_id, m, n, _ in rounds if n and m in self._global)
        out = []
        for n, (i, method, most) in enumerate(asks):
            alphas = self._estimate(self._state(rounds[i][0]), method).alphas(min(most, self._max_positions))
            lat = self._latency.get(method)
            extra = lat.catch_up_s if lat is not None and catch_ups is not None and catch_ups[n] else 0.0
            best = self._best_prefix(
                [(a, 1.0, i, method, self._level(method, j)) for j, a in enumerate(alphas)],
                lambda gained, added, methods: (expected + gained) / (
                    t(tokens + added) + self._calls_s(methods) + (extra if methods else 0.0)))[i]
            tokens += self.tokens(method, best)
            expected += sum(alphas[:best])
            out.append(best)
        return out

    def trim(self, rounds: Sequence[tuple[str, str | None, int, str]], num_prefill_tokens: int = 0,
             num_prefill_seqs: int = 0, levels: Sequence[Sequence[int] | None] | None = None) -> list[int]:
        """Once the proposers have answered: how many of each sequence's draft positions
        (a tree's depths) to verify.

        `rounds[i]` is (seq_id, method, draft positions received, the decision's reason)
        for every running sequence of the pass; `levels[i]`, for a token tree, its drafts
        at each depth (None: a chain, one each). Only `goodput` decisions are cut, by the
        same maximisation as `plan`, now knowing which sequences have drafts and how many
        (p = 1 for those, nothing for the rest); the proposers' time is spent by now and
        does not count. Other decisions keep every draft they received."""
        out = [n for _, _, n, _ in rounds]
        sizes = [[1] * n if levels is None or levels[i] is None else list(levels[i])
                 for i, (_, _, n, _) in enumerate(rounds)]
        for (_, method, n, _), lv in zip(rounds, levels or ()):
            if lv is not None and method is not None:
                self._levels[method] = list(lv)
        if self.step_time is None or not any(n and reason == "goodput" for _, _, n, reason in rounds):
            return out  # nothing to cut (static policies: every round)
        t = self._pass_time(len(rounds), num_prefill_tokens, num_prefill_seqs)
        fixed_tokens = float(len(rounds) + sum(sum(lv[:n]) for (_, _, n, _), lv in zip(rounds, sizes)))
        fixed_expected = float(len(rounds))
        candidates: list[tuple[float, float, int, str, int]] = []
        for i, (seq_id, method, n, reason) in enumerate(rounds):
            if n == 0 or method not in self._global:
                continue
            alphas = self._estimate(self._state(seq_id), method).alphas(min(n, self._max_positions))
            if reason != "goodput":
                fixed_expected += sum(alphas)
                continue
            fixed_tokens -= sum(sizes[i][:n])
            out[i] = 0
            candidates.extend((a, 1.0, i, method, sizes[i][j]) for j, a in enumerate(alphas))
        ks = self._best_prefix(candidates, lambda gained, tokens, methods: (
            (fixed_expected + gained) / t(fixed_tokens + tokens)))
        for i, k in ks.items():
            out[i] = k
        return out

    @staticmethod
    def _best_prefix(candidates: list[tuple[float, float, int, str, int]], goodput,
                     longest: bool = False) -> collections.Counter[int]:
        """Draft positions per sequence maximising `goodput(gained, tokens, methods)`:
        `candidates` are (marginal alpha, p, sequence, method, tokens of the position: 1,
        or a tree depth's nodes), each sequence's alphas non-increasing; positions go in
        decreasing alpha and the best prefix is kept (exact for any T of the token count
        when every position is one token; with trees, a depth's cost is not in the order).
        `methods` maps each method of the prefix to the largest k it asks of a sequence.
        `longest`: the longest prefix that beats no draft instead. Empty when no draft
        beats none."""
        candidates = sorted(candidates, key=lambda c: -c[0])
        best_d, best_g = 0, goodput(0.0, 0.0, {})
        base_g = best_g
        gained, tokens = 0.0, 0.0
        methods: dict[str, int] = {}
        per_seq: collections.Counter[int] = collections.Counter()
        for d, (a, p, i, m, w) in enumerate(candidates, start=1):
            gained += p * a
            tokens += p * w
            per_seq[i] += 1
            methods[m] = max(methods.get(m, 0), per_seq[i])
            g = goodput(gained, tokens, methods)
            if g > best_g or (longest and g > base_g):
                best_d, best_g = d, max(g, best_g)
        return collections.Counter(i for _, _, i, _, _ in candidates[:best_d])

    def _cap(self, v: SequenceView) -> int:
        cap = max(v.remaining_tokens - 1, 0)  # a round emits up to k + 1 tokens
        cap = min(cap, self._max_positions)
        return cap if v.max_k is None else min(cap, v.max_k)

    def _fixed(self, v: SequenceView, live: list[str], k: int, reason: str) -> Decision:
        """A fixed k (capped as every k is); a k of 0 (`static` k 0, a `batch_table` row of
        0) is counted as `policy_off`, a reason of a round without drafts."""
        if k == 0:
            return Decision(None, 0, "policy_off")
        k = min(k, self._cap(v))
        method = self._choose_method(v, live)
        self._mark(v.seq_id, method, on=True)
        return Decision(method, k, reason)

    def _choose_method(self, v: SequenceView, live: list[str]) -> str:
        """The pinned method, else the live one with the best solo goodput for this
        sequence: max over k of E[tokens(k)] / (T(k + 1) + L(k))."""
        if v.method is not None:
            return v.method
        if len(live) == 1:
            return live[0]
        state = self._state(v.seq_id)
        cap = max(min(self._cap(v), self.settings.max_k), 1)
        t = self.step_time or StepTimeModel([(1, 1.0)])

        def score(m: str) -> float:
            est = self._estimate(state, m)
            return max(est.expected_tokens(k) / (t(1 + est.p * self.tokens(m, k)) + self.latency_s(m, k))
                       for k in range(1, cap + 1))

        return max(live, key=lambda m: (score(m), -live.index(m)))

    def _mark(self, seq_id: str, method: str | None, on: bool) -> None:
        state = self._state(seq_id)
        state.on = on
        if method is not None:
            state.idle[method] = 0

    def _pass_time(self, num_seqs: int, num_prefill_tokens: int, num_prefill_seqs: int) -> Callable[[float], float]:
        """This pass's time as the drafts are priced, over n tokens of the `num_seqs` running
        sequences (one each plus drafts): their decode pass, T(num_seqs), plus what the
        drafts add to the real pass, prompts prefilled beside them included: there, the
        token curve's rise alone (see the module docstring). `num_prefill_seqs` does not
        change the price (the sequences' cost S(b) is the same with and without drafts)."""
        T = self.step_time
        assert T is not None, "policy goodput needs a step-time model (Engine.profile_step_time)"
        if not num_prefill_tokens:
            return _memo(T.at_batch(num_seqs))
        base = T(num_seqs, num_seqs)
        full = T.tokens_s(num_prefill_tokens + num_seqs)
        return _memo(lambda n: base + T.tokens_s(num_prefill_tokens + n) - full)

    def _goodput(self, seqs: Sequence[SequenceView], auto: list[int], decisions: list[Decision | None],
                 live: list[str], t: Callable[[float], float]) -> None:
        """`t`: the pass's time over the running sequences' n tokens (`_pass_time`)."""
        s = self.settings
        # Tokens and expected emissions that are already fixed (other decisions, probes).
        fixed_tokens = float(len(seqs))
        fixed_expected = float(len(seqs))
        fixed_methods: dict[str, int] = {}  # method -> the largest k asked of it
        for d in decisions:
            if d is not None and d.k > 0:
                fixed_tokens += self.tokens(d.method, d.k)
                _ask(fixed_methods, d.method, d.k)
        # Candidates: (marginal alpha, p, auto index, method, tokens); alpha per sequence non-increasing.
        candidates: list[tuple[float, float, int, str, int]] = []
        cheap: list[tuple[int, str, AcceptanceEstimate, float, int]] = []
        chosen: dict[int, str] = {}
        caps: dict[int, int] = {}  # of the sequences the maximisation decides (not probed)
        # The probes admitted so far: their drafts' tokens in the pass and the most they can emit.
        probe_tokens = probe_emit = 0.0
        base_tokens, base_expected = fixed_tokens, fixed_expected
        base_goodput = base_expected / (t(base_tokens) + self._calls_s(fixed_methods))

        def affordable(method: str, k: int) -> bool:
            # Would this round's probes, this one included, pay if every draft were accepted?
            calls = dict(fixed_methods)
            _ask(calls, method, k)
            tokens = base_tokens + probe_tokens + self.tokens(method, k)
            return (base_expected + probe_emit + k) / (t(tokens) + self._calls_s(calls)) > base_goodput

        for i in auto:
            v = seqs[i]
            state = self._state(v.seq_id)
            method = self._choose_method(v, live)
            chosen[i] = method
            probe = self._probe(v, state, live, method, affordable)
            if probe is not None:
                decisions[i] = probe
                self._mark(v.seq_id, probe.method, on=state.on)
                est = self._estimate(state, probe.method)
                fixed_tokens += est.p * self.tokens(probe.method, probe.k)
                fixed_expected += est.p * sum(est.alphas(probe.k))
                probe_tokens += self.tokens(probe.method, probe.k)
                probe_emit += probe.k
                _ask(fixed_methods, probe.method, probe.k)
                continue
            cap = caps[i] = min(self._cap(v), s.max_k)
            est = self._estimate(state, method)
            scale = 1.0 if state.on or not state.off_measured else 1.0 - s.hysteresis
            if self._cheap(method):
                cheap.append((i, method, est, scale, cap))
            else:
                candidates.extend((a * scale, est.p, i, method, self._level(method, j))
                                  for j, a in enumerate(est.alphas(cap)))

        calls_s: dict[tuple, float] = {}  # the calls' time by (fixed asks, asks): a walk repeats them

        def goodput(gained: float, tokens: float, methods: dict[str, int]) -> float:
            # Over what is fixed when it is called (the cheap asks are fixed before the rest).
            key = (tuple(fixed_methods.items()), tuple(methods.items()))
            seconds = calls_s.get(key)
            if seconds is None:
                calls = dict(fixed_methods)
                for m, k in methods.items():
                    _ask(calls, m, k)
                seconds = calls_s[key] = self._calls_s(calls)
            return (fixed_expected + gained) / (t(fixed_tokens + tokens) + seconds)

        # A cheap method is asked for the whole cap whenever its drafts would pay, assuming
        # its proposer has one: asking costs next to nothing, and `trim` shares the pass out
        # once the drafts (or their absence) are known. Whether they pay is judged over every
        # cheap sequence together: on a step-shaped T a full batch pads a single draft to a
        # whole step of rows, which no sequence's drafts pay for alone but a batch's do.
        given_they_come = [(a * scale, 1.0, i, method, self._level(method, j))
                           for i, method, est, scale, cap in cheap for j, a in enumerate(est.alphas(cap))]
        asked = self._best_prefix(given_they_come, goodput, longest=True)
        # But the call holds the pass back by its round trip, which pays only if drafts come
        # often enough: a method not called this round anyway is asked only if the drafts
        # that would pay given that they come (the best prefix), each weighed by its
        # sequence's share p of asks that return one, beat no call (`_pays_for_call`);
        # `proposer_slow` otherwise, and shadow drafts, called beside the pass, keep measuring.
        slow: set[int] = set()
        for m in dict.fromkeys(method for _, method, _, _, _ in cheap):
            mine = [(i, est, scale, cap) for i, method, est, scale, cap in cheap if method == m and asked[i]]
            if mine and m not in fixed_methods and not self._pays_for_call(
                    m, mine, [c for c in given_they_come if c[3] == m and asked[c[2]]], goodput, t, fixed_tokens,
                    fixed_expected, fixed_methods):
                slow.update(i for i, _, _, _ in mine)
        generous = {i: cap for i, _, _, _, cap in cheap if asked[i] and i not in slow}
        for i, method, est, _, cap in cheap:
            if i in generous:
                fixed_tokens += est.p * self.tokens(method, cap)
                fixed_expected += est.p * sum(est.alphas(cap))
                _ask(fixed_methods, method, cap)

        ks = self._best_prefix(candidates, goodput)
        self._explore_k(ks, chosen, caps)
        best_d = sum(ks.values()) + len(generous)
        reasons: dict[str, str] = {}
        # Whether drafts would pay if all were accepted is asked of the batch's drafts
        # together, as whether they pay is (one draft alone may pad a whole step).
        total_cap = sum(caps.values())
        for i in auto:
            if decisions[i] is not None:
                continue  # a probe
            v = seqs[i]
            state = self._state(v.seq_id)
            cap = caps[i]
            other = self._shadow_other(v, state, live, chosen[i])
            k = generous.get(i, ks[i])
            if k:
                decisions[i] = Decision(chosen[i], k, "goodput", other, cap if other else 0)
                self._mark(v.seq_id, chosen[i], on=True)
                continue
            if state.on:
                state.off_measured = self._estimate(state, chosen[i]).measured()
            self._mark(v.seq_id, None, on=False)
            key = chosen[i]
            if best_d == 0 and key not in reasons and i not in slow:
                # k drafts of the batch: at least ceil(k / sequences) from one of them.
                reasons[key] = self._why_nobody(t, total_cap, lambda k, m=key: self.latency_s(m, -(-k // len(caps))),
                                                fixed_expected, fixed_tokens, self._calls_s(fixed_methods),
                                                lambda k, m=key: self._batch_tokens(m, k, len(caps)))
            # With drafts elsewhere in the batch, others' drafts were simply worth more.
            reason = "proposer_slow" if i in slow else "low_acceptance" if best_d > 0 else reasons[key]
            state.off_reason = reason
            if reason in SHADOW_REASONS and self._can_shadow(v, other or chosen[i]):
                decisions[i] = Decision(None, 0, reason, other or chosen[i], cap)
            else:
                decisions[i] = Decision(None, 0, reason)

    def _pays_for_call(self, method: str, asks: list[tuple[int, AcceptanceEstimate, float, int]],
                       candidates: list[tuple[float, float, int, str, int]], goodput,
                       t: Callable[[float], float], tokens: float, expected: float,
                       methods: Mapping[str, int]) -> bool:
        """Whether calling cheap `method` for `asks` (auto index, estimate, hysteresis scale,
        cap) beats not calling it, in expectation: the drafts of the best prefix of their
        `candidates` (the positions `_goodput` walked, p = 1: given that they come), each
        sequence's weighed by its p (shrunk toward the method-wide p like its acceptance,
        `AcceptanceEstimate.believed_p`), and the pass's time
        the chord from no drafts to all of them, t(n) + p (t(n + w) - t(n)) with p their
        token-weighted mean: exact for one sequence on any T (a draft comes or not), and
        for many on a straight one. The curve at n + p w instead would spread a draft that
        comes one round in ten over a step of T (see the module docstring)."""
        best = self._best_prefix(candidates, goodput)
        gained = weighed = drafts = 0.0
        for i, est, scale, _ in asks:
            k = best[i]
            w = float(self.tokens(method, k))
            p = est.believed_p()
            gained += p * scale * sum(est.alphas(k))
            weighed += p * w
            drafts += w
        if not drafts:
            return False
        calls = dict(methods)
        _ask(calls, method, max(cap for _, _, _, cap in asks))
        base = t(tokens)
        with_call = (expected + gained) / (base + weighed / drafts * (t(tokens + drafts) - base) + self._calls_s(calls))
        return with_call > expected / (base + self._calls_s(methods))

    def _explore_k(self, ks: collections.Counter[int], chosen: Mapping[int, str], caps: Mapping[int, int]) -> None:
        """Until a costly method's call line is known (`ProposerLatency`: its calls' k have
        not varied), a call is priced proportional to k from calls of one k. A head whose
        call takes 12 ms at k = 1, nearly all of it fixed, then looks 36 ms at k = 3 where
        it takes 13: the controller keeps asking k = 1, so k never varies and the price is
        never corrected (served, `bench-cpu-all.yaml`, chat at 1 client: the EAGLE-3 head
        was asked 1.1 drafts a round, against its 2.9 at `static:3`). So in a round that
        asks such a method nothing beyond its recent calls' k, its sequence with the most
        drafts is asked `EXPLORE_DRAFTS` more, within its cap: `trim` still verifies only
        the drafts that pay, and the call's time puts a second point on the line (one such
        call fits it: with `timing_ewma` 0.2, calls at k and k + 2 give k a variance of
        0.64 >= `ProposerLatency.FIT_MIN_VAR`).

        A fitted line is kept while k stops varying, so one slow exploring call would price
        every further draft high for good (served, the same config: one check learned 8.7 ms
        a draft for the EAGLE-3 head, another 2.8 ms, which did not move over 24
        requests), and the controller, asking few drafts, would never move k again. So a
        line not re-fitted for `REFIT_CALLS` calls is explored the same way: two drafts
        more in one call of 32, each refit replacing the last."""
        by_method: dict[str, int] = {}  # method -> its sequence with the most drafts
        for i, k in ks.items():
            if k and (chosen[i] not in by_method or k > ks[by_method[chosen[i]]]):
                by_method[chosen[i]] = i
        for method, i in by_method.items():  # costly methods only: cheap ones are not in `ks`
            lat = self._latency.get(method)
            if lat is None or lat.mean_k is None or ks[i] >= lat.mean_k + 1 or (
                    lat.slope is not None and lat.calls_since_fit < REFIT_CALLS):
                continue
            ks[i] = min(ks[i] + EXPLORE_DRAFTS, caps[i])

    def _batch_tokens(self, method: str, k: int, num_seqs: int) -> int:
        """The fewest tokens in which `num_seqs` sequences verify k drafting positions of
        `method` between them: k for a chain; for token trees, depth 1 of k sequences first
        (one tree level each), then depth 2, and so on."""
        full, rest = divmod(k, max(num_seqs, 1))
        return num_seqs * self.tokens(method, full) + rest * self._level(method, full)

    @staticmethod
    def _why_nobody(t, cap: int, method_latency: Callable[[int], float], expected: float, tokens: float,
                    latency: float, draft_tokens: Callable[[int], float]) -> str:
        """Why no sequence drafts: would k drafts pay if all were accepted (k up to `cap`,
        the batch's caps together; `method_latency(k)` the method's round trip for them,
        `draft_tokens(k)` the tokens they add to the pass: k, or a tree's nodes)? If not
        even with a free proposer, verifying them costs more than they give (compute
        bound); if only with a free proposer, the proposer is too slow; else acceptance is
        low."""
        base = expected / (t(tokens) + latency)

        def pays(lat: Callable[[int], float]) -> bool:
            # A 0.1% margin: a break-even (T linear through 0, all accepted) does not pay.
            return any((expected + k) / (t(tokens + draft_tokens(k)) + lat(k)) > base * 1.001
                       for k in range(1, cap + 1))

        if not pays(lambda k: latency):
            return "batch_compute_bound"
        if not pays(lambda k: max(latency, method_latency(k))):
            return "proposer_slow"
        return "low_acceptance"

    def _cheap(self, method: str) -> bool:
        """A method whose round trip for `max_k` drafts is at most `shadow_latency_share` of
        a lone decode step (e.g. n-gram lookup): asking it for more drafts than get verified
        is free."""
        memo = self._cheap_memo
        if memo is not None and method in memo:
            return memo[method]
        s = self.settings
        cheap = self.step_time is not None and (
            self.latency_s(method, max(s.max_k, 1)) <= s.shadow_latency_share * self.step_time(1))
        if memo is not None:
            memo[method] = cheap
        return cheap

    def _can_shadow(self, v: SequenceView, method: str) -> bool:
        """Shadow drafts need greedy decoding (to score them from the output alone) and a
        cheap method: its round trip at most `shadow_latency_share` of a lone decode step
        (shadows cost the proposer the same as verified drafts)."""
        return v.greedy and self.settings.shadow and self._cheap(method)

    def _shadow_other(self, v: SequenceView, state: _SeqState, live: list[str], chosen: str) -> str | None:
        """A method other than `chosen` that the sequence has not used or shadowed for
        `probe_interval` rounds and may shadow (its idle count restarts), else None."""
        if v.method is not None:
            return None
        for m in live:
            if m != chosen and state.idle.get(m, 0) >= self.settings.probe_interval and self._can_shadow(v, m):
                state.idle[m] = 0
                return m
        return None

    def _probe(self, v: SequenceView, state: _SeqState, live: list[str], chosen: str,
               affordable: Callable[[str, int], bool]) -> Decision | None:
        """A cheap draft for an off sequence (has its acceptance recovered?) or for a method
        the sequence has not used lately (is it better now?), once per `probe_interval`;
        none where shadow drafts measure the same for free, nor where the round's probes
        would not pay even if all their drafts were accepted (`affordable`: e.g. token
        trees in a full batch, where each probe adds a tree's nodes to the pass)."""
        s = self.settings
        k = min(s.probe_k, self._cap(v), s.max_k)
        if k == 0:
            return None
        if not state.on:
            # Only an acceptance-driven off is worth re-measuring: a compute-bound batch
            # stays compute bound whatever this sequence's acceptance. A sequence turned off
            # by the method-wide estimate alone, before it drafted (e.g. a costly method whose
            # estimate lies below break-even), has little evidence of its own: it is probed
            # at once, then after 2, 4, ... rounds up to `probe_interval`.
            gap = s.probe_interval if state.off_measured else min(
                s.probe_interval, 2 ** self._estimate(state, chosen).rounds)
            if (state.off_reason != "batch_compute_bound" and state.idle.get(chosen, 0) >= gap
                    and not self._can_shadow(v, chosen) and affordable(chosen, k) and self._probe_call(chosen, gap)):
                return Decision(chosen, k, "probe")
            return None
        if v.method is None:
            for m in live:
                if (m != chosen and state.idle.get(m, 0) >= s.probe_interval and not self._can_shadow(v, m)
                        and affordable(m, k) and self._probe_call(m)):
                    return Decision(m, k, "probe")
        return None

    def _probe_call(self, method: str, gap: int | None = None) -> bool:
        """Whether a due probe of `method` goes in this round's call: always for a cheap
        method; for a costly one, in a round that already probes it, or once `gap`
        (default `probe_interval`) rounds have passed since the last round that did (which
        this round then becomes)."""
        if self._cheap(method):
            return True
        last = self._probe_round.get(method)
        if last == self._round:
            return True
        if last is not None and self._round - last < (self.settings.probe_interval if gap is None else gap):
            return False
        self._probe_round[method] = self._round
        return True


def _memo(f: Callable[[float], float]) -> Callable[[float], float]:
    """f remembering its values: a round's walks evaluate the pass's time at the same token
    counts again and again (a full batch of 32 has 256 draft positions to walk)."""
    values: dict[float, float] = {}

    def remembered(n: float) -> float:
        v = values.get(n)
        if v is None:
            v = values[n] = f(n)
        return v

    return remembered


def _priced(tokens_s: float, drafts: float, seq_s: float, draft_s: float, step_s: float) -> float:
    """T(n, b) from its terms: T_tokens(n), n - b, S(b), X(b) and Z(b) (`StepTimeModel`)."""
    drafts = max(drafts, 0.0)
    return max(tokens_s + seq_s + draft_s * drafts + step_s * min(drafts, 1.0), 1e-6)


def _learned_at(values: Mapping[int, float], b: int) -> float:
    """A per-batch-size term at b: as learned there, else interpolated between the batch
    sizes it is learned at (`_between`), 0 before any."""
    learned = values.get(b)
    if learned is not None or not values:
        return learned or 0.0
    return _between(values, b)


def _between(values: Mapping[int, float], x: int) -> float:
    """`values` interpolated linearly at x between its nearest keys, flat beyond the ends.

    >>> _between({1: 10.0, 5: 30.0, 9: 20.0}, 3), _between({1: 10.0, 5: 30.0}, 8)
    (20.0, 30.0)
    """
    keys = sorted(values)
    i = bisect.bisect_left(keys, x)
    if i == 0:
        return values[keys[0]]
    if i == len(keys):
        return values[keys[-1]]
    lo, hi = keys[i - 1], keys[i]
    return values[lo] + (values[hi] - values[lo]) * (x - lo) / (hi - lo)


def fallback_problem(fallbacks: Mapping[str, str], methods: Sequence[str]) -> str | None:
    """What is wrong with a proposer-fallback map (method -> the method asked in the same
    round for the sequences it had no draft for), or None: each side must be one of
    `methods`, a fallback another method, and a fallback has no fallback of its own (it is
    asked once a round). The one rule `SplitspecConfig` and `Engine` both check.

    >>> fallback_problem({"ngram": "eagle"}, ["ngram", "eagle"]) is None
    True
    >>> fallback_problem({"ngram": "eagle"}, ["ngram"])
    "ngram's fallback must be another configured method (['ngram'] configured), got 'eagle'"
    """
    for method, fallback in fallbacks.items():
        if method not in methods:
            return f"{method!r} has a fallback but is not a configured method ({list(methods)} configured)"
        if fallback not in methods or fallback == method:
            return (f"{method}'s fallback must be another configured method ({list(methods)} configured), "
                    f"got {fallback!r}")
        if fallback in fallbacks:
            return f"{method}'s fallback {fallback!r} has a fallback of its own; a fallback is asked once a round"
    return None


def _ask(calls: dict[str, int], method: str, k: int) -> None:
    """Record that `method` is asked for k drafts of one sequence in this round's call."""
    calls[method] = max(calls.get(method, 0), k)
