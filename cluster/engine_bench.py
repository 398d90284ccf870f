"""`splitspec engine-bench`: the in-process engine, plain decoding vs speculation, side by side.

One process, one model. For each repeat, workload and batch size it runs the same greedy
requests in each mode (default: speculation off and n-gram at k = 4; `--modes` adds e.g.
`draft:4`, `eagle:4` or `auto`, the goodput controller over them), alternating the order,
and — at batch 1 — through HF transformers' `generate` on the same weights and dtype.
Each mode's requests run as one block, or with `--interleave` each group of `batch`
requests in every mode before the next group, so that the machine's drift over a block
(here often 20% within a minute) falls on every mode alike.
Figures are output tokens per second of wall time; the summary quotes medians over
repeats of per-repeat ratios, because this machine is shared and noisy.

A batch of B runs B requests at a time, each group waiting for its slowest, so every mode
runs about as many passes as the longest request has tokens: speculation only shrinks the
batch once faster requests finish. `--continuous` runs B clients instead, each sending its
next request as soon as its last one finishes (continuous batching, the shape of
`splitspec bench --concurrency B` against a server), where the passes saved are saved.

Greedy speculation is exact, so both modes emit the same tokens; the benchmark checks
that too and reports any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import operator
import pathlib
import re
import statistics
import sys
import time

import torch

from cluster.workloads import WORKLOADS, load_prompts
from verifier.errors import InvalidRequestError
from verifier.engine import Engine, EngineConfig
from verifier.controller import Controller
from verifier.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Row:
    repeat: int
    workload: str
    batch: int
    mode: str  # "off" | "ngram:k" | "hf"
    num_requests: int
    output_tokens: int
    wall_s: float
    mean_acceptance_length: float
    acceptance_rate: float
    #: Verifier passes the engine ran (0 for "hf").
    passes: int = 0
    #: Of wall_s: seconds in the verifier's passes, and in choosing k and waiting for the
    #: proposers before them (`EngineStats.pass_s`, `propose_s`); the rest is the loop's.
    pass_s: float = 0.0
    propose_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def _run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int,
                continuous: bool = False):
    """Serve `prompts` `batch` at a time, or (`continuous`) to `batch` clients that each
    send the next prompt as soon as their last one finishes; returns (results in prompt
    order, wall seconds)."""
    start = time.perf_counter()
    if continuous:
        results = asyncio.run(_clients(engine, prompts, params, batch))
    else:
        results = []
        for i in range(0, len(prompts), batch):
            results += engine.generate_sync(prompts[i : i + batch], params)
    return results, time.perf_counter() - start


async def _clients(engine: Engine, prompts: list[list[int]], params: SamplingParams, clients: int) -> list:
    """`clients` concurrent clients sharing the list of prompts, as `splitspec bench
    --concurrency` drives a server: the engine's batch refills as each request finishes."""
    todo = iter(range(len(prompts)))  # shared by the clients: one event loop, no races
    results: list = [None] * len(prompts)

    async def client() -> None:
        for i in todo:
            (results[i],) = await engine.generate_all([prompts[i]], params)

    await asyncio.gather(*(client() for _ in range(min(clients, len(prompts)))))
    return results


def _summarise(results) -> tuple[int, float, float]:
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(r.stats.rounds_with_drafts for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    mal = 1 + accepted / rounds if rounds else 1.0
    return tokens, mal, (accepted / drafted if drafted else 0.0)


def _load_hf(dtype: torch.dtype):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from verifier.models.bundled import bundled_model_path

    path = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def _run_hf(hf, prompts: list[list[int]], max_tokens: int, eos_ids) -> tuple[list[list[int]], float]:
    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])
            outputs.append(out[0, len(p):].tolist())
    return outputs, time.perf_counter() - start


_MODES_HELP = ("off, auto, METHOD:K, METHOD:K:W-W-..., METHOD:K:dB or METHOD:K:dB/N (METHOD: a method, "
               "or A>B: A, then B where A has no draft), or auto:A>B")


@dataclasses.dataclass(frozen=True)
class _Mode:
    """One `--modes` entry, parsed (`_parse_mode`)."""

    kind: str  #: "off", "auto" or "static"
    method: str | None = None  #: the static method, or the one auto falls back from (auto:A>B)
    fallback: str | None = None  #: asked in the rounds `method` has no draft for (A>B, auto:A>B)
    k: int = 0
    shape: str | None = None  #: "W-W-..." or "dB[/N]": the fallback's trees if there is one, else the method's

    @property
    def methods(self) -> list[str]:
        """The methods this mode names (auto's others come from the other modes)."""
        return [m for m in (self.method, self.fallback) if m is not None]


def _parse_mode(text: str) -> _Mode:
    """`--modes` entry -> `_Mode`, or `InvalidRequestError` on "modes".

    >>> _parse_mode("ngram>eagle:4:d4")
    _Mode(kind='static', method='ngram', fallback='eagle', k=4, shape='d4')
    >>> _parse_mode("auto:ngram>eagle").methods
    ['ngram', 'eagle']
    """
    if text in ("off", "auto"):
        return _Mode(text)
    if found := re.fullmatch(r"auto:(\w+)>(\w+)", text):
        mode = _Mode("auto", found[1], found[2])
    elif found := re.fullmatch(r"(\w+)(?:>(\w+))?:(\d+)(?::([1-9]\d*(?:-[1-9]\d*)*|d[1-9]\d*(?:/[1-9]\d*)?))?",
                               text):
        mode = _Mode("static", found[1], found[2], int(found[3]), found[4])
    else:
        mode = None
    if mode is None or (mode.kind == "static" and mode.method == "auto" and mode.fallback is None):
        raise InvalidRequestError("modes", f"{text!r} is not {_MODES_HELP}")
    if "auto" in mode.methods or mode.fallback == mode.method:
        raise InvalidRequestError("modes", f"{text!r}: A>B names two different methods, neither of them auto")
    return mode


def _engines(args: argparse.Namespace, model, tokenizer) -> dict[str, Engine]:
    """One engine per mode: "off", "METHOD:K" (that proposer, static k), "METHOD:K:W-W-..."
    (a draft model or EAGLE head drafting token trees of those widths, `DraftModelConfig.tree`,
    depth K), "METHOD:K:dB" (dynamic trees of B nodes a depth, `DraftModelConfig.dynamic_tree`; "dB/N":
    reranked to N nodes, `tree_budget`)
    or "auto" (the goodput controller choosing among every method named in the modes,
    else n-gram). METHOD may be "A>B": A, and B in the rounds A has no draft for
    (`Engine.fallbacks`), the shape B's; "auto:A>B" is auto with that fallback."""
    from proposers.registry import build_proposer
    from verifier.controller import ControllerSettings

    config = EngineConfig(max_num_seqs=max(args.batch), max_model_len=args.max_model_len)
    modes = {text: _parse_mode(text) for text in args.modes}
    methods = sorted({m for mode in modes.values() for m in mode.methods}) or ["ngram"]

    def options(method: str) -> dict:
        if method == "eagle" and args.eagle_head:
            return {"path": args.eagle_head}
        if method != "draft" or not args.draft_model:
            return {}
        return {"path": args.draft_model, **({"vocab_subset": args.draft_vocab_subset} if args.draft_vocab_subset else {})}

    proposers = {m: build_proposer(m, options(m)) for m in methods}
    engines = {}
    for text, mode in modes.items():
        fallbacks = {mode.method: mode.fallback} if mode.fallback else None
        if mode.kind == "off":
            engines[text] = Engine(model, tokenizer, config, None, Controller.off())
        elif mode.kind == "auto":
            engines[text] = Engine(model, tokenizer, config, proposers,
                                   Controller(ControllerSettings(policy="goodput", max_k=8), tuple(proposers)),
                                   fallbacks=fallbacks)
            # Before the clock starts, as a verifier replica does when it starts (about 9 s).
            engines[text].profile_step_time()
        else:
            # A shape applies to the method that drafts it: the fallback's when there is one.
            shaped = mode.fallback or mode.method
            shape = {} if mode.shape is None else _dynamic(mode.shape) if mode.shape.startswith("d") else {
                "tree": [int(w) for w in mode.shape.split("-")]}
            sources = {m: build_proposer(m, {**options(m), **shape}) if shape and m == shaped else proposers[m]
                       for m in mode.methods}
            engines[text] = Engine(model, tokenizer, config, sources, Controller.static(mode.k, (mode.method,)),
                                   fallbacks=fallbacks)
    return engines


def _dynamic(text: str) -> dict:
    """`dB` -> dynamic trees of B nodes a depth; `dB/N` -> the same, reranked to N nodes
    (`DraftModelConfig.tree_budget`)."""
    nodes, _, budget = text[1:].partition("/")
    return {"dynamic_tree": int(nodes), **({"tree_budget": int(budget)} if budget else {})}


def run(args: argparse.Namespace) -> dict:
    from cluster.local import load_model_and_tokenizer
    from verifier.models.loader import DTYPES

    model, tokenizer = load_model_and_tokenizer(args.model, None, args.dtype)
    engines = _engines(args, model, tokenizer)
    hf = _load_hf(DTYPES[args.dtype]) if args.hf and args.model is None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = {w: load_prompts(w, tokenizer)[: args.requests] for w in args.workload}
    rows: list[Row] = []
    mismatches = 0
    counters = operator.attrgetter("num_steps", "pass_s", "propose_s")
    for repeat in range(args.repeats):
        for w in args.workload:
            for batch in args.batch:
                order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
                before = {mode: counters(engines[mode].stats) for mode in order}
                results = {mode: [] for mode in order}
                walls = dict.fromkeys(order, 0.0)
                # Interleaved: each group of `batch` requests in every mode before the next
                # group (the order alternating), so the machine's drift falls on every mode.
                groups = ([prompts[w][i : i + batch] for i in range(0, len(prompts[w]), batch)]
                          if args.interleave else [prompts[w]])  # `_defaults` refuses it with --continuous
                for g, group in enumerate(groups):
                    for mode in order if g % 2 == 0 else order[::-1]:
                        res, wall = _run_engine(engines[mode], group, params, batch, args.continuous)
                        results[mode] += res
                        walls[mode] += wall
                outputs = {}
                for mode in order:
                    passes, pass_s, propose_s = (a - b for a, b in zip(counters(engines[mode].stats), before[mode]))
                    tokens, mal, rate = _summarise(results[mode])
                    outputs[mode] = [r.token_ids for r in results[mode]]
                    rows.append(Row(repeat, w, batch, mode, len(results[mode]), tokens, walls[mode], mal, rate,
                                    passes, round(pass_s, 3), round(propose_s, 3)))
                    _progress(rows[-1])
                base = outputs.get("off", next(iter(outputs.values())))
                mismatches += sum(a != b for out in outputs.values() for a, b in zip(out, base))
                if hf is not None and batch == 1:
                    hf_out, wall = _run_hf(hf, prompts[w], args.max_tokens, tokenizer.eos_token_ids)
                    rows.append(Row(repeat, w, 1, "hf", len(hf_out), sum(map(len, hf_out)), wall, 1.0, 0.0))
                    _progress(rows[-1])
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": [
        {**dataclasses.asdict(r), "tokens_per_s": round(r.tokens_per_s, 2)} for r in rows
    ], "summary": _ratios(rows), "greedy_mismatches": mismatches}
    return report


def _progress(row: Row) -> None:
    print(f"  repeat {row.repeat} {row.workload:<10} batch {row.batch} {row.mode:<8} "
          f"{row.output_tokens:5d} tokens {row.passes:5d} passes {row.wall_s:7.2f}s {row.tokens_per_s:7.2f} tok/s "
          f"mean acceptance length {row.mean_acceptance_length:.2f}"
          + (f" (passes {row.pass_s:.2f}s, proposing {row.propose_s:.2f}s)" if row.passes else ""),
          file=sys.stderr, flush=True)


def _ratios(rows: list[Row]) -> list[dict]:
    """Per workload, batch and speculating mode: medians over repeats of tokens/s, of the
    per-repeat ratio to "off", and of the mean acceptance length."""
    by_key: dict[tuple, dict[str, list[Row]]] = {}
    for r in rows:
        by_key.setdefault((r.workload, r.batch), {}).setdefault(r.mode, []).append(r)
    summary = []
    for (workload, batch), modes in by_key.items():
        off = modes.get("off")
        for mode, spec in modes.items():
            if mode in ("off", "hf"):
                continue
            entry = {
                "workload": workload,
                "batch": batch,
                "mode": mode,
                "spec_tokens_per_s_median": round(statistics.median(r.tokens_per_s for r in spec), 2),
                "mean_acceptance_length": round(statistics.median(r.mean_acceptance_length for r in spec), 3),
            }
            if off:
                entry["off_tokens_per_s_median"] = round(statistics.median(r.tokens_per_s for r in off), 2)
                entry["speedup_median"] = round(
                    statistics.median(s.tokens_per_s / o.tokens_per_s for s, o in zip(spec, off)), 3)
                if "hf" in modes:
                    entry["off_vs_hf_median"] = round(
                        statistics.median(o.tokens_per_s / h.tokens_per_s for o, h in zip(off, modes["hf"])), 3)
            summary.append(entry)
    return summary


def _main(args: argparse.Namespace) -> int:
    report = run(args)
    print(f"{'workload':<10} {'batch':>5} {'mode':<9} {'off tok/s':>10} {'spec tok/s':>11} {'speedup':>8} "
          f"{'mean acc len':>13} {'off/HF':>7}")
    for s in report["summary"]:
        print(f"{s['workload']:<10} {s['batch']:>5} {s['mode']:<9} {s.get('off_tokens_per_s_median', '-'):>10} "
              f"{s['spec_tokens_per_s_median']:>11} {s.get('speedup_median', '-'):>8} "
              f"{s['mean_acceptance_length']:>13} {s.get('off_vs_hf_median', '-'):>7}")
    print(f"greedy mismatches against off: {report['greedy_mismatches']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_parser(sub) -> None:
    p = sub.add_parser("engine-bench", help="time plain decoding vs n-gram speculation (and HF generate) in-process")
    p.add_argument("--model", default=None, help="model path (default: bundled; HF comparison only for the bundled model)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of `draft:K` modes: a GGUF file, an HF directory or a `splitspec train "
                        "draft` output (default: the draft trained for the bundled model), e.g. the "
                        "Qwen2.5-Coder-0.5B of `splitspec models fetch qwen-coder` with --model its 1.5B")
    p.add_argument("--draft-vocab-subset", type=int, default=None, metavar="N",
                   help="cut --draft-model's LM head to its N most frequent tokens (the draft option "
                        "`vocab_subset`), e.g. 65536 for the Qwen2.5-Coder-0.5B")
    p.add_argument("--eagle-head", default=None, metavar="DIR",
                   help="the EAGLE head of `eagle:K` modes: a `splitspec train eagle` output or a published "
                        "EAGLE-1 or EAGLE-3 head for --model (default: the head trained for the bundled model)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help="repeatable (default: code_edit and chat)")
    p.add_argument("--batch", type=_int_list, default=[1, 8], help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--continuous", action="store_true",
                   help="run each batch size B as B clients that each send their next request as soon as the "
                        "last one finishes (continuous batching, as `splitspec bench --concurrency B` drives a "
                        "server), instead of B requests at a time, each group waiting for its slowest")
    p.add_argument("--interleave", action="store_true",
                   help="run each group of BATCH requests in every mode before the next group (not with "
                        "--continuous), instead of each mode's requests in one block: drift falls on every mode")
    p.add_argument("--k", type=int, default=4, help="k of the default modes (off,ngram:K)")
    p.add_argument("--modes", default=None,
                   help="comma-separated: off, METHOD:K (e.g. draft:4, eagle:4), METHOD:K:W-W-... (a draft "
                        "model or EAGLE head drafting token trees of those widths, e.g. draft:3:4-1-1), METHOD:K:dB "
                        "(dynamic trees of B nodes a depth, e.g. eagle:3:d4), METHOD:K:dB/N (the same reranked to "
                        "N nodes, e.g. eagle:5:d4/15), A>B:K... (A, and B in the rounds A has no draft for, e.g. "
                        "ngram>eagle:4), auto:A>B (auto with that fallback) or auto "
                        "(the goodput controller over the methods named); default off,ngram:K")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=8, help="prompts per workload")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers comparison")
    p.add_argument("--json", default=None, help="write rows and summary to this file")
    p.set_defaults(func=lambda a: _main(_defaults(a)))


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    args.workload = args.workload or ["code_edit", "chat"]
    args.modes = [m for m in (args.modes or f"off,ngram:{args.k}").split(",") if m]
    for mode in args.modes:
        _parse_mode(mode)
    if args.draft_vocab_subset is not None:
        from proposers.draft_model import is_trained_draft

        if args.draft_vocab_subset < 1:
            raise InvalidRequestError("draft_vocab_subset", f"must be >= 1, got {args.draft_vocab_subset}")
        if args.draft_model is None or is_trained_draft(args.draft_model):
            raise InvalidRequestError("draft_vocab_subset", "cuts a plain --draft-model's LM head (a GGUF file or "
                                                            "an HF directory); a trained draft's covers a subset already")
    if args.eagle_head is not None and not (pathlib.Path(args.eagle_head) / "config.json").is_file():
        raise InvalidRequestError("eagle_head", f"{args.eagle_head} holds no config.json (an EAGLE head directory "
                                                f"holds config.json and *.safetensors)")
    if args.interleave and args.continuous:
        raise InvalidRequestError("interleave", "runs fixed groups of BATCH requests; --continuous has none")
    return args
