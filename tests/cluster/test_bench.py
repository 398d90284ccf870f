"""`splitspec bench`'s pure parts: modes, SSE parsing, timings, aggregation, reports (no Ray)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal

import pytest

from cluster.bench import (
    RequestRecord,
    Terminated,
    api_base,
    combine_repeats,
    parse_mode,
    parse_modes,
    percentile,
    record_from_stream,
    request_timings,
    balanced_order,
    sigterm_interrupts,
    summarise_run,
)
from cluster.bench_report import against_best_static, best_modes, format_table, paired_ratio, plot_rows

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- modes
@pytest.mark.parametrize("text, name, speculation", [
    ("off", "off", {"mode": "off"}),
    ("static:2", "static:2", {"mode": "on", "max_k": 2}),
    (" static:08 ", "static:8", {"mode": "on", "max_k": 8}),
    ("auto", "auto", {"mode": "auto"}),
    ("static:4@ngram", "static:4@ngram", {"mode": "on", "max_k": 4, "method": "ngram"}),
    ("auto@draft-model", "auto@draft-model", {"mode": "auto", "method": "draft-model"}),
    ("auto:08", "auto:8", {"mode": "auto", "max_k": 8}),
    ("auto:3@ngram", "auto:3@ngram", {"mode": "auto", "max_k": 3, "method": "ngram"}),
])
def test_parse_mode(text, name, speculation):
    mode = parse_mode(text)
    assert (mode.name, mode.speculation) == (name, speculation)


@pytest.mark.parametrize("text", ["", "on", "static", "static:", "static:0", "static:-1", "static:k", "off@ngram",
                                  "auto@", "auto@a b", "AUTO", "static:4@ngram@x", "auto:", "auto:0", "auto:x"])
def test_parse_mode_rejects(text):
    with pytest.raises(ValueError, match="got"):
        parse_mode(text)


def test_parse_modes_keeps_order_and_rejects_repeats_and_empty():
    assert [m.name for m in parse_modes("off,static:2,auto")] == ["off", "static:2", "auto"]
    with pytest.raises(ValueError, match="repeat"):
        parse_modes("off,static:2,off")
    with pytest.raises(ValueError, match="no modes"):
        parse_modes(" , ")


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_order_puts_each_mode_first_once_and_after_each_other_equally_often(n):
    modes = [f"m{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    rows = [balanced_order(modes, r) for r in range(2 * cycle)]
    assert all(sorted(row) == modes for row in rows)
    assert rows[cycle:] == rows[:cycle]  # then it starts over
    # Every cycle: each mode first once (twice for odd n), ...
    firsts = collections.Counter(row[0] for row in rows[:cycle])
    assert firsts == {m: cycle // n for m in modes}
    # ... and each ordered pair of modes back to back equally often (once, or twice for odd n).
    pairs = collections.Counter((a, b) for row in rows[:cycle] for a, b in zip(row, row[1:]))
    assert pairs == {(a, b): cycle // n for a in modes for b in modes if a != b}


def test_balanced_order_of_four_and_three_by_hand():
    # A plain rotation ran b right after a in every repeat; here b follows a, c and d once each.
    assert ["".join(balanced_order("abcd", r)) for r in range(4)] == ["abdc", "bcad", "cdba", "dacb"]
    assert ["".join(balanced_order("abc", r)) for r in range(6)] == ["abc", "bca", "cab", "cba", "acb", "bac"]


def test_api_base_accepts_the_root_or_v1():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert api_base(url) == "http://h:8000/v1"
    assert api_base("http://h:8000/tight") == "http://h:8000/tight/v1"


# ---------------------------------------------------------------------- SSE
SPEC = {"mode": "on", "method": "ngram", "rounds": 3, "rounds_with_drafts": 2, "drafted": 8, "accepted": 3,
        "acceptance_rate": 0.375, "mean_acceptance_length": 2.5, "tokens_per_second": 12.0,
        "rounds_by_method": {"ngram": 2}, "rounds_off": {"no_draft": 1}}
STREAM = [  # (arrival time s, line) as a chat stream from our ingress arrives
    (0.10, 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'),
    (0.10, ""),
    (0.25, 'data: {"choices":[{"index":0,"delta":{"content":"def"},"finish_reason":null}]}'),
    (0.25, ""),
    (0.30, ": keep-alive comment"),
    (0.40, 'data:{"choices":[{"index":0,"delta":{"content":" add(a, b):"},"finish_reason":null}]}'),
    (0.55, 'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}],"speculation":'
           + json.dumps(SPEC) + "}"),
    (0.56, 'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":6,"total_tokens":36},'
           '"speculation":' + json.dumps(SPEC) + "}"),
    (0.57, "data: [DONE]"),
    (0.90, 'data: {"choices":[{"index":0,"delta":{"content":"after the end"}}]}'),
]


def test_record_from_stream():
    r = record_from_stream(0.05, STREAM)
    assert r.error is None
    # Only the two chunks with non-empty content count (not the role chunk, not the final one).
    assert r.content_s == (0.25, 0.40)
    assert r.end_s == 0.57  # data: [DONE]; the line after it is never read
    assert r.output_tokens == 6
    assert (r.drafted, r.accepted, r.rounds, r.rounds_with_drafts) == (8, 3, 3, 2)
    assert (r.rounds_by_method, r.rounds_off) == ({"ngram": 2}, {"no_draft": 1})


def test_record_from_stream_of_a_server_without_speculation_counts_zero():
    lines = [(0.1, 'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}'),
             (0.2, 'data: {"choices":[],"usage":{"completion_tokens":1}}'), (0.2, "data: [DONE]")]
    r = record_from_stream(0.0, lines)
    assert r.error is None and r.output_tokens == 1
    assert (r.drafted, r.accepted, r.rounds, r.rounds_with_drafts) == (0, 0, 0, 0)
    assert (r.rounds_by_method, r.rounds_off) == ({}, {})


@pytest.mark.parametrize("lines, message", [
    (STREAM[:8], "before data: [DONE]"),
    ([STREAM[2], (0.3, "data: [DONE]")], "no usage chunk"),
    ([(0.1, 'data: {"error":{"message":"the verifier failed","type":"internal"}}')], "the verifier failed"),
    ([(0.1, "data: {not json")], "not a JSON object"),
    ([(0.1, 'data: {"choices":[],"usage":{"prompt_tokens":3}}'), (0.2, "data: [DONE]")], "malformed usage"),
])
def test_record_from_stream_errors(lines, message):
    r = record_from_stream(0.0, lines)
    assert r.error is not None and message in r.error


# ---------------------------------------------------------------------- timings and aggregation
def test_percentile_is_linear_between_ranks():
    assert percentile([], 50) == 0.0
    assert percentile([7], 99) == 7
    assert percentile([40, 10, 30, 20], 50) == 25.0  # rank 0.5 * 3 = 1.5: halfway from 20 to 30
    assert percentile([10, 20, 30, 40], 99) == pytest.approx(39.7)  # rank 2.97: 30 + 0.97 * 10
    assert percentile([10, 20, 30, 40], 0) == 10 and percentile([10, 20, 30, 40], 100) == 40


def test_request_timings():
    # Sent at 1.0; content at 1.5, 1.7, 2.2; [DONE] at 2.2; 5 tokens.
    ttft, tpot, itls, e2e = request_timings(RequestRecord(1.0, (1.5, 1.7, 2.2), 2.2, 5))
    assert ttft == pytest.approx(0.5)
    assert itls == pytest.approx([0.2, 0.5])
    assert e2e == pytest.approx(1.2)
    assert tpot == pytest.approx((1.2 - 0.5) / 4)  # = 0.175
    # One token: no TPOT; no content (e.g. only EOS): no TTFT either.
    assert request_timings(RequestRecord(0.0, (0.3,), 0.3, 1))[1] is None
    assert request_timings(RequestRecord(0.0, (), 0.3, 1))[:3] == (None, None, [])


RECORDS = [
    # A: TTFT 100 ms, ITLs 200 and 100 ms, e2e 500 ms, TPOT (500 - 100) / (9 - 1) = 50 ms.
    RequestRecord(0.0, (0.1, 0.3, 0.4), 0.5, 9, drafted=8, accepted=6, rounds=4, rounds_with_drafts=3,
                  rounds_by_method={"ngram": 2, "eagle": 1}, rounds_off={"no_draft": 1}),
    # B: TTFT 200 ms, ITL 100 ms, e2e 600 ms, TPOT (600 - 200) / (5 - 1) = 100 ms.
    RequestRecord(1.0, (1.2, 1.3), 1.6, 5, drafted=4, accepted=1, rounds=3, rounds_with_drafts=2,
                  rounds_by_method={"ngram": 2}, rounds_off={"low_acceptance": 1}),
    # C: one token, TTFT 400 ms, no ITL, e2e 400 ms, no TPOT.
    RequestRecord(2.0, (2.4,), 2.4, 1, rounds=1, rounds_off={"no_draft": 1}),
    # D: failed; counts as an error only.
    RequestRecord(2.5, error="HTTP 429: full"),
]


def test_summarise_run_by_hand():
    s = summarise_run(RECORDS, duration_s=3.0)
    assert (s["requests"], s["errors"]) == (4, 1)
    assert s["output_tokens"] == 9 + 5 + 1
    assert s["output_tokens_per_s"] == pytest.approx(15 / 3.0)
    assert s["request_throughput"] == pytest.approx(3 / 3.0)  # successful requests only
    # TTFTs [100, 200, 400]: p50 200; p99 rank 0.99 * 2 = 1.98 -> 200 + 0.98 * 200 = 396.
    assert s["ttft_ms_p50"] == pytest.approx(200) and s["ttft_ms_p99"] == pytest.approx(396)
    # TPOTs [50, 100]: p50 75; p99 rank 0.99 -> 50 + 0.99 * 50 = 99.5.
    assert s["tpot_ms_p50"] == pytest.approx(75) and s["tpot_ms_p99"] == pytest.approx(99.5)
    # ITLs [100, 100, 200]: p50 100; p99 rank 1.98 -> 100 + 0.98 * 100 = 198.
    assert s["itl_ms_p50"] == pytest.approx(100) and s["itl_ms_p99"] == pytest.approx(198)
    # End-to-end [400, 500, 600]: p50 500.
    assert s["e2e_ms_p50"] == pytest.approx(500)
    # Drafted 8 + 4 = 12, accepted 6 + 1 = 7, rounds with drafts 3 + 2 = 5.
    assert (s["drafted"], s["accepted"], s["rounds"], s["rounds_with_drafts"]) == (12, 7, 8, 5)
    assert s["acceptance_rate"] == pytest.approx(7 / 12)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 7 / 5)  # = 2.4
    assert s["rounds_by_method"] == {"eagle": 1, "ngram": 4}
    assert s["rounds_off"] == {"low_acceptance": 1, "no_draft": 2}


def test_summarise_run_without_drafts_or_successes():
    plain = summarise_run([RequestRecord(0.0, (0.1, 0.2), 0.2, 2, rounds=2)], 1.0)
    assert plain["acceptance_rate"] == 0.0 and plain["mean_acceptance_length"] == 1.0
    failed = summarise_run([RequestRecord(0.0, error="boom")], 1.0)
    assert (failed["errors"], failed["output_tokens"], failed["ttft_ms_p50"], failed["output_tokens_per_s"]) == (1, 0, 0.0, 0.0)


def test_combine_repeats_takes_medians_and_sums_errors():
    runs = [{"requests": 4, "errors": e, "output_tokens": t, "output_tokens_per_s": v, "drafted": d}
            for e, t, v, d in ((0, 100, 10.0, 40), (1, 90, 30.0, 36), (2, 95, 20.0, 38))]
    row = combine_repeats(runs)
    assert row == {"requests": 4, "errors": 3, "output_tokens": 95, "output_tokens_per_s": 20.0, "drafted": 38,
                   "repeats": 3, "output_tokens_per_s_by_repeat": [10.0, 30.0, 20.0]}
    # Two repeats: floats take the mean of the middle two, counts the lower one (still a count).
    row = combine_repeats(runs[:2])
    assert (row["output_tokens_per_s"], row["output_tokens"], row["drafted"]) == (20.0, 90, 36)
    # Tallies: summed over repeats, key by key.
    tallies = combine_repeats([{"errors": 0, "output_tokens_per_s": 1.0, "rounds_off": {"no_draft": n, **extra}}
                               for n, extra in ((5, {"probe": 2}), (3, {}), (4, {"probe": 6}))])
    assert tallies["rounds_off"] == {"no_draft": 12, "probe": 8}


# ---------------------------------------------------------------------- workloads
def test_mix_interleaves_the_three_workloads():
    from cluster.workloads import WORKLOADS, load_conversations

    assert "mix" in WORKLOADS
    code, summ, chat = (load_conversations(w) for w in ("code_edit", "summarize", "chat"))
    assert min(map(len, (code, summ, chat))) >= 16
    mix = load_conversations("mix")
    assert mix[:6] == [code[0], summ[0], chat[0], code[1], summ[1], chat[1]]
    assert len(mix) == len(code) + len(summ) + len(chat)


# ---------------------------------------------------------------------- reports
def _row(workload, concurrency, mode, tps, tpot):
    return {"workload": workload, "concurrency": concurrency, "mode": mode, "output_tokens_per_s": tps,
            "tpot_ms_p50": tpot, "ttft_ms_p50": 50.0, "itl_ms_p50": 40.0, "acceptance_rate": 0.5,
            "mean_acceptance_length": 1.8, "errors": 0}


ROWS = [_row(w, c, m, tps * c, tpot) for w in ("code_edit", "chat") for c in (1, 2, 4)
        for m, tps, tpot in (("off", 10.0, 100.0), ("static:4", 15.0, 70.0), ("auto", 12.0, 80.0))]


def test_table_marks_the_best_mode_and_the_ratio_to_off():
    assert best_modes(ROWS) == {(w, c, "static:4") for w in ("code_edit", "chat") for c in (1, 2, 4)}
    text = format_table(ROWS)
    line = next(x for x in text.splitlines() if x.split()[:2] == ["4", "static:4"])
    assert "60.0*" in line and "1.50x" in line  # 15 * 4 tok/s, 15 / 10 of off
    # Without an off row at that concurrency the ratio column says "-".
    no_off = format_table([r for r in ROWS if r["mode"] != "off"]).splitlines()
    ratios = [x.split()[3] for x in no_off if x.split() and x.split()[0].isdigit()]
    assert ratios == ["-"] * 12


def _repeats(mode, by_repeat, concurrency=8):
    row = _row("mix", concurrency, mode, sorted(by_repeat)[len(by_repeat) // 2], 100.0)
    return {**row, "output_tokens_per_s_by_repeat": by_repeat}


# Three repeats whose pace drifts: the second ran at half speed for every mode.
PAIRED = [_repeats("off", [40.0, 20.0, 44.0]), _repeats("static:2", [48.0, 25.0, 52.8]),
          _repeats("static:4", [50.0, 21.0, 48.4]), _repeats("auto", [52.0, 26.0, 50.6])]


def test_paired_ratio_divides_out_the_pace_of_each_repeat():
    off, s2, s4, auto = PAIRED
    # static:2 / off per repeat: 1.2, 1.25, 1.2 -> median 1.2; static:4: 1.25, 1.05, 1.1 -> 1.1.
    assert paired_ratio(s2, off) == pytest.approx(1.2)
    assert paired_ratio(s4, off) == pytest.approx(1.1)
    # auto / static:2: 52/48, 26/25, 50.6/52.8 -> 1.0833, 1.04, 0.9583 -> 1.04.
    assert paired_ratio(auto, s2) == pytest.approx(1.04)
    # Nothing to pair: no per-repeat figures, or counts that differ.
    assert paired_ratio(_row("mix", 8, "auto", 1.0, 1.0), off) is None
    assert paired_ratio(_repeats("auto", [1.0, 2.0]), off) is None


def test_against_best_static_by_hand():
    (v,) = against_best_static(PAIRED)
    # Medians: static:2 48.0, static:4 48.4 (the best), auto 50.6 -> 50.6 / 48.4.
    assert (v["mode"], v["best_static"]) == ("auto", "static:4")
    assert v["ratio"] == pytest.approx(50.6 / 48.4)
    # Paired: auto / static:4 = 1.04, 1.2381, 1.0455 -> 1.0455; / static:2 -> 1.04, the lower.
    assert (v["paired"], v["paired_static"]) == (pytest.approx(1.04), "static:2")
    text = format_table(PAIRED)
    assert "mix c=8 auto: 1.05x of static:4; paired 1.04x of static:2" in text
    line = next(x for x in text.splitlines() if x.split()[:2] == ["8", "static:4"])
    assert line.split()[3:5] == ["1.21x", "1.10x"]  # 48.4 / 40.0, the medians; paired 1.1
    # No static mode, or no auto mode: nothing to say.
    assert against_best_static([r for r in PAIRED if not r["mode"].startswith("static")]) == []
    assert against_best_static(PAIRED[:3]) == []


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "bench.png"
    plot_rows(ROWS, path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------------- command line
def test_bench_help_and_arguments(capsys):
    from cluster.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["bench", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--url", "--config", "--workload", "--concurrency", "--modes", "--requests", "--max-tokens",
                 "--repeats", "--json", "--plot", "--model"):
        assert flag in help_text
    args = parser.parse_args(["bench", "--url", "http://h:1", "--workload", "mix", "--concurrency", "1,8",
                              "--modes", "off,static:4@ngram", "--requests", "3", "--repeats", "2"])
    assert (args.url, args.workload, args.concurrency, args.requests, args.repeats) == (
        "http://h:1", ["mix"], [1, 8], 3, 2)
    assert [m.speculation for m in args.modes] == [{"mode": "off"}, {"mode": "on", "max_k": 4, "method": "ngram"}]
    defaults = parser.parse_args(["bench"])
    assert [m.name for m in defaults.modes] == ["off", "static:2", "static:4", "static:8", "auto"]
    assert defaults.concurrency == [1, 8, 32] and defaults.requests is None and defaults.repeats == 1


@pytest.mark.parametrize("argv", [["--modes", "off,static:0"], ["--modes", "fast"], ["--concurrency", "0,2"],
                                  ["--requests", "0"], ["--url", "http://h:1", "--config", "c.yaml"],
                                  ["--workload", "nope"]])
def test_bench_bad_arguments_exit_2(argv, capsys):
    from cluster.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_sigterm_unwinds_the_bench_like_ctrl_c():
    """`splitspec bench --config` stops the service it started on SIGTERM too: within
    `sigterm_interrupts` the signal raises Terminated (a KeyboardInterrupt) out of the
    running event loop, `finally` blocks run, and the previous handler comes back."""
    before = signal.getsignal(signal.SIGTERM)
    unwound = []

    async def bench_in_flight():
        os.kill(os.getpid(), signal.SIGTERM)  # this test's own process
        await asyncio.sleep(30)

    with pytest.raises(Terminated) as exc:
        with sigterm_interrupts():
            try:
                asyncio.run(bench_in_flight())
            finally:
                unwound.append(signal.getsignal(signal.SIGTERM) is not before)
    assert isinstance(exc.value, KeyboardInterrupt) and exc.value.args == (signal.SIGTERM,)
    assert unwound == [True] and signal.getsignal(signal.SIGTERM) is before


def test_serve_bench_splits_each_step_by_hand():
    """serve-bench's per-step split: 10 steps, 0.2 s waiting for proposers and 0.5 s in
    passes over a 1.0 s run is 20 + 50 ms per step, and the other 30 ms are the rest."""
    from cluster.serve_bench import _engine_counters, _per_step
    from verifier.engine import EngineStats

    before = _engine_counters(EngineStats(num_steps=5, propose_s=0.1, pass_s=0.3))
    after = _engine_counters({"num_steps": 15, "propose_s": 0.3, "pass_s": 0.8})
    assert _per_step(before, after, 1.0) == {"steps": 10, "propose_ms": 20.0, "pass_ms": 50.0, "rest_ms": 30.0}
    assert _per_step(after, after, 1.0) == {"steps": 0}


def test_doctests():
    import doctest

    import cluster.bench
    import cluster.bench_report

    for module in (cluster.bench, cluster.bench_report):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
