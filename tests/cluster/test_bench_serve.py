"""`splitspec bench --url` against the session's real service (n-gram, goodput controller)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

MAX_TOKENS = 16
REQUESTS = 2
REQUIRED = {
    "workload", "mode", "concurrency", "requests", "errors", "output_tokens", "duration_s", "output_tokens_per_s",
    "request_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99",
    "e2e_ms_p50", "acceptance_rate", "mean_acceptance_length", "drafted", "accepted", "rounds",
    "rounds_with_drafts", "repeats",
}


def test_bench_rows_against_the_service(main_app, tmp_path, capsys):
    from cluster.cli import main

    out = tmp_path / "rows.json"
    assert main(["bench", "--url", main_app.base_url, "--workload", "code_edit", "--concurrency", "1,2",
                 "--modes", "off,static:2,auto", "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list)
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (c, m) for c in (1, 2) for m in ("off", "static:2", "auto")]
    for r in rows:
        assert REQUIRED <= r.keys(), REQUIRED - r.keys()
        assert (r["workload"], r["requests"], r["errors"], r["repeats"]) == ("code_edit", REQUESTS, 0, 1)
        assert 0 < r["output_tokens"] <= REQUESTS * MAX_TOKENS  # fewer only when EOS ends an answer
        assert r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0
        assert r["accepted"] <= r["drafted"]
        if r["mode"] == "off":
            assert (r["drafted"], r["mean_acceptance_length"], r["acceptance_rate"]) == (0, 1.0, 0.0)
        elif r["mode"] == "static:2":
            assert r["drafted"] > 0
            # At most 2 drafts per round that drafted.
            assert r["drafted"] <= 2 * r["rounds_with_drafts"]
            assert 1.0 <= r["mean_acceptance_length"] <= 3.0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "code_edit"
    assert [x.split()[:2] for x in lines if x.split()[1:2] == ["static:2"]] == [["1", "static:2"], ["2", "static:2"]]
    # Under the table, auto against the static mode at each concurrency (one repeat: paired
    # is that repeat's ratio).
    versus = [x.strip() for x in lines if x.strip().startswith("code_edit c=")]
    assert [x.split(":")[0] for x in versus] == ["code_edit c=1 auto", "code_edit c=2 auto"]
    assert all(x.endswith("of static:2") for x in versus), versus
