"""The `splitspec` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import sys
import time

from verifier.errors import InvalidRequestError, SplitspecError

logger = logging.getLogger(__name__)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from proposers.registry import OFF, PROPOSERS

    p.add_argument("--model", default=None, help="a .gguf file or HF checkpoint directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: from the model)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default) is exact; bfloat16 is faster on CPUs with AVX512-BF16")
    p.add_argument("--speculation", choices=(OFF, *sorted(PROPOSERS)), default="ngram")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (0 = no speculation)")
    p.add_argument("--fallback", choices=sorted(PROPOSERS), default=None,
                   help="another method asked in the rounds --speculation has no draft for (e.g. --speculation "
                        "ngram --fallback eagle); with --tree or --dynamic-tree, the one that drafts the trees")
    p.add_argument("--tree", default=None, metavar="W,W,...",
                   help="draft or eagle: draft token trees, W children per node at each depth "
                        "(e.g. 3,2,1; depth --k); default chains")
    p.add_argument("--dynamic-tree", type=int, default=None, metavar="B",
                   help="draft or eagle: dynamic token trees, the B most likely paths at each "
                        "depth (e.g. 4; depth --k); default chains")
    p.add_argument("--tree-budget", type=int, default=None, metavar="N",
                   help="with --dynamic-tree: keep the N nodes of the most likely paths (EAGLE-2's rerank, e.g. "
                        "15); default every node")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length per sequence")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the target over N processes (this one and N - 1 workers; default 1)")


def _fallback_arg(args: argparse.Namespace) -> str | None:
    """`--fallback`, checked against `--speculation`; InvalidRequestError naming it otherwise."""
    from proposers.registry import OFF

    if args.fallback is not None and (args.speculation == OFF or args.k == 0):
        raise InvalidRequestError("fallback", "is asked where the --speculation method has no draft; "
                                              "speculation is off")
    if args.fallback is not None and args.fallback == args.speculation:
        raise InvalidRequestError("fallback", f"must be another method than --speculation ({args.speculation!r})")
    return args.fallback


def _tree_arg(args: argparse.Namespace) -> tuple[int, ...] | None:
    """`--tree W,W,...` as widths, after checking `--dynamic-tree`; InvalidRequestError
    naming the parameter otherwise. The trees are the fallback's when there is one."""
    from proposers.registry import DRAFTS_TREES

    drafter, which = (args.fallback, "fallback") if args.fallback else (args.speculation, "speculation")
    for name, value in (("tree", args.tree), ("dynamic_tree", args.dynamic_tree)):
        if value is not None and drafter not in DRAFTS_TREES:
            raise InvalidRequestError(name, f"token trees are drafted by the model proposers, draft and eagle, only "
                                            f"({which} is {drafter!r})")
    if args.dynamic_tree is not None and args.dynamic_tree < 1:
        raise InvalidRequestError("dynamic_tree", f"must be >= 1, got {args.dynamic_tree}")
    if args.tree_budget is not None:
        if args.dynamic_tree is None:
            raise InvalidRequestError("tree_budget", "reranks a dynamic tree's nodes: give --dynamic-tree too")
        if args.tree_budget < 1:
            raise InvalidRequestError("tree_budget", f"must be >= 1, got {args.tree_budget}")
    if args.tree is None:
        return None
    if args.dynamic_tree is not None:
        raise InvalidRequestError("tree", "--tree and --dynamic-tree exclude each other")
    parts = args.tree.split(",")
    if not all(w.strip().isdigit() and int(w) > 0 for w in parts):
        raise InvalidRequestError("tree", f"must be comma-separated widths >= 1, e.g. 3,2,1; got {args.tree!r}")
    return tuple(int(w) for w in parts)


def _logit_bias_arg(items: list[str]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for item in items:
        token, sep, bias = item.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise InvalidRequestError("logit_bias", f"must be ID=BIAS, e.g. 198=-100; got {item!r}") from None
    return tuple(pairs)


def _structured_output_arg(args: argparse.Namespace):
    """--json-schema / --json-object / --regex / --choice / --grammar (at most one)."""
    from verifier.structured_output import StructuredOutput

    def text(value: str, param: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            return pathlib.Path(value[1:]).read_text()
        except OSError as exc:
            raise InvalidRequestError(param, f"cannot read {value[1:]}: {exc.strerror}") from None

    whitespace = {"disable_any_whitespace": args.disable_any_whitespace, "whitespace_pattern": args.whitespace_pattern}
    if args.json_schema is not None:
        return StructuredOutput(json=text(args.json_schema, "json_schema"), param="json_schema", **whitespace)
    if args.json_object:
        return StructuredOutput(json_object=True, param="json_object", **whitespace)
    for name, value in whitespace.items():
        if value not in (False, None):
            raise InvalidRequestError(name, "applies to --json-schema and --json-object only")
    if args.regex is not None:
        return StructuredOutput(regex=args.regex, param="regex")
    if args.choice:
        return StructuredOutput(choice=tuple(args.choice), param="choice")
    if args.grammar is not None:
        return StructuredOutput(grammar=text(args.grammar, "grammar"), param="grammar")
    return None


def _chat_template_arg(args: argparse.Namespace) -> str | None:
    """--chat-template's text (a template, or a file holding one), with --chat only."""
    if args.chat_template is None:
        return None
    if not args.chat:
        raise InvalidRequestError("chat_template", "applies to --chat only")
    from verifier.errors import ModelLoadError
    from verifier.models.tokenizer import read_chat_template

    try:
        return read_chat_template(args.chat_template)
    except ModelLoadError as exc:
        raise InvalidRequestError("chat_template", str(exc)) from None


def _generate(args: argparse.Namespace) -> int:
    from verifier.sampling_params import SamplingParams, check_truncate_prompt_tokens, truncate_prompt

    if args.prompt_file is not None:
        prompt_text = pathlib.Path(args.prompt_file).read_text()
    else:
        prompt_text = args.prompt
    if not prompt_text:
        raise InvalidRequestError("prompt", "must not be empty")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        stop_token_ids=tuple(args.stop_token_id),
        include_stop_str_in_output=args.include_stop_str,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=_logit_bias_arg(args.logit_bias),
        min_tokens=args.min_tokens,
        bad_words=tuple(args.bad_word),
        allowed_token_ids=tuple(args.allowed_token_id) if args.allowed_token_id else None,
        skip_special_tokens=not args.keep_special_tokens,
        structured_output=_structured_output_arg(args),
    ).validate()
    check_truncate_prompt_tokens(args.truncate_prompt_tokens)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None and not args.json:
            raise InvalidRequestError(name, "are printed with --json only")
    if args.k < 0:
        raise InvalidRequestError("k", f"must be >= 0, got {args.k}")
    chat_template = _chat_template_arg(args)
    if args.tensor_parallel_size < 1:
        raise InvalidRequestError("tensor_parallel_size", f"must be >= 1, got {args.tensor_parallel_size}")
    fallback = _fallback_arg(args)
    tree = _tree_arg(args)
    # torch and the engine only once the arguments are known good: a bad one exits at once.
    from cluster.local import LocalEngineSpec, build_local_engine
    from verifier.server import logprob_entries

    engine = build_local_engine(LocalEngineSpec(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, speculation=args.speculation,
        fallback=fallback, k=args.k, max_num_seqs=1, max_model_len=args.max_model_len, tree=tree,
        dynamic_tree=args.dynamic_tree, tree_budget=args.tree_budget, tensor_parallel_size=args.tensor_parallel_size,
        chat_template=chat_template,
    ))
    tok = engine.tokenizer
    from verifier.server import prompt_token_ids

    chat = [{"role": "user", "content": prompt_text}] if args.chat else None
    prompt_ids = truncate_prompt(prompt_token_ids(tok, None if args.chat else prompt_text, chat),
                                 args.truncate_prompt_tokens, engine.config.max_model_len)

    logprobs: list = []
    prompt_logprobs: list = []

    async def run() -> tuple[list[int], str, object, str]:
        token_ids: list[int] = []
        pieces: list[str] = []
        async for out in engine.generate(prompt_ids, params):
            token_ids.extend(out.token_ids)
            pieces.append(out.text)
            logprobs.extend(out.logprobs or ())
            prompt_logprobs.extend(out.prompt_logprobs or ())
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                return token_ids, "".join(pieces), out.stats, out.finish_reason.value
        raise AssertionError("stream ended without a final event")

    start = time.perf_counter()
    token_ids, text, stats, finish_reason = asyncio.run(run())
    wall = time.perf_counter() - start
    summary = stats.as_dict()
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": token_ids,
            "prompt_token_ids": prompt_ids,
            "finish_reason": finish_reason,
            "speculation": args.speculation if args.k > 0 else "off",
            "fallback": fallback,
            "k": args.k,
            "tree": None if tree is None else list(tree),
            "dynamic_tree": args.dynamic_tree,
            "tree_budget": args.tree_budget,
            "dtype": args.dtype,
            "tensor_parallel_size": args.tensor_parallel_size,
            "stats": summary,
            **({} if args.logprobs is None else {"logprobs": logprob_entries(tok, logprobs, token_ids)}),
            **({} if args.prompt_logprobs is None else {
                "prompt_logprobs": logprob_entries(tok, prompt_logprobs, prompt_ids)}),
        }))
    else:
        print()
        print(
            f"[{len(token_ids)} tokens in {wall:.2f}s, {summary['tokens_per_second']:.1f} tok/s, "
            f"rounds {summary['rounds']}, drafted {summary['drafted']}, accepted {summary['accepted']}, "
            f"mean acceptance length {summary['mean_acceptance_length']:.2f}, finish {finish_reason}]"
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from cluster.config import LOCAL_CONFIG_PATH, load_config
    from cluster.service import deploy, init_ray, start_serve, stop, wait_healthy
    from cluster.tracing import tracing_env

    config = load_config(args.config or LOCAL_CONFIG_PATH)
    api = config.api
    http_port = api.http_port if args.http_port is None else args.http_port
    grpc_port = api.grpc_port if args.grpc_port is None else args.grpc_port
    for name, port in (("--http-port", http_port), ("--grpc-port", grpc_port)):
        if not 0 <= port <= 65535:
            raise InvalidRequestError(name, f"must be in [0, 65535], got {port}")
    stopping = threading.Event()

    def on_signal(signum, frame):  # Ctrl-C or SIGTERM: stop cleanly, once
        stopping.set()

    app_name = args.app_name
    print(f"starting {'Ray at ' + args.address if args.address else 'a local Ray cluster'} ...", flush=True)
    metrics_port = init_ray(args.address, metrics_port=api.metrics_port, env=tracing_env(config.tracing))
    # After ray.init, which installs its own SIGTERM handler.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        http_port, grpc_port = start_serve(api.host, http_port, grpc_port, config.tracing)
        print("deploying (loads the model in the verifier replica) ...", flush=True)
        deploy(config, app_name)
        http = f"http://{api.host}:{http_port}"
        wait_healthy(f"{http}/health", timeout_s=300)
        lines = [
            "splitspec is ready",
            f"  OpenAI API  {http}/v1   (e.g. POST {http}/v1/chat/completions)",
            f"  health      {http}/health",
            f"  gRPC        {api.host}:{grpc_port}   (splitspec.v1.Generate/Generate)",
        ]
        if metrics_port:
            lines.append(f"  metrics     http://127.0.0.1:{metrics_port}/metrics   (Prometheus, ray_splitspec_*)")
        if config.tracing.exporter != "none":
            lines.append(f"  tracing     {config.tracing.exporter} {config.tracing.endpoint or ''}".rstrip())
        print("\n".join(lines + ["Ctrl-C stops it."]), flush=True)
        while not stopping.wait(0.5):
            pass
        print("stopping ...", flush=True)
    finally:
        stop(app_name, owns_cluster=not args.address)
    print("stopped", flush=True)
    return 0


def _train(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from proposers.train import (BUNDLED_DRAFT_DIR, BUNDLED_EAGLE_DIR, TrainDraftConfig, fill_answer_cache,
                                 train_draft, write_self_prompts)
    from proposers.train_eagle import TrainEagleConfig, train_eagle
    from verifier.models.loader import load_model_and_tokenizer

    if args.what == "prompts":
        for name in ("num", "batch", "max_tokens"):
            if getattr(args, name) < 1:
                raise InvalidRequestError(name.replace("_", "-"), f"must be >= 1, got {getattr(args, name)}")
        if not args.temperature > 0:
            raise InvalidRequestError("temperature", f"must be > 0 (prompts are sampled), got {args.temperature}")
        if not 0.0 < args.top_p <= 1.0:
            raise InvalidRequestError("top-p", f"must be in (0, 1], got {args.top_p}")
        if args.threads:
            torch.set_num_threads(args.threads)
        target, tokenizer = load_model_and_tokenizer(None, None, "float32")
        print(json.dumps(write_self_prompts(target, tokenizer, args.num, args.seed, args.batch, args.max_tokens,
                                            args.temperature, args.top_p)))
        return 0
    config_cls, recipe, default_out = {
        "draft": (TrainDraftConfig, train_draft, BUNDLED_DRAFT_DIR),
        "eagle": (TrainEagleConfig, train_eagle, BUNDLED_EAGLE_DIR),
        "answers": (TrainDraftConfig, None, None),
    }[args.what]
    overrides = {}
    for f in dataclasses.fields(config_cls):
        value = getattr(args, f.name, None)
        if value is not None:
            overrides[f.name] = tuple(value) if f.name == "init_layers" else value
    try:
        cfg = config_cls(**overrides)
    except ValueError as exc:
        raise InvalidRequestError(f"train {args.what}", str(exc)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "answers":
        target, tokenizer = load_model_and_tokenizer(None, None, "float32")
        print(json.dumps(fill_answer_cache(target, tokenizer, cfg, "bundled")))
        return 0
    target, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, "float32")
    if args.what == "eagle" and cfg.arch == "eagle3":
        from proposers.train import BUNDLED_EAGLE3_DIR

        default_out = BUNDLED_EAGLE3_DIR
    out = pathlib.Path(args.out) if args.out else default_out
    bad = [i for i in cfg.init_layers if not 0 <= i < target.config.num_layers]
    if bad:
        raise InvalidRequestError("init-layers", f"{bad} not in [0, {target.config.num_layers})")
    command = f"splitspec train {args.what} " + " ".join(shlex.quote(a) for a in args.argv_tail)
    info = recipe(target, tokenizer, out, cfg, base=args.model or "bundled", command=command.strip(),
                  resume=args.resume)
    print(json.dumps({"out": str(out), **{k: v for k, v in info.items() if k.startswith("held_out_")},
                      "total_s": info["total_s"]}))
    return 0


def _add_train_parser(sub) -> None:
    from proposers.train import TrainDraftConfig
    from proposers.train_eagle import TrainEagleConfig

    t = sub.add_parser("train", help="train a proposer for the target on this machine")
    tsub = t.add_subparsers(dest="what", required=True)
    answer_fields = {"num_prompts", "num_docstring_prompts", "num_function_prompts", "max_answer_tokens",
                     "generate_batch", "seed", "self_prompts"}
    for what, config_cls, helptext in (
        ("draft", TrainDraftConfig, "distil a small draft model from the target (proposers/train.py)"),
        ("eagle", TrainEagleConfig, "distil an EAGLE head from the target (proposers/train_eagle.py)"),
        ("answers", TrainDraftConfig, "generate the bundled target's answers to the recipe's prompts into the "
                                      "repo's answer cache, without training"),
    ):
        d = tsub.add_parser(what, help=helptext)
        if what != "answers":  # the answer cache is the bundled target's
            d.add_argument("--model", default=None, help="the target: a .gguf file or HF directory (default: bundled)")
            d.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: from the model)")
            d.add_argument("--out", default=None,
                           help=f"output directory (default: the bundled {what}'s, under proposers/assets/)")
            d.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt and OUT/corpus.pt")
        d.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
        defaults = config_cls()
        for f in dataclasses.fields(config_cls):
            if what == "answers" and f.name not in answer_fields:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            if f.name == "init_layers":
                d.add_argument(flag, type=int, nargs="+", default=None, help=f"default {' '.join(map(str, default))}")
            elif isinstance(default, bool):
                d.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"default {'on' if default else 'off'}")
            else:
                d.add_argument(flag, type=str if default is None else type(default), default=None,
                               help=f"default {default}")
        d.set_defaults(func=_train)
    p = tsub.add_parser("prompts", help="have the bundled target write chat prompts itself (Magpie) into "
                                        "proposers/data/self_prompts.jsonl, for --self-prompts")
    p.add_argument("--num", type=int, default=2600, help="prompts to sample (default 2600; about 3 in 4 are kept)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed SEED + i (default 0)")
    p.add_argument("--batch", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="a longer sample is dropped (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(func=_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description="Disaggregated speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text locally with the in-process engine")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="with --chat: a Jinja chat template, or the path of a file holding one, used instead of "
                        "the model's own (vLLM's --chat-template)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="token id that ends the output like EOS, and is kept in it (repeatable)")
    g.add_argument("--include-stop-str", action="store_true",
                   help="the text ends right after the stop string instead of before it")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end of sequence, to --max-tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's and HF's, > 0 (default 1: off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit (repeatable)")
    g.add_argument("--min-tokens", type=int, default=0, help="no end of sequence before this many tokens")
    g.add_argument("--bad-word", action="append", default=[], metavar="WORD",
                   help="never write WORD (its tokens, alone or after a space; repeatable)")
    g.add_argument("--allowed-token-id", action="append", type=int, default=[], metavar="ID",
                   help="the output holds only these token ids (repeatable)")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="keep control tokens in the text (the end of sequence that ends it excepted)")
    g.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="keep only the prompt's last N tokens (-1: as many as --max-model-len holds)")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON matching SCHEMA (JSON text, or @FILE)")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", help="the whole output matches this regular expression")
    so.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    so.add_argument("--grammar", metavar="LARK", help="the output matches this Lark grammar (text, or @FILE)")
    ws = g.add_mutually_exclusive_group()
    ws.add_argument("--disable-any-whitespace", action="store_true",
                    help="with --json-schema or --json-object: no whitespace between JSON's tokens")
    ws.add_argument("--whitespace-pattern", metavar="REGEX", default=None,
                    help="with --json-schema or --json-object: whitespace between JSON's tokens matches REGEX")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each output token's log probability and the N most likely tokens' (0-20)")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="with --json: each prompt token's log probability and the N most likely tokens' (0-20)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_engine_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="run the service on a local Ray cluster (or join one with --address)")
    s.add_argument("config", nargs="?", default=None,
                   help="YAML config (default: cluster/configs/local-cpu.yaml)")
    s.add_argument("--address", default=None, help="join this Ray cluster (e.g. auto or ray://host:10001) instead of starting one")
    s.add_argument("--http-port", type=int, default=None, help="OpenAI HTTP port (default: api.http_port; 0 = any free port)")
    s.add_argument("--grpc-port", type=int, default=None, help="gRPC Generate port (default: api.grpc_port; 0 = any free port)")
    s.add_argument("--app-name", default="splitspec", help="Serve application name")
    s.set_defaults(func=_serve)

    from cluster.engine_bench import add_parser as add_bench_parser

    add_bench_parser(sub)

    from cluster.serve_bench import add_parser as add_serve_bench_parser

    add_serve_bench_parser(sub)

    from cluster.bench import add_parser as add_serving_bench_parser

    add_serving_bench_parser(sub)
    _add_train_parser(sub)

    from cluster.models_fetch import add_parser as add_models_parser

    add_models_parser(sub)

    from cluster.k8s import add_parser as add_k8s_parser

    add_k8s_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv_tail = argv[2:] if argv[:1] == ["train"] else argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SplitspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
