"""`splitspec bench`: the serving benchmark over the OpenAI HTTP API.

For each workload and concurrency it sends N greedy streaming chat requests, at most
`concurrency` in flight, once per speculation mode; the modes of one (workload,
concurrency) run back to back, in a balanced order each repeat, and a row's figures are
medians over repeats. It talks to any server of the API (`--url`) or starts the service
from a config on a fresh local Ray cluster (`--config`) and stops it afterwards.

Per request, from chunk arrival times (as vLLM's `benchmark_serving`):
- TTFT: from sending the request to the first chunk that carries content text;
- ITL: the gaps between successive content-carrying chunks (a speculative round can put
  several tokens in one chunk, so one gap may cover several tokens);
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), for requests with > 1 token;
- output tokens: `usage.completion_tokens`; speculation counters: the top-level
  `speculation` object of the usage chunk (absent on other servers: counted as 0).
Per run: output tokens/s = output tokens / wall time of the run; acceptance rate =
accepted / drafted; mean acceptance length = 1 + accepted / rounds with drafts.
The table and the plot are drawn by `cluster/bench_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import re
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from verifier.errors import SplitspecError

HOST = "127.0.0.1"
APP_NAME = "splitspec-bench"
DEFAULT_MODES = "off,static:2,static:4,static:8,auto"
#: Enough for a prefill and a few speculative rounds: connections, proposer state, caches.
WARMUP_MAX_TOKENS = 16
#: At least this many requests per run when --requests is not given (default 2 x concurrency).
MIN_REQUESTS = 4
SPECULATION_FIELDS = ("drafted", "accepted", "rounds", "rounds_with_drafts")
#: Per-request counters by name, summed over a run's requests: drafting rounds per method,
#: rounds without drafts per reason (README "The controller").
SPECULATION_TALLIES = ("rounds_by_method", "rounds_off")
#: Seconds a request may wait for its next chunk: at concurrency 32 on a 2-core CPU one
#: request can queue for minutes behind the others.
READ_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
#: Seconds `--config` waits for /health: the verifier replica loads the model (as `splitspec serve`).
HEALTHY_TIMEOUT_S = 300.0
#: Characters of an error body or bad chunk quoted in a record's `error`.
ERROR_CHARS = 200
#: Row fields that count things: medians over repeats keep them integers (`median_low`).
COUNT_FIELDS = ("requests", "output_tokens", *SPECULATION_FIELDS)


class BenchError(SplitspecError):
    """The benchmark cannot run (server unreachable, no model, warm-up failed)."""


# ---------------------------------------------------------------------- modes
@dataclasses.dataclass(frozen=True)
class Mode:
    """A benchmark mode: its canonical name and the request's `speculation` object."""

    name: str
    speculation: dict[str, Any]


_MODE_RE = re.compile(r"(?P<kind>off|auto(?::(?P<cap>\d+))?|static:(?P<k>\d+))(?:@(?P<method>[A-Za-z0-9_.-]+))?")


def parse_mode(text: str) -> Mode:
    """`off` | `static:K` (a fixed k every round) | `auto` (the server's controller) |
    `auto:K` (the controller, at most K drafts a round); all but `off` take an optional
    `@METHOD` (a configured proposer method).

    >>> parse_mode("static:4@ngram").speculation
    {'mode': 'on', 'max_k': 4, 'method': 'ngram'}
    >>> parse_mode("auto:8").speculation
    {'mode': 'auto', 'max_k': 8}
    """
    m = _MODE_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"mode must be off, static:K, auto or auto:K, all but off optionally @METHOD; got {text!r}")
    if m["kind"] == "off":
        if m["method"]:
            raise ValueError(f"mode off takes no @METHOD; got {text!r}")
        return Mode("off", {"mode": "off"})
    if m["kind"].startswith("auto"):
        name, spec = "auto", {"mode": "auto"}
        if m["cap"] is not None:
            cap = int(m["cap"])
            if cap < 1:
                raise ValueError(f"auto:K needs K >= 1 (off is mode off); got {text!r}")
            name, spec = f"auto:{cap}", {"mode": "auto", "max_k": cap}
    else:
        k = int(m["k"])
        if k < 1:
            raise ValueError(f"static:K needs K >= 1 (off is mode off); got {text!r}")
        name, spec = f"static:{k}", {"mode": "on", "max_k": k}
    if m["method"]:
        name, spec = f"{name}@{m['method']}", {**spec, "method": m["method"]}
    return Mode(name, spec)


def parse_modes(text: str) -> list[Mode]:
    """Comma-separated modes, e.g. `off,static:4,auto`; empty or repeated ones raise ValueError."""
    modes = [parse_mode(t) for t in text.split(",") if t.strip()]
    names = [m.name for m in modes]
    if not modes:
        raise ValueError(f"no modes given; got {text!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"modes repeat; got {text!r}")
    return modes


def balanced_order(items: Sequence, repeat: int) -> list:
    """The order of `items` in repeat `repeat`: the rows of a Williams square, so that each
    item goes first once, and follows every other item equally often, every len(items)
    repeats (2 x len(items) when that is odd; the second half reverses the first).

    A plain rotation keeps the cyclic order, so each mode always ran right after the same
    other mode; with state that outlives a run (the controller's estimates, the
    proposers' caches, the machine's load after a heavy mode) that biased one mode
    against another the same way in every repeat.

    >>> [balanced_order("abcd", r) for r in range(4)]
    [['a', 'b', 'd', 'c'], ['b', 'c', 'a', 'd'], ['c', 'd', 'b', 'a'], ['d', 'a', 'c', 'b']]
    >>> [balanced_order("abc", r) for r in range(6)][2:4]
    [['c', 'a', 'b'], ['c', 'b', 'a']]
    """
    n = len(items)
    r = repeat % (2 * n if n % 2 else n)
    # First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n); odd n: then the rows reversed.
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    row = [items[(a + r) % n] for a in first]
    return row[::-1] if r >= n else row


# ---------------------------------------------------------------------- one request
@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request: its timeline (`time.perf_counter` seconds) and counters; `error` when it failed."""

    start_s: float
    content_s: tuple[float, ...] = ()  # arrival of each chunk that carried content text
    end_s: float = 0.0  # arrival of `data: [DONE]`
    output_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    rounds_with_drafts: int = 0
    rounds_by_method: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rounds_off: Mapping[str, int] = dataclasses.field(default_factory=dict)
    error: str | None = None


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line (one optional space stripped); None for any other line.

    >>> sse_data('data: {"a": 1}'), sse_data("data:[DONE]"), sse_data(": keep-alive")
    ('{"a": 1}', '[DONE]', None)
    """
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):]
    return data[1:] if data.startswith(" ") else data


def _has_content(chunk: dict) -> bool:
    # chat chunks carry `delta.content`, completion chunks `text`; the opening chat chunk
    # (role only, content "") and the usage chunk (no choices) carry none.
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in chunk.get("choices") or ())


def record_from_stream(start_s: float, lines: Iterable[tuple[float, str]]) -> RequestRecord:
    """Parse a streamed chat completion given as (arrival time, line) pairs into a record."""
    content_s: list[float] = []
    usage = speculation = None
    for t, line in lines:
        data = sse_data(line)
        if data is None:
            continue
        if data.strip() == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            return RequestRecord(start_s, error=f"not a JSON object: {data[:ERROR_CHARS]!r}")
        if "error" in chunk:
            return RequestRecord(start_s, error=f"error in stream: {json.dumps(chunk['error'])[:ERROR_CHARS]}")
        if _has_content(chunk):
            content_s.append(t)
        if chunk.get("usage"):
            usage, speculation = chunk["usage"], chunk.get("speculation") or {}
    else:
        return RequestRecord(start_s, error="stream ended before data: [DONE]")
    if usage is None:
        return RequestRecord(start_s, error="no usage chunk (stream_options.include_usage ignored?)")
    try:
        counts = {f: int(speculation.get(f) or 0) for f in SPECULATION_FIELDS}
        counts.update({f: {str(k): int(v) for k, v in (speculation.get(f) or {}).items()} for f in SPECULATION_TALLIES})
        return RequestRecord(start_s, tuple(content_s), t, int(usage["completion_tokens"]), **counts)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return RequestRecord(start_s, error=f"malformed usage or speculation: {exc!r}")


def request_timings(r: RequestRecord) -> tuple[float | None, float | None, list[float], float]:
    """(TTFT, TPOT, ITLs, end-to-end latency) of a successful request, in seconds.

    TTFT is None without content chunks; TPOT is None unless TTFT is known and the request
    produced more than one token. E.g. sent at 0, content at 0.5, 0.7, 1.2, done at 1.2,
    5 tokens: TTFT 0.5, ITLs [0.2, 0.5], TPOT (1.2 - 0.5) / 4 = 0.175.
    """
    e2e = r.end_s - r.start_s
    if not r.content_s:
        return None, None, [], e2e
    ttft = r.content_s[0] - r.start_s
    itls = [b - a for a, b in zip(r.content_s, r.content_s[1:])]
    tpot = (e2e - ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None
    return ttft, tpot, itls, e2e


# ---------------------------------------------------------------------- aggregation
def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks as numpy's default; 0.0 if empty.

    >>> percentile([40, 10, 30, 20], 50)  # rank 0.5 * 3 = 1.5: halfway from 20 to 30
    25.0
    """
    xs = sorted(values)
    if not xs:
        return 0.0
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarise_run(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float | int]:
    """The figures of one run (one mode, one repeat); failed requests only count as errors."""
    ok = [r for r in records if r.error is None]
    timings = [request_timings(r) for r in ok]
    ttfts = [t[0] * 1e3 for t in timings if t[0] is not None]
    tpots = [t[1] * 1e3 for t in timings if t[1] is not None]
    itls = [g * 1e3 for t in timings for g in t[2]]
    e2es = [t[3] * 1e3 for t in timings]
    sums = {f: sum(getattr(r, f) for r in ok) for f in ("output_tokens", *SPECULATION_FIELDS)}
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": sums["output_tokens"],
        "duration_s": duration_s,
        "output_tokens_per_s": per_s(sums["output_tokens"]),
        "request_throughput": per_s(len(ok)),
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
        "tpot_ms_p50": percentile(tpots, 50), "tpot_ms_p99": percentile(tpots, 99),
        "itl_ms_p50": percentile(itls, 50), "itl_ms_p99": percentile(itls, 99),
        "e2e_ms_p50": percentile(e2es, 50), "e2e_ms_p99": percentile(e2es, 99),
        "acceptance_rate": sums["accepted"] / sums["drafted"] if sums["drafted"] else 0.0,
        "mean_acceptance_length": 1 + sums["accepted"] / sums["rounds_with_drafts"] if sums["rounds_with_drafts"] else 1.0,
        **{f: sums[f] for f in SPECULATION_FIELDS},
        **{f: _tally(getattr(r, f) for r in ok) for f in SPECULATION_TALLIES},
    }


def _tally(counters: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counters summed by key, keys sorted.

    >>> _tally([{"ngram": 3}, {"eagle": 1, "ngram": 2}])
    {'eagle': 1, 'ngram': 5}
    """
    out: collections.Counter[str] = collections.Counter()
    for counter in counters:
        out.update(counter)
    return dict(sorted(out.items()))


def combine_repeats(runs: Sequence[dict[str, float | int]]) -> dict[str, float | int | list[float]]:
    """One row from the per-repeat summaries of `summarise_run`: each figure is the median over
    repeats (counts the lower median, so they stay counts a repeat produced), `errors`, and
    `rounds_by_method` and `rounds_off` key by key, the totals over repeats;
    `output_tokens_per_s_by_repeat` keeps each repeat's throughput, in run order, to show the spread."""
    row: dict[str, float | int | list[float]] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        if key == "errors":
            row[key] = sum(values)
        elif key in SPECULATION_TALLIES:  # summed: per-key medians would not add up to one run's rounds
            row[key] = _tally(values)
        elif key in COUNT_FIELDS:
            row[key] = statistics.median_low(values)
        else:
            row[key] = round(statistics.median(values), 4)
    row["repeats"] = len(runs)
    row["output_tokens_per_s_by_repeat"] = [round(r["output_tokens_per_s"], 4) for r in runs]
    return row


# ---------------------------------------------------------------------- HTTP
def api_base(url: str) -> str:
    """The API root `.../v1` of a server URL given with or without `/v1`.

    >>> api_base("http://127.0.0.1:8000/"), api_base("http://h:1/v1")
    ('http://127.0.0.1:8000/v1', 'http://h:1/v1')
    """
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def send_request(client, base: str, model: str, messages: list[dict], max_tokens: int,
                       speculation: dict[str, Any]) -> RequestRecord:
    """One greedy streaming chat completion; any failure comes back as a record with `error`."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculation": speculation}
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestRecord(start, error=f"HTTP {resp.status_code}: {text[:ERROR_CHARS]}")
            async for line in resp.aiter_lines():
                lines.append((time.perf_counter(), line))
                if (sse_data(line) or "").strip() == "[DONE]":
                    break
    except (httpx.HTTPError, httpx.StreamError) as exc:
        return RequestRecord(start, error=f"{type(exc).__name__}: {exc}")
    return record_from_stream(start, lines)


async def run_requests(client, base: str, model: str, conversations: Sequence[list[dict]], num_requests: int,
                       concurrency: int, max_tokens: int, mode: Mode) -> tuple[list[RequestRecord], float]:
    """Send `num_requests` requests (cycling through `conversations`), at most `concurrency`
    in flight; return their records and the run's wall time in seconds."""
    indices = iter(range(num_requests))  # shared by the workers: one event loop, no races
    records: list[RequestRecord | None] = [None] * num_requests

    async def worker() -> None:
        for i in indices:
            records[i] = await send_request(client, base, model, conversations[i % len(conversations)],
                                            max_tokens, mode.speculation)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    return records, time.perf_counter() - start


def served_model(base: str) -> str:
    """The first model id of GET /v1/models."""
    import httpx

    try:
        r = httpx.get(f"{base}/models", timeout=CONNECT_TIMEOUT_S)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise BenchError(f"cannot read the model from {base}/models: {exc!r}") from None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to run: every workload x concurrency x repeat x mode."""

    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    modes: tuple[Mode, ...]
    requests: int | None  # per run; None: requests_per_client x concurrency, at least MIN_REQUESTS
    max_tokens: int
    repeats: int
    requests_per_client: int = 2

    def num_requests(self, concurrency: int) -> int:
        if self.requests is not None:
            return self.requests
        return max(self.requests_per_client * concurrency, MIN_REQUESTS)


async def run_bench(base: str, model: str, plan: Plan) -> list[dict]:
    """Every run of `plan` against the server at `base`; one row per (workload, concurrency, mode)."""
    import httpx

    from cluster.workloads import load_conversations

    total = len(plan.workloads) * len(plan.concurrency) * plan.repeats * len(plan.modes)
    done = 0
    rows = []
    limits = httpx.Limits(max_connections=max(plan.concurrency), max_keepalive_connections=max(plan.concurrency))
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for workload in plan.workloads:
            conversations = load_conversations(workload)
            warm = await send_request(client, base, model, conversations[0], WARMUP_MAX_TOKENS, plan.modes[0].speculation)
            if warm.error is not None:
                raise BenchError(f"warm-up request ({workload}, {plan.modes[0].name}) failed: {warm.error}")
            for concurrency in plan.concurrency:
                runs: dict[str, list[dict]] = {m.name: [] for m in plan.modes}
                for repeat in range(plan.repeats):
                    for mode in balanced_order(plan.modes, repeat):
                        records, duration = await run_requests(client, base, model, conversations,
                                                               plan.num_requests(concurrency), concurrency,
                                                               plan.max_tokens, mode)
                        summary = summarise_run(records, duration)
                        runs[mode.name].append(summary)
                        done += 1
                        _progress(done, total, workload, concurrency, mode.name, repeat, plan.repeats, summary,
                                  [r.error for r in records if r.error is not None])
                rows += [{"workload": workload, "mode": m.name, "concurrency": concurrency,
                          **combine_repeats(runs[m.name]), "max_tokens": plan.max_tokens} for m in plan.modes]
    return rows


def _progress(done: int, total: int, workload: str, concurrency: int, mode: str, repeat: int, repeats: int,
              s: dict, errors: list[str]) -> None:
    line = (f"[{done}/{total}] {workload} c={concurrency} {mode}"
            f"{f' (repeat {repeat + 1}/{repeats})' if repeats > 1 else ''}: {s['output_tokens_per_s']:.1f} tok/s, "
            f"tpot p50 {s['tpot_ms_p50']:.0f} ms, MAL {s['mean_acceptance_length']:.2f}")
    if errors:
        line += f", {len(errors)} errors (first: {errors[0]})"
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the service
class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it unwinds as Ctrl-C does."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` (a KeyboardInterrupt); the handler
    before it is restored on the way out. So `kill PID` stops what the block started."""

    def terminate(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def local_service(config_path) -> Iterator[str]:
    """Start the service from `config_path` on a fresh local Ray cluster, yield its URL, and stop
    the application, Serve and the Ray processes it started on the way out (Ctrl-C and SIGTERM
    included)."""
    from cluster.config import load_config
    from cluster.service import deploy, init_ray, start_serve, stop, wait_healthy

    config = load_config(config_path)
    print("starting a local Ray cluster and the service ...", file=sys.stderr, flush=True)
    init_ray(None)
    # After ray.init, which installs a SIGTERM handler of its own.
    with sigterm_interrupts():
        try:
            http_port, _ = start_serve(HOST, 0, 0)
            deploy(config, APP_NAME)
            url = f"http://{HOST}:{http_port}"
            wait_healthy(f"{url}/health", timeout_s=HEALTHY_TIMEOUT_S)
            yield url
        finally:
            print("stopping the service ...", file=sys.stderr, flush=True)
            stop(APP_NAME, owns_cluster=True)


# ---------------------------------------------------------------------- command line
def _main(args: argparse.Namespace) -> int:
    from cluster.bench_report import format_table, plot_rows
    from cluster.config import LOCAL_CONFIG_PATH
    from cluster.workloads import WORKLOADS

    plan = Plan(tuple(args.workload or WORKLOADS), tuple(args.concurrency), tuple(args.modes), args.requests,
                args.max_tokens, args.repeats, args.requests_per_client)
    service = contextlib.nullcontext(args.url) if args.url else local_service(args.config or LOCAL_CONFIG_PATH)
    try:
        with service as url:
            base = api_base(url)
            model = args.model or served_model(base)
            print(f"benchmarking {model} at {base}", file=sys.stderr, flush=True)
            rows = asyncio.run(run_bench(base, model, plan))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the service, if ours, is stopped by now
        print("interrupted: nothing written", file=sys.stderr)
        # 128 + the signal, as shells report it
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    if args.plot:
        plot_rows(rows, args.plot)
    print(format_table(rows))
    return 0


def _arg_type(parse):
    """An argparse `type` that turns `parse`'s ValueError into argparse's usage error (exit 2)."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"need integers >= 1, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def add_parser(sub) -> None:
    from cluster.workloads import WORKLOADS

    p = sub.add_parser("bench", help="serving benchmark over the OpenAI HTTP API: tok/s, TTFT, TPOT, ITL per mode")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", default=None, help="a running server's base URL, with or without /v1")
    target.add_argument("--config", default=None,
                        help="start the service from this YAML on a fresh local Ray cluster "
                             "(default without --url: cluster/configs/local-cpu.yaml)")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help=f"repeatable (default: all, {', '.join(WORKLOADS)})")
    p.add_argument("--concurrency", type=_arg_type(_positive_ints), default=[1, 8, 32], metavar="LIST",
                   help="comma-separated requests in flight (default 1,8,32)")
    p.add_argument("--modes", type=_arg_type(parse_modes), default=parse_modes(DEFAULT_MODES), metavar="LIST",
                   help=f"comma-separated off | static:K | auto | auto:K, all but off optionally @METHOD "
                        f"(default {DEFAULT_MODES})")
    p.add_argument("--requests", type=_arg_type(_positive_int), default=None,
                   help=f"requests per run (default --requests-per-client x concurrency, at least {MIN_REQUESTS})")
    p.add_argument("--requests-per-client", type=_arg_type(_positive_int), default=2,
                   help="without --requests: each run sends this many requests per concurrent client (default 2)")
    p.add_argument("--max-tokens", type=_arg_type(_positive_int), default=128,
                   help="output tokens per request (greedy; fewer if it ends with EOS; default 128)")
    p.add_argument("--repeats", type=_arg_type(_positive_int), default=1,
                   help="repeat every set of modes, each repeat in another order (each mode first once, and after each "
                        "other equally often, every N or 2N repeats of N modes); rows are medians over repeats")
    p.add_argument("--model", default=None, help="the served model name (default: the first of GET /v1/models)")
    p.add_argument("--json", default=None, help="write the rows (a JSON list) to this file")
    p.add_argument("--plot", default=None, help="write a PNG of tok/s and TPOT vs concurrency to this file")
    p.set_defaults(func=_main)
