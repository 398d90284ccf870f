"""The controller on synthetic acceptance and step-time curves (no model).

Expected rounds and decisions are worked out by hand in the comments from the goodput
formula of `verifier/controller.py`: with one sequence, T(n) = a + b n and proposer
latency L, k drafts pay when (1 + S_k) / (T(1 + k) + L) > 1 / T(1), i.e.
S_k (a + b) > k b + L, where S_k = alpha(1) + ... + alpha(k).
"""

from __future__ import annotations

import random

import pytest

from verifier.controller import (REASONS, AcceptanceEstimate, Controller, ControllerSettings, Decision,
                                 ProposerLatency, SequenceView, StepTimeModel)

A, B, L = 0.020, 0.0005, 0.001  # 20 ms fixed per pass, 0.5 ms per token, 1 ms proposer round trip
MEMORY_BOUND = StepTimeModel.linear(A, B)
COMPUTE_BOUND = StepTimeModel([(1, 0.002), (4096, 0.002 * 4096)])  # T(n) = 2 ms * n


def _controller(step_time=MEMORY_BOUND, methods=("ngram",), **settings) -> Controller:
    """Methods are not `cheap` here unless the test says so (shadow_latency_share 0 < L):
    `plan` sizes k itself instead of asking for the cap and leaving it to `trim`. Their
    acceptance moves by `acceptance_ewma` all the same, as the hand computations assume."""
    settings.setdefault("shadow_latency_share", 0.0)
    settings.setdefault("costly_acceptance_ewma", settings.get("acceptance_ewma", 0.3))
    c = Controller(ControllerSettings(**settings), methods, step_time)
    for m in methods:
        c.observe_proposer(m, L)
    return c


def _one(c: Controller, view: SequenceView):
    return c.plan([view])[0]


# ---------------------------------------------------------------------- step time
def test_step_time_interpolates_and_stays_monotone():
    m = StepTimeModel([(1, 0.010), (16, 0.013), (32, 0.020)], ewma=0.5)
    assert m(1) == pytest.approx(0.010) and m(0.5) == pytest.approx(0.010)
    assert m(8.5) == pytest.approx(0.0115)  # halfway from 1 to 16
    assert m(48) == pytest.approx(0.0200 + 0.007 * 16 / 16)  # the last segment, extended
    # Profiled points that fall are raised to keep T non-decreasing.
    assert StepTimeModel([(1, 0.012), (16, 0.010)]).points() == [(1, 0.012), (16, 0.012)]
    # One sequence (a prompt in it: no draft count) corrects S(1), what a running sequence
    # adds beyond the profile, by EWMA: 0 + 0.5 * (25 - 13) = 6 ms. The points stay.
    m.observe(16, 1, 0.025)
    assert m.seq_s(1) == pytest.approx(0.006) and m(16) == pytest.approx(0.019)
    # A slow one-token pass (a long context) moves S(1) to 6 + 0.5 * (30 - 10 - 6) = 13 ms:
    # every token count by the same 13 ms, so T(32) - T(1) stays the profiled 10 ms. (It
    # once set the point at 1 to 20 ms and raised T(16) and T(32) to it: a flat curve.)
    m.observe(1, 1, 0.030)
    assert m.points() == [(1, 0.010), (16, 0.013), (32, 0.020)]
    assert m(1) == pytest.approx(0.023) and m(32) - m(1) == pytest.approx(0.010)
    m.observe(100, 1, 1.0)  # far from every point: ignored
    assert m.seq_s(1) == pytest.approx(0.013) and m.per_seq_s == 0
    # Passes of one sequence with d drafts learn S(1) and X(1) as at any batch size: here
    # 5 ms and 0.5 ms a draft beyond the curve (d such that each pass lies near a point).
    rng = random.Random(1)
    for _ in range(200):
        d = rng.choice((0, 13, 14, 15))
        m.observe(1 + d, 1, m.tokens_s(1 + d) + 0.005 + 0.0005 * d, num_drafts=d)
    assert m.seq_s(1) == pytest.approx(0.005, rel=1e-3) and m.draft_s(1) == pytest.approx(0.0005, rel=1e-3)
    assert m(9) - m(1) == pytest.approx(0.003 * 8 / 15 + 8 * 0.0005, rel=1e-3)  # the curve 1 -> 16: +3 ms


def test_step_time_prices_a_pass_at_its_padded_row_count():
    # Rows as the CPU verifier pads them: 1, 2-4 -> 4, 5-8 -> 8, 9-16 -> 16, then x8.
    def rows(n: int) -> int:
        return n if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else 16 if n <= 16 else -(-n // 8) * 8

    m = StepTimeModel([(1, 0.070), (4, 0.075), (8, 0.085), (16, 0.100), (24, 0.130)], ewma=0.5, rows=rows)
    assert [m(n) for n in (2, 3, 5, 9, 15, 17)] == pytest.approx([0.075, 0.075, 0.085, 0.100, 0.100, 0.130])
    assert m(32) == pytest.approx(0.160)  # the last segment, extended: 130 + 30 * 8 / 8 ms
    # An expected count between integers: between its neighbours' padded times.
    assert m(4.25) == pytest.approx(0.075 + 0.25 * 0.010)
    assert m(1.5) == pytest.approx(0.0725)
    # A pass of 13 tokens ran at 16 rows: its error is against T(16), 120 - 100 ms, and S(1)
    # takes half of it (ewma 0.5), 10 ms (against the 94.4 ms interpolated at 13 by count
    # it would have been 12.8 ms). The points stay.
    m.observe(13, 1, 0.120)
    assert m.seq_s(1) == pytest.approx(0.010) and m(9) == pytest.approx(0.110)
    assert m.points()[2:4] == [(8, pytest.approx(0.085)), (16, pytest.approx(0.100))]


@pytest.mark.parametrize("padded", [True, False])
def test_step_time_at_one_batch_size_prices_as_the_model_does(padded):
    """`at_batch(b)`, which a plan evaluates hundreds of times, gives T(n, b) exactly, with
    S(b) and X(b) learned at some batch sizes and read between them at others."""
    def rows(n: int) -> int:
        return n if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else 16 if n <= 16 else -(-n // 8) * 8

    m = StepTimeModel([(1, 0.070), (4, 0.075), (8, 0.085), (16, 0.100), (32, 0.160), (64, 0.250)],
                      per_seq_s=0.001, rows=rows if padded else None)
    rng = random.Random(3)
    for _ in range(60):  # passes of 8 and 32 sequences with varying drafts: S(b) and X(b) learned
        for b in (8, 32):
            d = rng.randrange(0, 24)
            m.observe(b + d, b, m(b + d, b) * rng.uniform(0.9, 1.3), num_drafts=d)
    assert m.draft_s(8) > 0 and m.draft_s(32) > 0
    m.drafts_step_s_by_batch[8] = 0.004  # Z(8) as if learned (Z(b) elsewhere read from it)
    for b in (1, 8, 20, 32, 40):
        priced = m.at_batch(b)
        for n in [b + x / 4 for x in range(0, 200)] + [b + rng.uniform(0, 50) for _ in range(50)]:
            assert priced(n) == m(n, b), (b, n)


def test_step_time_learns_what_sequences_add_at_each_batch_size():
    m = StepTimeModel([(1, 0.010), (8, 0.012), (32, 0.040), (96, 0.120)], per_seq_s=0.002, ewma=0.5)
    assert m(8, b=8) == pytest.approx(0.012 + 7 * 0.002)  # the profiled prior: 26 ms
    # Measured 40 ms at b = 8: S(8) 14 -> 14 + 0.5 * (40 - 12 - 14) = 21 ms. The points and the
    # prior of every other batch size stay.
    m.observe(8, 8, 0.040)
    assert m.seq_s(8) == pytest.approx(0.021) and m(8, b=8) == pytest.approx(0.033)
    assert m(4, b=8) == pytest.approx(0.010 + 0.002 * 3 / 7 + 0.021)
    assert m(8) == pytest.approx(0.012) and m(8, b=4) == pytest.approx(0.012 + 3 * 0.002)

    # A steady batch of 32 whose wide (verification) passes run 30 ms slower than priced and
    # whose decode passes (32 tokens) run as priced. Shared terms would confound the two;
    # here only S(32) moves, to the mean error, and a draft token still costs T_tokens' slope.
    prior = m(32, b=32)  # 40 + 31 * 2 = 102 ms
    for _ in range(40):
        m.observe(96, 32, m.tokens_s(96) + 0.062 + 0.030)
        m.observe(32, 32, m.tokens_s(32) + 0.062)
    assert m.seq_s(32) == pytest.approx(0.062 + 0.010, abs=0.002)  # the EWMA ends on the decode pass
    assert m(96, b=32) - m(32, b=32) == pytest.approx(0.120 - 0.040)
    assert m(32) == pytest.approx(0.040) and m.per_seq_s == 0.002 and prior == pytest.approx(0.102)
    # A long prefill, far from every point: ignored, even with several sequences.
    before = (m.points(), dict(m.seq_s_by_batch))
    m.observe(500, 4, 1.0)
    assert (m.points(), m.seq_s_by_batch) == before
    # Many short contexts can beat one long sequence: S(b) may be negative, T stays positive.
    for _ in range(20):
        m.observe(96, 16, 0.100)
    assert m.seq_s(16) == pytest.approx(-0.020, abs=1e-4) and m(96, b=16) == pytest.approx(0.100, abs=1e-4)



def test_step_time_learns_what_a_draft_adds_at_a_batch_size():
    # Token curve 10 ms + 1 ms per token, a point every 4 tokens (every pass lies near one).
    m = StepTimeModel([(n, 0.010 + 0.001 * n) for n in range(4, 133, 4)], per_seq_s=0.002)
    rng = random.Random(0)
    # At b = 8, passes of 8 + d tokens (d drafts, 0-24): 8 sequences add 20 ms and a draft
    # 0.5 ms beyond the curve's slope. The least squares line finds both.
    for _ in range(200):
        d = rng.randint(0, 24)
        m.observe(8 + d, 8, m.tokens_s(8 + d) + 0.020 + 0.0005 * d, num_drafts=d)
    assert m.draft_s(8) == pytest.approx(0.0005, rel=1e-3) and m.seq_s(8) == pytest.approx(0.020, rel=1e-3)
    assert m(24, b=8) - m(8, b=8) == pytest.approx(16 * (0.001 + 0.0005), rel=1e-3)
    # Drafts stop (d = 0 from now on): too little variance left to tell, X(8) stays.
    for _ in range(200):
        m.observe(8, 8, m.tokens_s(8) + 0.020, num_drafts=0)
    assert m.draft_s(8) == pytest.approx(0.0005, rel=1e-3) and m.seq_s(8) == pytest.approx(0.020, rel=1e-3)
    # A pass that prefilled a prompt (draft count unknown) corrects S(8) by EWMA (0.2), its
    # prompt tokens priced by the curve alone: 40 tokens, 25 ms over the curve -> S(8) = 21 ms.
    m.observe(40, 8, m.tokens_s(40) + 0.025)
    assert m.seq_s(8) == pytest.approx(0.021, rel=1e-3) and m.draft_s(8) == pytest.approx(0.0005, rel=1e-3)
    # A batch size that never drafts learns S(b) alone and takes X(b) from the batch sizes
    # that learned it (only b = 8: 0.5 ms); no other b moves.
    for _ in range(100):
        m.observe(16, 16, m.tokens_s(16) + 0.030, num_drafts=0)
    assert m.draft_s(16) == pytest.approx(0.0005, rel=1e-3) and m.seq_s(16) == pytest.approx(0.030, rel=1e-3)
    assert m.seq_s(8) == pytest.approx(0.021, rel=1e-3)
    # A batch size never run is priced from its learned neighbours, not from the profiled
    # 2 ms a sequence: S(12) halfway between S(8) = 21 and S(16) = 30 ms, 25.5 ms; S(4)
    # between S(1) (never run: 0) and S(8), 21 * 3 / 7 = 9 ms; beyond the largest learned,
    # S(16) plus the profiled slope, S(32) = 30 + 16 * 2 = 62 ms. X(b) is 0.5 ms at each.
    assert m.seq_s(12) == pytest.approx(0.0255, rel=1e-3) and m.seq_s(4) == pytest.approx(0.009, rel=1e-3)
    assert m.seq_s(32) == pytest.approx(0.062, rel=1e-3)
    assert [round(m.draft_s(b), 6) for b in (4, 12, 32)] == [0.0005] * 3


def test_step_time_learns_the_step_a_pass_pays_for_verifying_any_draft():
    """Passes of 32 sequences, two in three without drafts (as auto drafts on chat at 32
    clients), the rest with 1-16 drafts, each 30 ms over the token curve, plus 3 ms when
    it verified any draft, plus 0.5 ms a draft: S(32), Z(32) and X(32) are found. One line
    through every pass would put part of the step on the slope (measured on the same
    passes below) and price a pass of one draft under what it costs."""
    m = StepTimeModel([(n, 0.010 + 0.001 * n) for n in range(4, 133, 4)], per_seq_s=0.001)
    rng = random.Random(5)
    passes = []
    for _ in range(300):
        d = 0 if rng.random() < 2 / 3 else rng.randint(1, 16)
        error = 0.030 + (0.003 if d else 0.0) + 0.0005 * d
        passes.append((d, error))
        m.observe(32 + d, 32, m.tokens_s(32 + d) + error, num_drafts=d)
    assert m.seq_s(32) == pytest.approx(0.030, rel=1e-3)
    assert m.drafts_step_s(32) == pytest.approx(0.003, rel=1e-3)
    assert m.draft_s(32) == pytest.approx(0.0005, rel=1e-3)
    assert m(33, b=32) - m(32, b=32) == pytest.approx(m.tokens_s(33) - m.tokens_s(32) + 0.0035, rel=1e-3)
    assert m(32.5, b=32) - m(32, b=32) == pytest.approx(m.tokens_s(32.5) - m.tokens_s(32) + 0.5 * 0.0035, rel=1e-3)
    # The single least squares line through the same passes (undecayed): a slope of about
    # 0.8 ms, a pass of one draft priced about 2.5 ms under its 3.5.
    n = len(passes)
    mean_d = sum(d for d, _ in passes) / n
    mean_e = sum(e for _, e in passes) / n
    slope = (sum(d * e for d, e in passes) / n - mean_d * mean_e) / (sum(d * d for d, _ in passes) / n - mean_d**2)
    one_draft = (mean_e - slope * mean_d) + slope - 0.030
    assert slope > 0.0007 and one_draft < 0.0015
    # Passes that all verify drafts (a static k) cannot tell S(32) from Z(32): the line is
    # fitted to the error less the Z(32) learned, which stays, and so do S(32) and X(32).
    for _ in range(300):
        d = rng.randint(1, 16)
        m.observe(32 + d, 32, m.tokens_s(32 + d) + 0.030 + 0.003 + 0.0005 * d, num_drafts=d)
    assert (m.seq_s(32), m.drafts_step_s(32), m.draft_s(32)) == pytest.approx((0.030, 0.003, 0.0005), rel=1e-3)
    # Passes with and without drafts again, S(32) now 35 ms: found, the step and slope kept.
    for _ in range(300):
        d = 0 if rng.random() < 2 / 3 else rng.randint(1, 16)
        m.observe(32 + d, 32, m.tokens_s(32 + d) + 0.035 + (0.003 if d else 0.0) + 0.0005 * d, num_drafts=d)
    assert (m.seq_s(32), m.drafts_step_s(32), m.draft_s(32)) == pytest.approx((0.035, 0.003, 0.0005), rel=1e-3)
    # A batch size that never learned one takes Z(b) from those that did; none: 0.
    assert m.drafts_step_s(8) == pytest.approx(0.003)
    assert StepTimeModel([(1, 0.01), (64, 0.05)]).drafts_step_s(8) == 0.0


# ---------------------------------------------------------------------- turning off and back on
def test_low_acceptance_sequence_is_off_within_five_rounds_and_probed_back():
    # Every draft is rejected at position 1. The estimate starts from the bare prior 0.6,
    # worth one observation, so c(1) is the running mean of the prior and the rounds until
    # 1 / (rounds + 1) < 0.3 (acceptance_ewma), then an EWMA: 0.3, 0.2, then x 0.7 each
    # round: 0.14, 0.098, 0.0686. Positions 2-8 are never observed and take c(1), so
    # S_k = c + c^2 + ... + c^k, and goodput is (1 + S_k) / (21 + 0.5 k) per ms against
    # 1 / 20.5 = 0.04878 without drafts (a + b = 20.5 ms):
    #   round 1, c = 0.6 (S_k = 1.5 (1 - 0.6^k)): k = 4 2.3056 / 23 = 0.10024,
    #     k = 5 2.38336 / 23.5 = 0.10142, k = 6 2.43002 / 24 = 0.10125 -> k = 5;
    #   c = 0.3: k = 1 1.3 / 21.5 = 0.06047, k = 2 1.39 / 22 = 0.06318, k = 3 1.417 / 22.5 = 0.06298 -> 2;
    #   c = 0.2: 1.2 / 21.5 = 0.05581, 1.24 / 22 = 0.05636, 1.248 / 22.5 = 0.05547 -> 2;
    #   c = 0.14: 1.14 / 21.5 = 0.05302, 1.1596 / 22 = 0.05271 -> 1;  c = 0.098: 1;
    #   c = 0.0686: k pays iff 20.5 S_k > 0.5 k + 1; k = 1: 1.406 < 1.5, and S_k < c / (1 - c)
    #     = 0.0737 makes every k worse -> off from the 6th round.
    c = _controller()
    v = SequenceView("s")
    ks = []
    for _ in range(5):
        d = _one(c, v)
        assert d.k > 0 and d.reason == "goodput" and d.method == "ngram"
        ks.append(d.k)
        c.observe_round("s", d.method, d.k, 0)
    assert ks == [5, 2, 2, 1, 1]
    assert c.acceptance("s", "ngram") == pytest.approx([0.2 * 0.7**3] * 8)
    # Off from the 6th round; with perfect acceptance it would pay, so the reason is acceptance.
    for _ in range(7):
        d = _one(c, v)
        assert (d.k, d.reason) == (0, "low_acceptance")
    # 8 rounds after its last draft (probe_interval), a cheap probe of probe_k = 2 tokens.
    probe = _one(c, v)
    assert (probe.method, probe.k, probe.reason) == ("ngram", 2, "probe")
    # The probe accepts both: c(1) = 0.0686 + 0.3 (1 - 0.0686) = 0.34802 (6 observations
    # and the prior: the EWMA's weight); c(2), observed for the first time, starts from the
    # 0.0686 it took and moves by 1/2: 0.5343, and positions 3-8 take it. Even discounted by
    # the hysteresis (x 0.8), alpha(1) = 0.2784 and 20.5 * 0.2784 > 1.5: back on.
    c.observe_round("s", "ngram", 2, 2)
    assert c.acceptance("s", "ngram") == pytest.approx([0.34802] + [0.5343] * 7)
    d = _one(c, v)
    assert d.k > 0 and d.reason == "goodput"
    for _ in range(10):  # acceptance stays perfect: k climbs to max_k
        c.observe_round("s", "ngram", d.k, d.k)
        d = _one(c, v)
    assert d.k == 8


def _seed(c: Controller, seq_id: str, conditional: list[float], on: bool) -> None:
    """Give a sequence a known acceptance estimate and on/off state."""
    state = c._state(seq_id)
    state.by_method["ngram"] = AcceptanceEstimate(conditional)
    state.on = on


def test_hysteresis_keeps_a_borderline_sequence_off():
    # c(1) = 0.07, c(2..8) = 0.6. A sequence that is on keeps drafting:
    #   k = 2: 51.25 * 0.07 * (1 - 0.6^2) = 2.30 > 2.0.
    # One that is off counts 0.8 of it (alpha(1) = 0.056) and stays off:
    #   k = 1..5: 1.15 < 1.5, 1.84 < 2.0, 2.25 < 2.5, 2.50 < 3.0, 2.65 < 3.5 (and worse after).
    conditional = [0.07] + [0.6] * 7
    c = _controller()
    _seed(c, "on", conditional, on=True)
    _seed(c, "off", conditional, on=False)
    assert _one(c, SequenceView("on")).k >= 2
    assert (_one(c, SequenceView("off")).k, _one(c, SequenceView("off")).reason) == (0, "low_acceptance")


def test_compute_bound_batch_turns_everything_off():
    # T(n) = 2 ms * n: k drafts cost 2k ms and return S_k < k tokens against the 1 token per
    # 2 ms of plain decoding, whatever the acceptance. Even sequences that accepted every
    # draft so far (c(j) -> 0.99) stay off, and no probes are sent.
    c = _controller(step_time=COMPUTE_BOUND)
    views = [SequenceView(f"s{i}") for i in range(8)]
    for v in views:
        for _ in range(12):
            c.observe_round(v.seq_id, "ngram", 8, 8)
    for _ in range(3 * c.settings.probe_interval):
        decisions = c.plan(views)
        assert [(d.k, d.reason) for d in decisions] == [(0, "batch_compute_bound")] * 8
    # The same sequences on a memory-bound verifier all draft.
    m = _controller()
    for v in views:
        for _ in range(12):
            m.observe_round(v.seq_id, "ngram", 8, 8)
    assert all(d.k == 8 and d.reason == "goodput" for d in m.plan(views))


def test_batch_size_shrinks_k_on_a_curve_that_bends():
    # Flat to 64 tokens (memory bound), then 1 ms per extra token (compute bound).
    t = StepTimeModel([(1, 0.020), (64, 0.021), (4096, 0.021 + 0.001 * (4096 - 64))])
    c = _controller(step_time=t)
    for i in range(32):
        for _ in range(12):
            c.observe_round(f"s{i}", "ngram", 8, 6)  # c(1..6) -> 1, c(7) -> 0: 6 of 8 accepted
    one = c.plan([SequenceView("s0")])[0].k
    many = sum(d.k for d in c.plan([SequenceView(f"s{i}") for i in range(32)]))
    assert one >= 6
    # 32 sequences already fill half the flat part; far fewer drafts per sequence pay.
    assert many < 32 * one / 2


def test_slow_proposer_is_named():
    c = _controller()
    c.observe_proposer("ngram", 5.0)  # EWMA 0.2: 1 ms -> ~1 s round trip, far above a 20 ms pass
    for _ in range(3):
        c.observe_proposer("ngram", 5.0)
    for _ in range(5):
        c.observe_round("s", "ngram", 4, 4)
    assert _one(c, SequenceView("s")).reason == "proposer_slow"


# ---------------------------------------------------------------------- cheap methods: ask, then trim
# A step-shaped T like the CPU verifier's: one token 76 ms, then a flat step where passes
# pad their rows to 16 (here 2-16 tokens, 131 ms), then rising. Drafting 8 tokens costs as
# much as drafting 1.
STEP_SHAPED = StepTimeModel([(1, 0.076), (2, 0.131), (16, 0.131), (32, 0.200)])



def test_prompts_prefilled_in_the_pass_do_not_make_drafts_look_cheap():
    # c(j) = 0.02: alone, k = 1 would need alpha(1) > (0.5 + 1) / 20.5 = 0.073: off.
    # A 200-token prompt prefilled in the same pass (T(201) = 120.5 ms) must not change
    # that: the drafts compete with the running sequence's decode pass, 20.5 ms, and add
    # what they add to the real pass (0.5 ms each here). Priced inside the whole pass,
    # k = 1 would look good: 1.02 / (121 + 1) = 0.00836 > 1 / 120.5 = 0.00830.
    c = _controller()
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.02] * 8)
    for prefill in ((0, 0), (200, 1)):
        assert c.plan([SequenceView("s")], None, *prefill)[0] == Decision(None, 0, "low_acceptance")
        # trim, the proposer's time spent: a draft pays iff alpha > 0.5 E / T = 0.5 / 20.5 =
        # 0.024; in the whole pass the bar would be 0.5 / 120.5 = 0.0041.
        assert c.trim([("s", "ngram", 8, "goodput")], *prefill) == [0]
    # A sequence worth drafting still drafts beside a prompt. On the step-shaped curve a
    # lone sequence's drafts are free up to 16 tokens, but beside a 200-token prompt each
    # costs the slope there, 69 / 16 = 4.3125 ms: with c(j) = 0.5 goodput is
    # (1 + S_k) / (76 + 4.3125 k + 1): k = 2 0.020438, k = 3 1.875 / 89.94 = 0.020848,
    # k = 4 0.020557, so k = 3 (alone: k = 8, (1 + 0.996) / 132 = 0.01512 > 1 / 76).
    c = _controller(step_time=STEP_SHAPED)
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.5] * 8)
    assert c.plan([SequenceView("s")])[0].k == 8
    assert c.plan([SequenceView("s")], None, 200, 1)[0] == Decision("ngram", 3, "goodput")


def test_beside_a_prompt_drafts_cost_the_token_curve_without_the_learned_per_draft_extra():
    # T(n) = 20 ms + 0.5 ms n, and decode passes have taught X = 3 ms a draft beyond the
    # curve. In a decode pass a draft costs 3.5 ms: with c(j) = 0.15, k = 1 gives
    # 1.15 / (20.5 + 3.5 + 1) = 0.0460 < 1 / 20.5 = 0.04878: off. Beside a 200-token prompt
    # the pass already runs on the curve's dear rows, and a draft costs the curve's 0.5 ms:
    # k = 1 gives 1.15 / 22 = 0.05227 > 0.04878, k = 2 1.1725 / 22.5 = 0.05211: k = 1.
    # (With X on top, as before, it stayed off there too.)
    step_time = StepTimeModel.linear(A, B)
    step_time.draft_s_by_batch[1] = 0.003
    c = _controller(step_time=step_time)
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.15] * 8)
    assert c.plan([SequenceView("s")])[0] == Decision(None, 0, "low_acceptance")
    assert c.plan([SequenceView("s")], None, 200, 1)[0] == Decision("ngram", 1, "goodput")
    # trim, the proposer's time spent: decode pass k = 1 1.15 / 24 = 0.0479 < 0.04878;
    # beside the prompt k = 1 1.15 / 21 = 0.05476, k = 2 1.1725 / 21.5 = 0.05453.
    assert c.trim([("s", "ngram", 8, "goodput")]) == [0]
    assert c.trim([("s", "ngram", 8, "goodput")], 200, 1) == [1]


def test_a_cheap_methods_sequence_counts_a_share_of_its_departure_from_the_method_wide_acceptance():
    # The method-wide estimate is the prior, c(j) = 0.6; the sequence's own, 0.02. A cheap
    # method (L = 1 ms <= 1.0 * T(1) = 20.5 ms) believes half the departure by default:
    # c(j) = 0.6 + 0.5 (0.02 - 0.6) = 0.31, alpha = 0.31, 0.0961, 0.0298. trim, the
    # proposer's time spent, maximises (1 + S_k) / (20.5 + 0.5 k): k = 1 1.31 / 21 = 0.06238,
    # k = 2 1.4061 / 21.5 = 0.06540, k = 3 1.4359 / 22 = 0.06527: k = 2. Believing all of it
    # (c = 0.02): k = 1 1.02 / 21 = 0.04857 < 1 / 20.5 = 0.04878: none. A costly method
    # (shadow_latency_share 0: not cheap) believes all of it too.
    for share, expected_c, kept in ((None, 0.31, 2), (1.0, 0.02, 0)):
        settings = {} if share is None else {"sequence_share": share}
        c = _controller(shadow_latency_share=1.0, **settings)
        c._state("s").by_method["ngram"] = AcceptanceEstimate([0.02] * 8)
        assert c.acceptance("s", "ngram", believed=True)[:3] == pytest.approx([expected_c] * 3)
        assert c.trim([("s", "ngram", 8, "goodput")]) == [kept]
    c = _controller()
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.02] * 8)
    assert c.acceptance("s", "ngram", believed=True)[:3] == pytest.approx([0.02] * 3)
    assert c.trim([("s", "ngram", 8, "goodput")]) == [0]
    # What the sequence observes moves its own estimate, not the shrunk one: a round of 2
    # drafts with the first accepted, at acceptance_ewma 0.3: c(1) = 0.02 + 0.3 (1 - 0.02) =
    # 0.314, c(2) = 0.02 - 0.3 * 0.02 = 0.014. The method-wide estimate (the bare prior,
    # worth one observation) moves to the mean of prior and observation: 0.8 and 0.3. So
    # the decisions see 0.8 + 0.5 (0.314 - 0.8) = 0.557 and 0.3 + 0.5 (0.014 - 0.3) = 0.157.
    c = _controller(shadow_latency_share=1.0)
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.02] * 8)
    c.observe_round("s", "ngram", 2, 1)
    assert c.acceptance("s", "ngram")[:2] == pytest.approx([0.314, 0.014])
    assert c.acceptance("s", "ngram", believed=True)[:2] == pytest.approx([0.557, 0.157])


def test_cheap_method_is_asked_for_the_cap_when_a_draft_would_pay():
    # A sequence whose proposer has a draft in 1 round of 10 (p = 0.1), c(j) = 0.5.
    # Given a draft, k = 8 gives S_8 = 0.5 + ... + 0.5^8 = 0.996 tokens more for 131 + 1 ms
    # instead of 76: (1 + 0.996) / 132 = 0.01512 > 1 / 76 = 0.01316, so a cheap method
    # (round trip 1 ms <= 0.25 * 76 ms) is asked for k = 8.
    # Weighing by p instead, as for a costly method, spreads the draft over the jump:
    # (1 + 0.0996) / (T(1.8) + 1) = 1.0996 / (120 + 1) = 0.00909 < 0.01316: off.
    def seeded(share):
        c = _controller(step_time=STEP_SHAPED, shadow_latency_share=share)
        c._state("s").by_method["ngram"] = AcceptanceEstimate([0.5] * 8, p=0.1)
        return c

    assert _one(seeded(0.25), SequenceView("s")) == Decision("ngram", 8, "goodput")
    assert _one(seeded(0.0), SequenceView("s")) == Decision(None, 0, "low_acceptance")


def test_a_cheap_method_is_not_called_when_its_drafts_come_too_seldom_to_pay_its_round_trip():
    # c(j) = 0.5, so given a draft k drafts give S_k = 0.5, 0.75, 0.875, 0.9375, 0.96875
    # and (1 + S_k) / (20.5 + 0.5 k + 1) peaks at k = 4: 1.9375 / 23.5 = 0.08245 (k = 3
    # 0.08152, k = 5 0.08203); every k up to 8 beats 1 / 20.5 = 0.04878, so the cap is asked
    # for. But the call holds the pass back by L = 1 ms each round, and the 4 drafts come in
    # a share p of rounds only: (1 + 0.9375 p) / (20.5 + 2 p + 1) > 1 / 20.5 needs
    # 17.21875 p > 1, p > 0.0581. p = 0.1: 1.09375 / 21.7 = 0.05040, asked; p = 0.05:
    # 1.046875 / 21.6 = 0.04847, not called, and a greedy sequence shadow-drafts instead.
    def seeded(p):
        c = _controller(shadow_latency_share=1.0, sequence_share=1.0)
        c._state("s").by_method["ngram"] = AcceptanceEstimate([0.5] * 8, p=p)
        return c

    assert _one(seeded(0.1), SequenceView("s", greedy=True)) == Decision("ngram", 8, "goodput")
    assert _one(seeded(0.05), SequenceView("s", greedy=True)) == Decision(None, 0, "proposer_slow", "ngram", 8)
    assert _one(seeded(0.05), SequenceView("s")) == Decision(None, 0, "proposer_slow")
    # A sequence's p counts like its acceptance, `sequence_share` (0.5) of its departure from
    # the method-wide p: own 0.02 (a dozen rounds without a match), method-wide 0.3, so
    # 0.3 + 0.5 (0.02 - 0.3) = 0.16 > 0.0581, asked; alone (share 1) 0.02, not called.
    for share, asked in ((0.5, True), (1.0, False)):
        c = _controller(shadow_latency_share=1.0, sequence_share=share)
        c._global["ngram"] = AcceptanceEstimate([0.5] * 8, p=0.3)
        c._state("s").by_method["ngram"] = AcceptanceEstimate([0.5] * 8, p=0.02)
        assert (_one(c, SequenceView("s")).k == 8) is asked
    # With the method called this round anyway (another request pins it on), asking costs
    # nothing more: with t(6) = 23 ms for the pinned sequence's 4 drafts, a first draft at
    # p = 1 gives 2.5 / (23.5 + 1) = 0.1020 > 2 / (23 + 1) = 0.0833, and so on to the cap.
    c = seeded(0.05)
    decisions = c.plan([SequenceView("pinned", mode="on", method="ngram"), SequenceView("s", greedy=True)])
    assert decisions == [Decision("ngram", 4, "request_on"), Decision("ngram", 8, "goodput")]


def test_proposer_latency_is_a_line_in_k_once_k_has_varied():
    lat = ProposerLatency(ewma=0.2)
    assert lat(4) == 0.0  # no call yet
    lat.observe(0.0165, k=6)  # one k so far: proportional, 16.5 ms / 6 per draft
    assert lat(2) == pytest.approx(0.0165 * 2 / 6) and lat(None) == pytest.approx(0.0165)
    for _ in range(10):  # 1.5 ms + 2.5 ms per draft, k alternating 2 and 6
        lat.observe(0.0065, k=2)
        lat.observe(0.0165, k=6)
    assert lat.slope == pytest.approx(0.0025)
    assert [lat(k) for k in (1, 3, 8)] == pytest.approx([0.004, 0.009, 0.0215])
    for _ in range(40):  # k stops varying (the variance of k decays to 4 * 0.8^80)
        lat.observe(0.009, k=3)
    assert lat.slope == pytest.approx(0.0025)
    for _ in range(40):  # then the calls get 3 ms slower: the slope is kept, the line moves up
        lat.observe(0.012, k=3)
    assert lat.slope == pytest.approx(0.0025)
    assert [lat(k) for k in (3, 8)] == pytest.approx([0.012, 0.0245], abs=1e-5)
    flat = ProposerLatency(ewma=0.2)
    flat.observe(0.003)  # calls of unknown k: the plain average for any k
    assert flat(1) == flat(8) == pytest.approx(0.003)


def test_a_call_that_catches_up_on_context_is_not_a_rounds_latency():
    # A draft model's rounds: 0.1 s a draft (0.3 s at k = 3). A sequence's first call also
    # fills the draft's KV cache with its prompt: 0.93 s at k = 5.
    lat = ProposerLatency(ewma=0.2)
    lat.observe(0.93, k=5, catch_up=True)  # nothing else yet: taken, proportional
    assert lat(5) == pytest.approx(0.93)
    for _ in range(20):
        lat.observe(0.3, k=3)
    # The first call that caught up on nothing replaced it: 0.1 s a draft, as measured.
    assert [lat(k) for k in (1, 3, 5)] == pytest.approx([0.1, 0.3, 0.5])
    lat.observe(0.93, k=5, catch_up=True)  # the next sequence's first call: left out
    assert [lat(k) for k in (1, 3, 5)] == pytest.approx([0.1, 0.3, 0.5]) and lat.slope is None
    # Taken in, the same call fits a line through both (EWMA moments: mean k 3 + 0.2 * 2 =
    # 3.4, variance 12.2 - 3.4^2 = 0.64, covariance 1.65 - 3.4 * 0.426 = 0.2016): 0.315 s a
    # draft, so one draft looks free (0.426 - 2.4 * 0.315 < 0) and five cost 0.93 s.
    lat.observe(0.93, k=5)
    assert lat.slope == pytest.approx(0.315, abs=1e-3) and lat(1) == 0.0 and lat(5) == pytest.approx(0.93, abs=1e-3)


def test_a_model_proposers_drafts_are_sized_by_what_each_costs():
    # The CPU verifier at batch 1: T = 52 ms for 1 token, 59 ms for 2-4 (rows padded to 4),
    # 77 ms for 5-8. An EAGLE-like head: 1.5 ms + 2.5 ms per draft; c(j) = 0.45, so
    # alpha = 0.45, 0.2025, 0.0911, 0.0410, ... and with L(k) = 1.5 + 2.5 k ms:
    #   k = 0: 1 / 52 = 0.01923 per ms
    #   k = 2: 1.6525 / (59 + 6.5) = 0.02523;  k = 3: 1.7436 / (59 + 9) = 0.02564 (best)
    #   k = 4: 1.7846 / (77 + 11.5) = 0.02017; k = 8: 1.8168 / (77 + 21.5) = 0.01844
    # Its average call (k alternating 2 and 6: 11.5 ms) is below 0.25 * 52 = 13 ms, so with
    # one figure for every k it counted as cheap and was asked for all 8 drafts (21.5 ms
    # of drafting for 3 kept); priced by k, 8 drafts cost 21.5 ms > 13 ms: sized in `plan`.
    def rows(n: int) -> int:
        return n if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else -(-n // 8) * 8

    t = StepTimeModel([(1, 0.052), (4, 0.059), (8, 0.077), (16, 0.110)], rows=rows)
    c = Controller(ControllerSettings(max_k=8), ("eagle",), t)
    for _ in range(10):
        c.observe_proposer("eagle", 0.0065, k=2)
        c.observe_proposer("eagle", 0.0165, k=6)
    assert c.latency_s("eagle") == pytest.approx(0.0115, abs=0.001)
    c._state("s").by_method["eagle"] = AcceptanceEstimate([0.45] * 8)
    assert _one(c, SequenceView("s")) == Decision("eagle", 3, "goodput")


def test_a_call_line_never_fitted_is_learned_by_asking_two_more_drafts():
    # An EAGLE-like head whose call takes 11 ms + 1 ms a draft, seen so far only at k = 1
    # (12 ms): priced proportional to k until its calls' k vary, 12 ms a draft. A sequence
    # with c(j) = 0.8 on T(n) = 20 + 0.5 n ms: at 12 ms a draft, k = 1 is best,
    #   k = 1: 1.8 / (21 + 12) = 0.0545;  k = 2: 2.44 / (21.5 + 24) = 0.0536.
    # Asked k = 1 again, the line would never be fitted. So the round asks 1 + 2 = 3.
    c = Controller(ControllerSettings(), ("eagle",), StepTimeModel.linear(A, B))
    for _ in range(5):
        c.observe_proposer("eagle", 0.012, k=1)
    c._state("s").by_method["eagle"] = AcceptanceEstimate([0.8] * 8)
    v = SequenceView("s")
    assert _one(c, v) == Decision("eagle", 3, "goodput")
    # That call took 14 ms: with `timing_ewma` 0.2 the moments give k a mean of 1.4 and a
    # variance of 2.6 - 1.4^2 = 0.64, the covariance 0.018 - 1.4 * 0.0124 = 0.00064, so
    # 1 ms a draft and L(k) = 11 + k ms. Now the deepest k pays: E(8) = 1 + 4 (1 - 0.8^8)
    # = 4.33 in 24.5 + 19 ms, 0.0995, against 0.0897 at k = 4; no more exploring.
    c.observe_proposer("eagle", 0.014, k=3)
    assert c.proposer_slope_s("eagle") == pytest.approx(0.001)
    assert [_one(c, v) for _ in range(3)] == [Decision("eagle", 8, "goodput")] * 3


def test_a_stale_call_line_is_explored_again_after_refit_calls():
    # The head's line was fitted on a busy machine from calls at k = 1 (12 ms) and k = 3
    # (30 ms), alternated: L(k) = 3 + 9 ms k. The same sequence as above (c(j) = 0.8, T(n) =
    # 20 + 0.5 n ms) then drafts k = 2:
    #   k = 1: 1.8 / (21 + 12) = 0.0545;  k = 2: 2.44 / (21.5 + 21) = 0.0574;
    #   k = 3: 2.952 / (22 + 30) = 0.0568.
    c = Controller(ControllerSettings(), ("eagle",), StepTimeModel.linear(A, B))
    for _ in range(10):
        c.observe_proposer("eagle", 0.012, k=1)
        c.observe_proposer("eagle", 0.030, k=3)
    assert c.proposer_slope_s("eagle") == pytest.approx(0.009)
    c._state("s").by_method["eagle"] = AcceptanceEstimate([0.8] * 8)
    v = SequenceView("s")
    # Its calls at k = 2 take 21 ms, on the line, so the slope stays 9 ms (every point lies
    # on it) while the variance of k decays by 0.8 a call from ~1: below 0.25 after 7 calls,
    # after which the line is no longer refitted. 20 calls: 14 without a fit, fewer than
    # REFIT_CALLS (32), so k = 2 is asked as it is.
    for _ in range(20):
        c.observe_proposer("eagle", 0.021, k=2)
    assert [_one(c, v) for _ in range(3)] == [Decision("eagle", 2, "goodput")] * 3
    # 20 calls more: 34 without a fit, so one call is asked 2 + 2 = 4 drafts.
    for _ in range(20):
        c.observe_proposer("eagle", 0.021, k=2)
    assert _one(c, v) == Decision("eagle", 4, "goodput")
    # The machine is idle now: the call at k = 4 takes 23 ms, so the head costs 19 + k ms.
    # The moments move from (k 2, k^2 4, s 0.021, ks 0.042) to (2.4, 6.4, 0.0214, 0.052):
    # variance 6.4 - 2.4^2 = 0.64, covariance 0.052 - 2.4 * 0.0214 = 0.00064, 1 ms a draft,
    # L(k) = 21.4 + (k - 2.4) = 19 + k ms. Now the cap pays best: E(8) = 1 + 4 (1 - 0.8^8)
    # = 4.329 over 24.5 + 27 ms, 0.0841, against k = 7: 4.161 / (24 + 26) = 0.0832.
    c.observe_proposer("eagle", 0.023, k=4)
    assert c.proposer_slope_s("eagle") == pytest.approx(0.001, rel=0.01)  # the alternation leaves ~0.8^40
    assert _one(c, v) == Decision("eagle", 8, "goodput")


def test_a_fallback_is_asked_for_what_pays_for_it_alone():
    # The same verifier and head as above, the head standing in for a method that had no
    # draft, alone in the pass: asked up to 8 it is asked for 3 (the best k above); up to 2,
    # for 2 (0.02523 > 1 / 52); with c(j) = 0.05 no k pays (k = 1: 1.05 / (59 + 4) = 0.01667
    # < 0.01923).
    def rows(n: int) -> int:
        return n if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else -(-n // 8) * 8

    t = StepTimeModel([(1, 0.052), (4, 0.059), (8, 0.077), (16, 0.110)], rows=rows)
    c = Controller(ControllerSettings(max_k=8), ("ngram", "eagle"), t)
    for _ in range(10):
        c.observe_proposer("eagle", 0.0065, k=2)
        c.observe_proposer("eagle", 0.0165, k=6)
    c._state("s").by_method["eagle"] = AcceptanceEstimate([0.45] * 8)
    c._state("low").by_method["eagle"] = AcceptanceEstimate([0.05] * 8)
    alone = [("s", "ngram", 0, "no_draft")]
    assert c.fallback_ks(alone, [(0, "eagle", 8)]) == [3]
    assert c.fallback_ks(alone, [(0, "eagle", 2)]) == [2]
    assert c.fallback_ks([("low", "ngram", 0, "no_draft")], [(0, "eagle", 8)]) == [0]
    assert Controller(ControllerSettings(max_k=8), ("ngram", "eagle")).fallback_ks(alone, [(0, "eagle", 5)]) == [5]
    # Beside a sequence whose 3 n-gram drafts came (c(j) = 0.45 for both methods, E = 2 +
    # 0.7436 = 2.7436 over 5 tokens, 8 rows: 77 ms; no draft: 2.7436 / 77 = 0.03563 per
    # ms), 1 to 3 drafts of the head keep the pass at 8 rows: k = 1: 3.1936 / (77 + 4) =
    # 0.03943; k = 2: 3.3961 / 83.5 = 0.04067 (the best, where alone k = 3 was); k = 3:
    # 3.4872 / 86 = 0.04055; k = 4 needs 16 rows (110 ms).
    c._state("t").by_method["ngram"] = AcceptanceEstimate([0.45] * 8)
    c._global.setdefault("ngram", AcceptanceEstimate([0.45] * 8))
    pair = [("t", "ngram", 3, "goodput"), ("s", "ngram", 0, "no_draft")]
    assert c.fallback_ks(pair, [(1, "eagle", 8)]) == [2]



def test_a_fallback_ask_that_catches_up_is_priced_with_what_catching_up_costs():
    # The verifier, head and sequence of the test above; L(k) = 1.5 + 2.5 k ms. A catch-up
    # call (the sequence drafted with n-gram since it last asked the head) took L(2) + 20 ms:
    # alone, k = 3 still pays, 1.7436 / (59 + 9 + 20) = 0.01981 > 1 / 52 = 0.01923 (k = 2:
    # 1.6525 / 85.5 = 0.01933; k = 1: 1.45 / 83 = 0.01747). At L(2) + 30 ms none does
    # (k = 3: 1.7436 / 98 = 0.01779; k = 2: 1.6525 / 95.5 = 0.01730), unless the ask does
    # not catch up.
    def rows(n: int) -> int:
        return n if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else -(-n // 8) * 8

    def controller(extra_s: float) -> Controller:
        c = Controller(ControllerSettings(max_k=8), ("ngram", "eagle"),
                       StepTimeModel([(1, 0.052), (4, 0.059), (8, 0.077), (16, 0.110)], rows=rows))
        for _ in range(10):
            c.observe_proposer("eagle", 0.0065, k=2)
            c.observe_proposer("eagle", 0.0165, k=6)
        for _ in range(3):
            c.observe_proposer("eagle", 0.0065 + extra_s, k=2, catch_up=True)
        c._state("s").by_method["eagle"] = AcceptanceEstimate([0.45] * 8)
        return c

    alone = [("s", "ngram", 0, "no_draft")]
    assert controller(0.020).latency_s("eagle", 2) == pytest.approx(0.0065)  # the line is unmoved
    assert controller(0.020).fallback_ks(alone, [(0, "eagle", 8)], catch_ups=[True]) == [3]
    assert controller(0.030).fallback_ks(alone, [(0, "eagle", 8)], catch_ups=[True]) == [0]
    assert controller(0.030).fallback_ks(alone, [(0, "eagle", 8)], catch_ups=[False]) == [3]
    assert controller(0.030).fallback_ks(alone, [(0, "eagle", 8)]) == [3]


def test_a_costly_methods_acceptance_moves_slower():
    # One rejected first draft from a well-measured c(1) = 0.6: a cheap method's estimate
    # moves by 0.3 of the gap (0.6 -> 0.42), a costly one's by 0.1 (0.6 -> 0.54), the
    # settings' defaults.
    def cheap_and_costly() -> Controller:
        c = Controller(ControllerSettings(), ("ngram", "eagle"), MEMORY_BOUND)  # T(1) = 20.5 ms
        c.observe_proposer("ngram", 0.001)  # <= 0.25 * 20.5 ms: cheap
        c.observe_proposer("eagle", 0.010)  # above it: costly
        return c

    c = cheap_and_costly()
    for m in ("ngram", "eagle"):
        c._state("s").by_method[m] = AcceptanceEstimate([0.6] * 8)
        c.observe_round("s", m, 4, 0)
    assert c.acceptance("s", "ngram")[0] == pytest.approx(0.42)
    assert c.acceptance("s", "eagle")[0] == pytest.approx(0.54)
    # From the bare prior (a method not measured yet, worth one observation) both move to
    # the mean of the prior and the observation: (0.6 + 0) / 2. So does the method-wide
    # estimate a new sequence starts from, and positions 2-4 (not observed) take c(1).
    c = cheap_and_costly()
    for m in ("ngram", "eagle"):
        c.observe_round("t", m, 4, 0)
        assert c.acceptance("t", m)[:4] == pytest.approx([0.3] * 4)
        assert c.acceptance("new", m)[:4] == pytest.approx([0.3] * 4)


def _costly_draft() -> Controller:
    """Default settings, T(n) = 20 + 0.5 n ms and a draft proposer whose call takes 12 ms
    per draft (calls of k = 1 and 3 in 12 and 36 ms: a line through 0, known, so no
    round explores k, `Controller._explore_k`), far above `shadow_latency_share` of a
    step: a costly method."""
    c = Controller(ControllerSettings(), ("draft",), MEMORY_BOUND)
    c.observe_proposer("draft", 0.012, k=1)
    c.observe_proposer("draft", 0.036, k=3)
    assert c.proposer_slope_s("draft") == pytest.approx(0.012) and c.latency_s("draft", 2) == pytest.approx(0.024)
    return c


def test_a_costly_method_below_break_even_on_its_prior_is_probed_at_once():
    # A draft model whose step costs 12 ms beside a 20.5 ms verifier step (T(n) = 20 +
    # 0.5 n ms, L(k) = 12 k ms: a costly method). On the prior c = 0.6 no k pays:
    #   k = 1: 1.6 / (21 + 12) = 0.04848 < 1 / 20.5 = 0.04878; k = 2: 1.96 / 45.5 = 0.0431.
    # Were every draft accepted, k = 1 would (2 / 33 = 0.0606): off for low acceptance. The
    # prior is a guess, so the sequence is probed in the next round, not 8 rounds later.
    c = _costly_draft()
    v = SequenceView("s")
    assert _one(c, v) == Decision(None, 0, "low_acceptance")
    assert _one(c, v) == Decision("draft", 2, "probe")
    # Both accepted: c(1) and c(2) are the mean of the prior and one acceptance, 0.8, and
    # positions 3-8 take 0.8 too. Off, the sequence counts 0.8 of its alphas (hysteresis):
    #   k = 1: (1 + 0.64) / 33 = 0.04970 > 0.04878: on;  k = 2: (1 + 0.64 + 0.512) / 45.5 = 0.0473.
    c.observe_round("s", "draft", 2, 2)
    assert c.acceptance("s", "draft") == pytest.approx([0.8] * 8)
    assert _one(c, v) == Decision("draft", 1, "goodput")
    # A draft the target always accepts: k climbs. Once every c(j) is at least 0.97,
    # k = 4 gives (1 + 3.76) / (22.5 + 48) = 0.0675 and k = 1 at most 2 / 33 = 0.0606.
    ks = []
    d = Decision("draft", 1, "goodput")
    for _ in range(40):
        c.observe_round("s", "draft", d.k, d.k)
        d = _one(c, v)
        ks.append(d.k)
    assert ks == sorted(ks) and ks[-1] >= 4, ks
    # A sequence that measured its own low acceptance and was turned off for it waits
    # for the usual probe, in the 8th round (`probe_interval`).
    c2 = _costly_draft()
    c2._state("s").by_method["draft"] = AcceptanceEstimate([0.6] * 8)
    c2.observe_round("s", "draft", 1, 0)  # EWMA 0.1: c(1) = 0.54
    assert [_one(c2, v).reason for _ in range(7)] == ["low_acceptance"] * 7
    assert _one(c2, v).reason == "probe"


def test_a_sequence_off_on_its_prior_is_probed_at_growing_gaps():
    # The costly draft of the test above, and probes that are all rejected: the sequence
    # stays off. It was turned off on the prior alone, so its probes come 1, 2, 4 and then
    # 8 rounds (probe_interval) after the last: rounds 2, 4, 8, 16, 24. Its c(1) falls as
    # the running mean 0.6 / (1 + n) after n probes, and no k paid even at 0.6.
    c = _costly_draft()
    v = SequenceView("s")
    probes = []
    for r in range(1, 25):
        d = _one(c, v)
        if d.reason == "probe":
            probes.append(r)
            c.observe_round("s", "draft", d.k, 0)
        else:
            assert d == Decision(None, 0, "low_acceptance")
    assert probes == [2, 4, 8, 16, 24]
    assert c.acceptance("s", "draft")[0] == pytest.approx(0.6 / 6)


def test_a_new_sequence_weighs_the_method_wide_estimate_as_two_observations():
    # Sequence "a" drafts 4 and has all rejected, 20 times: the method-wide estimate of
    # c(1) moves by max(0.1 / 4, 1 / evidence) a round from the prior 0.6 (evidence 1):
    # the running mean until 1 / evidence < 0.025, i.e. all 20 rounds: 0.6 / 21.
    c = _costly_draft()
    for _ in range(20):
        c.observe_round("a", "draft", 4, 0)
    prior = 0.6 / 21
    assert c.acceptance("b", "draft")[0] == pytest.approx(prior)
    # "b" starts from it, worth two observations: its first accepted round moves c(1) by
    # 1 / 3, its second by 1 / 4, ... (a costly method: EWMA 0.1 from the 8th on).
    for n in range(1, 4):
        c.observe_round("b", "draft", 1, 1)
        assert c.acceptance("b", "draft")[0] == pytest.approx((2 * prior + n) / (2 + n))


def test_a_full_batch_asks_a_cheap_method_when_its_drafts_pay_together():
    # Rows padded to 16: T = 40 + 80 j ms for 16 (j - 1) < n <= 16 j tokens. A full batch of
    # 32 decodes fills two steps (200 ms), so any draft pads a third (280 ms). 32 sequences
    # with c(j) = 0.9 and goodput 32 / 200 = 0.16 token/ms without drafts:
    # - one sequence alone: all 8 of its drafts give S_8 = 9 (1 - 0.9^8) = 5.13 tokens for
    #   280 + 1 ms: 37.13 / 281 = 0.132 < 0.16 (nor does any shorter prefix pay);
    # - together, in decreasing alpha (32 x 0.9, then 32 x 0.81, then 32 x 0.729): 16 drafts
    #   46.4 / 281 = 0.165, 32: 60.8 / 361 = 0.168, 96: 110.05 / 681 = 0.1616 all pay; the 97th
    #   pads a ninth step: 110.71 / 761 = 0.145. All 32 appear by then: each is asked for 8.
    def rows(n: int) -> int:
        return -(-n // 16) * 16

    t = StepTimeModel([(16 * j, 0.040 + 0.080 * j) for j in range(1, 19)], rows=rows)
    c = _controller(step_time=t, shadow_latency_share=0.25, sequence_share=1.0)  # c(j) as set
    views = [SequenceView(f"s{i}", greedy=True) for i in range(32)]
    for v in views:
        c._state(v.seq_id).by_method["ngram"] = AcceptanceEstimate([0.9] * 8)
    assert c.plan(views) == [Decision("ngram", 8, "goodput")] * 32
    # Once all have drafts, trim keeps the best: 16 of them 46.4 / 280 = 0.1657, 32: 60.8 / 360
    # = 0.1689, 48: 73.76 / 440 = 0.1676 (the proposer's time no longer counts): one each.
    assert c.trim([(v.seq_id, "ngram", 8, "goodput") for v in views]) == [1] * 32
    # With c(j) = 0.3 no prefix pays: 16 drafts 36.8 / 281 = 0.131. Drafts that were all
    # accepted would (48 / 281 = 0.171), so the reason is the acceptance, not the batch; the
    # sequences shadow-draft. (Judged one sequence at a time, 8 accepted drafts give
    # 40 / 281 = 0.142 and the batch looked compute bound.)
    for v in views:
        c._state(v.seq_id).by_method["ngram"] = AcceptanceEstimate([0.3] * 8)
    assert c.plan(views) == [Decision(None, 0, "low_acceptance", "ngram", 8)] * 32


def test_trim_keeps_the_drafts_that_pay_once_they_are_known():
    # T(n) = 20 + 0.5 n ms, one pass of four sequences:
    #   a: 8 drafts, c = [0.9, 0.1, ...]: alpha = 0.9, 0.09, 0.009, ...
    #   b: 8 drafts, c = [0.05, 0.6, ...]: alpha <= 0.05
    #   c: 4 drafts of a static decision (kept), prior c = 0.6: expects 0.6 + 0.36 + 0.216 + 0.1296
    #   d: no draft.
    # Fixed: 4 + 4 = 8 tokens, E = 4 + 1.3056 = 5.3056 in T = 24 ms. A draft of marginal
    # alpha pays iff (E + alpha) / (T + 0.5) > E / T, i.e. alpha > 0.5 E / T:
    #   a's first: 0.9 > 0.5 * 5.3056 / 24 = 0.111 -> E = 6.2056, T = 24.5;
    #   a's second: 0.09 < 0.5 * 6.2056 / 24.5 = 0.127, and every later alpha is smaller.
    c = _controller()
    for seq_id, conditional in (("a", [0.9] + [0.1] * 7), ("b", [0.05] + [0.6] * 7)):
        c._state(seq_id).by_method["ngram"] = AcceptanceEstimate(conditional)
    rounds = [("a", "ngram", 8, "goodput"), ("b", "ngram", 8, "goodput"), ("c", "ngram", 4, "static"),
              ("d", "ngram", 0, "no_draft")]
    assert c.trim(rounds) == [1, 0, 4, 0]
    # On the step-shaped CPU curve tokens are free up to 16 in the pass: 8 are fixed, so the
    # 8 largest alphas go in whoever's they are: a's 0.9 and 0.09, b's 0.05, 0.03, 0.018 and
    # 0.0108, a's 0.009, b's 0.00648. A 17th token costs 69 / 16 = 4.3 ms and would need
    # alpha > 4.3 * E / T = 4.3 * 6.42 / 131 = 0.21.
    c.step_time = STEP_SHAPED
    assert c.trim(rounds) == [3, 5, 4, 0]


def test_trim_prices_a_tree_depth_by_its_nodes():
    # T(n) = 20 + 0.5 n ms; one sequence with c = [0.8, 0.5, 0.5]: alpha = 0.8, 0.4, 0.2.
    # A tree with 3, 6 and 6 drafts at depths 1-3 (a (3, 2, 1) tree), priced by its nodes:
    #   depth 0: 1 / T(1) = 1 / 20.5 = 0.0488;  depth 1: 1.8 / T(4) = 1.8 / 22 = 0.0818;
    #   depth 2: 2.2 / T(10) = 2.2 / 25 = 0.0880;  depth 3: 2.4 / T(16) = 2.4 / 28 = 0.0857.
    # So 2 depths. The same acceptance as a chain keeps all 3: 2.4 / T(4) = 0.109 is best.
    c = _controller()
    c._state("s").by_method["ngram"] = AcceptanceEstimate([0.8, 0.5, 0.5])
    assert c.trim([("s", "ngram", 3, "goodput")], levels=[[3, 6, 6]]) == [2]
    assert c.tokens("ngram", 3) == 15 and c.tokens("ngram", 5) == 27  # the deepest level repeats
    assert c.trim([("s", "ngram", 3, "goodput")], levels=[None]) == [3]
    assert c.tokens("ngram", 3) == 15  # a chain round keeps the method's last tree


# ---------------------------------------------------------------------- shadow drafts
def test_off_greedy_sequence_shadow_drafts_and_comes_back_without_probes():
    # c = [0.02, 0.6, ...] and off: with the hysteresis (x 0.8) S_k <= 0.8 * 0.05 = 0.04 and
    # 0.04 * 20.5 < 0.5 k + 1 for every k: off for low acceptance (all-accepted drafts would pay).
    # (The sequences' own estimates believed in full: `sequence_share` 1.)
    c = _controller(shadow_latency_share=0.25, sequence_share=1.0)
    for seq_id in ("greedy", "sampled"):
        c._state(seq_id).by_method["ngram"] = AcceptanceEstimate([0.02] + [0.6] * 7)
        c._state(seq_id).on = False
    greedy, sampled = SequenceView("greedy", greedy=True), SequenceView("sampled")
    for _ in range(12):
        assert _one(c, greedy) == Decision(None, 0, "low_acceptance", "ngram", 8)
    # A sampled sequence has no shadows: it is probed after probe_interval rounds.
    decisions = [_one(c, sampled) for _ in range(8)]
    assert decisions[:7] == [Decision(None, 0, "low_acceptance")] * 7 and decisions[7] == Decision("ngram", 2, "probe")
    # One shadow draft that the output matched in full: c(1) = 0.02 + 0.3 * 0.98 = 0.314 and
    # c(2..8) = 0.72, S_8 = 0.314 (1 - 0.72^8) / 0.28 = 1.04; 0.8 * 1.04 * 20.5 = 17.1 > 0.5 * 8 + 1.
    c.observe_round("greedy", "ngram", 8, 8)
    assert _one(c, greedy) == Decision("ngram", 8, "goodput")


def test_greedy_sequence_measures_its_other_method_by_shadow():
    c = _controller(methods=("ngram", "draft"), shadow_latency_share=0.25)
    for _ in range(5):
        c.observe_round("s", "ngram", 8, 8)  # n-gram is the better method for this sequence
    c._state("s").by_method["draft"] = AcceptanceEstimate([0.3] * 8)
    decisions = [_one(c, SequenceView("s", greedy=True)) for _ in range(16)]
    assert all((d.method, d.k, d.reason) == ("ngram", 8, "goodput") for d in decisions)
    # The draft method is shadowed once every probe_interval rounds, never probed.
    assert [i for i, d in enumerate(decisions) if d.shadow_method == "draft"] == [7, 15]
    assert {d.shadow_k for d in decisions if d.shadow_method} == {8}


# ---------------------------------------------------------------------- the request's own policy
@pytest.mark.parametrize("share", [0.0, 0.25], ids=["costly", "cheap"])
def test_request_policy_is_never_exceeded(share):
    rng = random.Random(11)
    for policy in ("off", "static", "batch_table", "goodput"):
        c = _controller(policy=policy, methods=("ngram", "draft"), k=6, shadow_latency_share=share)
        for round_ in range(200):
            views = []
            for i in range(rng.randint(1, 12)):
                views.append(SequenceView(
                    f"s{i}", mode=rng.choice(["auto", "off", "on"]), method=rng.choice([None, "ngram", "draft"]),
                    max_k=rng.choice([None, 0, 1, 3]), remaining_tokens=rng.choice([1, 2, 5, 1000]),
                    greedy=rng.random() < 0.5))
            available = {"ngram": True, "draft": rng.random() < 0.8}
            for v, d in zip(views, c.plan(views, available)):
                assert d.reason in REASONS
                assert d.k >= 0 and (d.k == 0) == (d.method is None), d
                if d.shadow_k:  # shadows: greedy auto sequences only, a live method, within the caps
                    assert share > 0 and v.greedy and v.mode == "auto" and policy == "goodput", (v, d)
                    assert available[d.shadow_method] and d.shadow_method != d.method
                    assert d.shadow_k <= min(v.max_k if v.max_k is not None else 8, v.remaining_tokens - 1)
                    if v.method is not None:
                        assert d.shadow_method == v.method
                if v.mode == "off" or v.max_k == 0:
                    assert (d.k, d.reason) == (0, "request_off")
                if v.max_k is not None:
                    assert d.k <= v.max_k
                assert d.k <= max(v.remaining_tokens - 1, 0)
                if d.k:
                    assert available[d.method]
                    if v.method is not None:
                        assert d.method == v.method
                if v.mode == "on" and d.k:
                    assert d.reason == "request_on" and d.k == min(v.max_k or 6, v.remaining_tokens - 1)
                if policy == "off" and v.mode == "auto":
                    assert d.k == 0
                if d.k:
                    c.observe_round(v.seq_id, d.method, d.k, rng.randint(0, d.k))
            c.observe_step(rng.randint(1, 100), len(views), rng.uniform(0.01, 0.05))


def test_unavailable_method_gives_no_drafts():
    c = _controller()
    d = c.plan([SequenceView("a"), SequenceView("b", method="ngram")], {"ngram": False})
    assert [(x.k, x.reason) for x in d] == [(0, "proposer_unavailable")] * 2
    assert _controller(methods=()).plan([SequenceView("a")])[0].reason == "proposer_unavailable"
    # Policy off is the reason whatever proposers there are; a request's mode on still asks.
    off = _controller(methods=(), policy="off")
    assert [d.reason for d in off.plan([SequenceView("a"), SequenceView("b", mode="on")])] == [
        "policy_off", "proposer_unavailable"]


def test_static_and_batch_table_policies():
    s = _controller(policy="static", k=3)
    assert [(d.k, d.reason) for d in s.plan([SequenceView("a"), SequenceView("b", max_k=1)])] == [
        (3, "static"), (1, "static")]
    # Rows {1: 4, 8: 2, 32: 0}: the largest batch size not above the batch applies.
    t = _controller(policy="batch_table")
    for batch, k in [(1, 4), (7, 4), (8, 2), (31, 2), (32, 0), (40, 0)]:
        ds = t.plan([SequenceView(f"s{i}") for i in range(batch)])
        assert {(d.k, d.reason) for d in ds} == {(k, "batch_table" if k else "policy_off")}, batch
    # A fixed k of 0 is a round without drafts, counted under a documented reason.
    zero = _controller(policy="static", k=0)
    assert [(d.k, d.reason) for d in zero.plan([SequenceView("a"), SequenceView("b", mode="on")])] == [
        (0, "policy_off"), (0, "policy_off")]
    assert (zero.plan([SequenceView("c", mode="on", max_k=2)])[0].k,
            zero.plan([SequenceView("d", mode="on", max_k=2)])[0].reason) == (2, "request_on")


def test_settings_are_checked():
    with pytest.raises(ValueError, match="policy"):
        ControllerSettings(policy="sometimes")
    with pytest.raises(ValueError, match="batch_table"):
        ControllerSettings(batch_table=((4, 2),))
    with pytest.raises(ValueError, match="batch_table"):
        ControllerSettings(batch_table=((1, 4), (1, 2)))
    with pytest.raises(ValueError, match="sequence_share"):
        ControllerSettings(sequence_share=1.5)
    with pytest.raises(ValueError, match="shadow_interval"):
        ControllerSettings(shadow_interval=0)


# ---------------------------------------------------------------------- method choice
def test_method_choice_follows_each_sequence_and_probes_the_other():
    # "quoting" accepts every n-gram draft and no draft-model draft; "free" the reverse.
    c = _controller(methods=("ngram", "draft"))
    truth = {("quoting", "ngram"): 1.0, ("quoting", "draft"): 0.0, ("free", "ngram"): 0.0, ("free", "draft"): 1.0}
    used = {("quoting", "ngram"): 0, ("quoting", "draft"): 0, ("free", "ngram"): 0, ("free", "draft"): 0}
    views = [SequenceView("quoting"), SequenceView("free")]
    for round_ in range(40):
        for v, d in zip(views, c.plan(views)):
            if d.k:
                used[v.seq_id, d.method] += 1
                c.observe_round(v.seq_id, d.method, d.k, d.k if truth[v.seq_id, d.method] else 0)
    # Each settles on its own method; the other is only probed, about once per 8 rounds.
    assert used["quoting", "ngram"] >= 30 and used["free", "draft"] >= 30
    assert 2 <= used["quoting", "draft"] <= 8 and 2 <= used["free", "ngram"] <= 8


def test_due_probes_of_a_costly_method_share_one_call():
    # Eight sequences arrive one round apart (s_i first planned in round i + 1). N-gram
    # accepts everything and draft nothing, so each settles on n-gram and is due for a probe
    # of the (costly) draft method 8 rounds after its last use of it. By hand:
    #   round 8: s0 is due, and the draft method was never probed: s0 probes alone;
    #   rounds 9-15: s1..s7 fall due, but the last probe round was 8: they wait;
    #   round 16: everyone is due (s0 again: 8 rounds since its probe): one call for all 8;
    #   then every 8 rounds, all 8 together.
    # Without sharing, every round from 8 on would call the draft model for one sequence.
    c = _controller(methods=("ngram", "draft"))
    views = [SequenceView(f"s{i}") for i in range(8)]
    probed: dict[int, list[str]] = {}
    for round_ in range(1, 41):
        running = views[:round_]
        for v, d in zip(running, c.plan(running)):
            if d.k:
                c.observe_round(v.seq_id, d.method, d.k, d.k if d.method == "ngram" else 0)
                if d.method == "draft":
                    assert d.reason == "probe"
                    probed.setdefault(round_, []).append(v.seq_id)
    everyone = [v.seq_id for v in views]
    assert probed == {8: ["s0"], 16: everyone, 24: everyone, 32: everyone, 40: everyone}


def test_probes_go_only_as_far_as_they_would_pay_if_accepted():
    # Eight sequences whose every draft is rejected, so they are soon off for low acceptance
    # and re-measured by probes (probe_k = 2, a costly method: no shadows). T is flat to 16
    # tokens, then steep: T(8) = 50.93 ms, T(16) = 52 ms, T(24) = 76.67 ms; L = 1 ms. No
    # drafts: 8 / T(8) = 157.1 tokens/s. A probe emits at most its 2 drafts, so probes pay,
    # if all accepted, while (8 + 2 p) / (T(8 + tokens) + L) > 157.1 for p of them:
    #   chain (2 tokens a probe): p = 8 -> 24 / 77.67 ms = 309: all 8 go in one round;
    #   tree (4, 1, 1) (depth 2 = 8 nodes): p = 1 -> 10 / 53 ms = 188.7 goes,
    #   p = 2 -> 12 / 77.67 ms = 154.5 does not: one probe a round at most.
    # Without the check every due sequence joined the probe round: 8 trees of 8 nodes, 72
    # tokens, 4.4x the pass of no drafts (T(72) = 224.7 ms) for at most 16 more tokens.
    step = StepTimeModel([(1, 0.050), (16, 0.052), (64, 0.200)])
    most = {}
    for name, levels in (("chain", None), ("tree", [4, 4, 4])):
        c = _controller(step, methods=("eagle",))
        if levels is not None:
            c.trim([("setup", "eagle", 3, "static")], levels=[levels])
        assert c.tokens("eagle", 2) == (2 if levels is None else 8)
        views = [SequenceView(f"s{i}") for i in range(8)]
        per_round = []
        for _ in range(40):
            decisions = c.plan(views)
            for v, d in zip(views, decisions):
                if d.k:
                    c.observe_round(v.seq_id, d.method, d.k, 0)
            per_round.append(sum(d.reason == "probe" for d in decisions))
        most[name] = max(per_round)
        assert sum(per_round) > 0, name  # off sequences are still re-measured
    assert most == {"chain": 8, "tree": 1}


def test_a_tree_too_wide_for_the_batch_is_compute_bound():
    # T(n) = 10 ms + 2 ms n, L = 1 ms. A batch of 8 without drafts: 8 / 26 ms = 307.7
    # tokens/s. Every draft accepted, a chain's first pays: 9 / (28 + 1) ms = 310.3, so the
    # sequences are off for their acceptance (the prior 0.6: 8.6 / 29 ms = 296.6 does not
    # pay). A (4, 1, 1) tree's depth 1 costs 4 nodes: 9 / (34 + 1) ms = 257 even if
    # accepted, and more depths or sequences only lower it (1 token for 4 nodes, then 1
    # for 1 at 2 ms each against 307.7 tokens/s at 3.25 ms a token): compute bound.
    step = StepTimeModel.linear(0.010, 0.002)
    views = [SequenceView(f"s{i}") for i in range(8)]
    chain = _controller(step, methods=("eagle",))
    assert {d.reason for d in chain.plan(views)} == {"low_acceptance"}
    tree = _controller(step, methods=("eagle",))
    tree.trim([("setup", "eagle", 3, "static")], levels=[[4, 4, 4]])
    assert {d.reason for d in tree.plan(views)} == {"batch_compute_bound"}


def test_the_module_examples_hold():
    """The controller's docstring examples (the fallback rule, the acceptance estimate)."""
    import doctest

    import verifier.controller

    assert doctest.testmod(verifier.controller).failed == 0


@pytest.mark.parametrize("fallbacks, methods, problem", [
    ({"ngram": "eagle"}, ["ngram", "eagle"], None),
    ({"ngram": "eagle", "draft": "eagle"}, ["ngram", "eagle", "draft"], None),
    ({"ngram": "eagle"}, ["ngram"], "ngram's fallback must be another configured method"),
    ({"ngram": "ngram"}, ["ngram", "eagle"], "ngram's fallback must be another configured method"),
    ({"ngram": "eagle", "eagle": "draft"}, ["ngram", "eagle", "draft"], "ngram's fallback 'eagle' has a fallback"),
    ({"draft": "ngram"}, ["ngram"], "'draft' has a fallback but is not a configured method"),
])
def test_a_fallback_is_another_configured_method_without_its_own(fallbacks, methods, problem):
    from verifier.controller import fallback_problem

    found = fallback_problem(fallbacks, methods)
    assert (found is None) if problem is None else (found is not None and found.startswith(problem)), found
