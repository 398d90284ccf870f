"""`splitspec serve-bench`: the service over HTTP vs the in-process engine, side by side.

Starts a local Ray cluster and the service from a config, then for each repeat sends the
workload's greedy chat requests one at a time (concurrency 1) through the OpenAI HTTP API
(streaming) and through an in-process engine built from the same config (same model,
dtype, proposer method and k, torch threads), alternating which goes first. The figure is
output tokens per second of wall time; the summary quotes the median over repeats of the
per-repeat ratio HTTP / local. It also checks that both emitted the same tokens, and says
where each side's time went per engine step: choosing k and waiting for the proposers
(`propose_ms`), the verifier's pass (`pass_ms`), and the rest of the wall time (`rest_ms`:
the engine loop, and for HTTP the ingress, Serve and streaming).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

logger = logging.getLogger(__name__)

#: The Serve application the benchmark deploys, reads the verifier's counters from and stops.
APP = "splitspec"


def _http_run(base_url: str, model: str, conversations, max_tokens: int):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    outputs, accepted, drafted = [], 0, 0
    start = time.perf_counter()
    for c in conversations:
        ids = []
        stream = client.chat.completions.create(
            model=model, messages=c, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        for chunk in stream:
            for choice in chunk.choices:
                ids.extend((choice.model_extra or {}).get("token_ids") or [])
            if chunk.usage is not None:
                spec = chunk.model_extra["speculation"]
                accepted += spec["accepted"]
                drafted += spec["drafted"]
        outputs.append(ids)
    return outputs, time.perf_counter() - start, accepted, drafted


def _engine_counters(stats) -> tuple[int, float, float]:
    """(steps, propose_s, pass_s) of an `EngineStats` or its dict."""
    get = stats.get if isinstance(stats, dict) else lambda name: getattr(stats, name)
    return get("num_steps"), get("propose_s"), get("pass_s")


def _per_step(before, after, wall_s: float) -> dict:
    steps = after[0] - before[0]
    if steps <= 0:
        return {"steps": 0}
    propose_ms, pass_ms = (after[1] - before[1]) * 1e3 / steps, (after[2] - before[2]) * 1e3 / steps
    return {"steps": steps, "propose_ms": round(propose_ms, 2), "pass_ms": round(pass_ms, 2),
            "rest_ms": round(wall_s * 1e3 / steps - propose_ms - pass_ms, 2)}


def _local_run(engine, prompts, max_tokens: int):
    from verifier.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    results = [engine.generate_sync([p], params)[0] for p in prompts]
    wall = time.perf_counter() - start
    return ([r.token_ids for r in results], wall, sum(r.stats.accepted for r in results),
            sum(r.stats.drafted for r in results))


def run(args: argparse.Namespace) -> dict:
    import torch
    from ray import serve

    from cluster.config import LOCAL_CONFIG_PATH, load_config
    from cluster.deployments import served_model_name
    from cluster.local import engine_from_config, load_model_and_tokenizer, verifier_threads
    from cluster.service import deploy, init_ray, start_serve, stop, wait_healthy
    from cluster.workloads import load_conversations
    from proposers.registry import build_proposer

    config = load_config(args.config or LOCAL_CONFIG_PATH)
    conversations = load_conversations(args.workload)[: args.requests]
    model, tokenizer = load_model_and_tokenizer(config.model.path, config.model.tokenizer, config.model.dtype,
                                                config.model.chat_template)
    # The same threads as the verifier replica computes for itself on this machine.
    threads = verifier_threads(config.verifier)
    if threads:
        torch.set_num_threads(threads)
    engine = engine_from_config(config, model, tokenizer,
                                {p.method: build_proposer(p.method, dict(p.options)) for p in config.proposers})
    prompts = [tokenizer.encode_chat(c) for c in conversations]

    init_ray(None)
    rows = []
    try:
        http_port, _ = start_serve("127.0.0.1", 0, 0)
        deploy(config, APP)
        wait_healthy(f"http://127.0.0.1:{http_port}/health")
        base = f"http://127.0.0.1:{http_port}/v1"
        name = served_model_name(config)
        verifier = serve.get_deployment_handle("Verifier", APP)
        counters = {"http": lambda: _engine_counters(verifier.stats.remote().result()["engine"]),
                    "local": lambda: _engine_counters(engine.stats)}
        _http_run(base, name, conversations[:1], 8)  # warm-up: connections, first-call costs
        _local_run(engine, prompts[:1], 8)
        for repeat in range(args.repeats):
            order = ("http", "local") if repeat % 2 == 0 else ("local", "http")
            got, steps = {}, {}
            for mode in order:
                before = counters[mode]()
                if mode == "http":
                    got[mode] = _http_run(base, name, conversations, args.max_tokens)
                else:
                    got[mode] = _local_run(engine, prompts, args.max_tokens)
                steps[mode] = _per_step(before, counters[mode](), got[mode][1])
            row = {"repeat": repeat}
            for mode, (outputs, wall, accepted, drafted) in got.items():
                tokens = sum(len(o) for o in outputs)
                row[mode] = {"output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
                             "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0, **steps[mode]}
            row["ratio_http_over_local"] = round(row["http"]["tokens_per_s"] / row["local"]["tokens_per_s"], 4)
            row["identical_outputs"] = got["http"][0] == got["local"][0]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        stop(APP, owns_cluster=True)
    ratios = [r["ratio_http_over_local"] for r in rows]
    return {
        "workload": args.workload, "requests": len(conversations), "max_tokens": args.max_tokens,
        "speculation": {"policy": config.controller.policy, "methods": [p.method for p in config.proposers]},
        "torch_threads": torch.get_num_threads(), "rows": rows,
        "median_http_tokens_per_s": statistics.median(r["http"]["tokens_per_s"] for r in rows),
        "median_local_tokens_per_s": statistics.median(r["local"]["tokens_per_s"] for r in rows),
        "median_ratio_http_over_local": statistics.median(ratios),
        # Where the time went, per engine step (median over repeats).
        "median_ms_per_step": {mode: {part: statistics.median(r[mode][part] for r in rows)
                                      for part in ("propose_ms", "pass_ms", "rest_ms")}
                               for mode in ("http", "local") if all(r[mode]["steps"] for r in rows)},
        "all_identical": all(r["identical_outputs"] for r in rows),
    }


def _main(args: argparse.Namespace) -> int:
    summary = run(args)
    text = json.dumps(summary, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def add_parser(sub) -> None:
    from cluster.workloads import WORKLOADS

    p = sub.add_parser("serve-bench", help="tokens/s through the HTTP service vs the in-process engine (concurrency 1)")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: cluster/configs/local-cpu.yaml)")
    p.add_argument("--workload", choices=list(WORKLOADS), default="code_edit")
    p.add_argument("--requests", type=int, default=6, help="requests per repeat, sent one at a time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the summary to this file")
    p.set_defaults(func=_main)
