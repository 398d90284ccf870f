"""The verifier's Ray metrics, scraped from the local cluster's Prometheus endpoint.

Traffic goes through the real OpenAI client to the `main` app (n-gram proposer, one
verifier replica). Counters are cumulative since the replica started and other tests use
the same app, so the test scrapes before and after its own requests, each time waiting
until the exported series have caught up with the engine's own counters (`stats()` of
the verifier replica), and checks the *difference* against the per-request stats the API
returned: drafted, accepted, rounds with drafts, mean acceptance length.
"""

from __future__ import annotations

import collections
import re
import time
import urllib.request

import openai
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, application: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]} of the ray_splitspec_* series of one application."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = collections.defaultdict(list)
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not m.group(1).startswith("ray_splitspec_"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if labels.get("application") == application:
            out[m.group(1)].append((labels, float(m.group(3))))
    return out


def total(series, name: str, **match: str) -> float:
    return sum(v for labels, v in series.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


def settled(url: str, app) -> tuple[dict, dict]:
    """(scrape, engine counters) once the exported counters equal the engine's."""
    deadline = time.monotonic() + 60
    while True:
        engine = app.verifier().stats.remote().result()["engine"]
        series = scrape(url, app.name)
        exported = (total(series, "ray_splitspec_draft_tokens_total"), total(series, "ray_splitspec_accepted_tokens_total"),
                    total(series, "ray_splitspec_output_tokens_total"))
        if exported == (engine["num_drafted"], engine["num_accepted"], engine["num_output_tokens"]):
            return series, engine
        if time.monotonic() > deadline:
            pytest.fail(f"exported (drafted, accepted, output tokens) {exported} never matched the engine's {engine}")
        time.sleep(0.5)


def test_counters_after_traffic_match_the_engine(main_app, metrics_url):
    from cluster.workloads import load_conversations

    before, _ = settled(metrics_url, main_app)
    client = openai.OpenAI(base_url=main_app.base_url, api_key="unused", timeout=120)
    stats = []
    for conversation in load_conversations("code_edit")[2:5]:  # quotes its input: n-gram drafts
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=conversation, max_tokens=32,
                                           temperature=0.0, extra_body={"speculation": {"mode": "on", "max_k": 4}})
        stats.append(r.model_extra["speculation"])
    after, engine = settled(metrics_url, main_app)

    def delta(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    rounds_with_drafts = sum(s["rounds_with_drafts"] for s in stats)
    assert drafted > 0
    # This traffic, as the API reported it per request.
    assert delta("ray_splitspec_draft_tokens_total", method="ngram") == drafted
    assert delta("ray_splitspec_accepted_tokens_total", method="ngram") == accepted
    assert delta("ray_splitspec_drafts_total", method="ngram") == rounds_with_drafts
    mal_series = 1 + delta("ray_splitspec_accepted_tokens_total") / delta("ray_splitspec_drafts_total")
    mal_requests = 1 + accepted / rounds_with_drafts
    assert mal_series == pytest.approx(mal_requests, abs=1e-9)
    # Each response's own figure, weighted by its drafting rounds, gives the same number.
    weighted = sum(s["mean_acceptance_length"] * s["rounds_with_drafts"] for s in stats) / rounds_with_drafts
    assert mal_series == pytest.approx(weighted, abs=1e-3)  # the API rounds to 4 decimals
    assert delta("ray_splitspec_output_tokens_total") == sum(s["num_output_tokens"] for s in stats)
    assert delta("ray_splitspec_requests_finished_total") == len(stats)
    assert delta("ray_splitspec_ttft_ms_count") == len(stats)
    assert delta("ray_splitspec_e2e_latency_ms_count") == len(stats)
    rounds = sum(s["rounds"] for s in stats)
    assert delta("ray_splitspec_controller_decisions_total") == rounds
    assert delta("ray_splitspec_controller_decisions_total", speculating="true") == rounds_with_drafts
    assert delta("ray_splitspec_proposer_rpc_latency_ms_count", method="ngram") >= 1

    # Whole-series consistency against the engine's counters since start.
    for method in {labels["method"] for labels, _ in after["ray_splitspec_draft_tokens_total"]}:
        assert total(after, "ray_splitspec_accepted_tokens_total", method=method) <= \
            total(after, "ray_splitspec_draft_tokens_total", method=method)
    per_position = collections.Counter()
    for labels, v in after["ray_splitspec_accepted_tokens_per_position_total"]:
        per_position[int(labels["position"])] += v
    counts = [per_position[i] for i in range(max(per_position) + 1)]
    assert counts == sorted(counts, reverse=True), f"per-position counts increase: {counts}"
    assert counts == engine["accepted_per_position"][: len(counts)]
    assert sum(counts) == engine["num_accepted"]
    assert 1 + total(after, "ray_splitspec_accepted_tokens_total") / total(after, "ray_splitspec_drafts_total") == \
        pytest.approx(1 + engine["num_accepted"] / engine["num_rounds_with_drafts"], abs=1e-9)
    assert total(after, "ray_splitspec_running_seqs") == 0
    assert total(after, "ray_splitspec_kv_cache_usage_ratio") == 0


def test_ingress_metrics_route_serves_the_splitspec_series(main_app):
    """GET /metrics on the HTTP port: this node's ray_splitspec_* series in Prometheus text."""
    import httpx

    r = httpx.get(f"{main_app.http}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    assert lines and all("ray_splitspec_" in line for line in lines)
    assert any(line.startswith("# TYPE ray_splitspec_draft_tokens_total counter") for line in lines)
    assert re.search(r'^ray_splitspec_rounds_total\{[^}]*application="main"', r.text, re.M)
