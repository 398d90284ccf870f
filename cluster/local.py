"""Build an in-process engine from plain arguments (CLI, benchmark, tests)."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from cluster.config import SplitspecConfig, VerifierConfig
from protos.proposal import ProposalSource
from proposers.registry import OFF, build_proposer  # noqa: F401 (OFF re-exported)
from verifier.engine import Engine, EngineConfig
from verifier.models.llama import LlamaModel
from verifier.models.loader import load_model_and_tokenizer, load_tokenizer  # noqa: F401 (re-exported)
from verifier.models.tensor_parallel import TensorParallelModel
from verifier.models.tokenizer import Tokenizer
from verifier.models.vocab import VocabFingerprint, incompatibility
from verifier.controller import Controller
from verifier.observer import EngineObserver


@dataclasses.dataclass(frozen=True)
class LocalEngineSpec:
    """What to serve and how. `model` None means the bundled SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    speculation: str = "ngram"
    #: Another method asked in the rounds `speculation` has no draft for (`Engine.fallbacks`).
    fallback: str | None = None
    k: int = 4
    max_num_seqs: int = 8
    max_model_len: int = 2048
    #: Token-tree widths for a draft model or EAGLE head (`DraftModelConfig.tree`), or
    #: nodes a depth of its dynamic trees (`DraftModelConfig.dynamic_tree`); None: chains.
    #: They shape the fallback's drafts when there is one, else `speculation`'s.
    tree: tuple[int, ...] | None = None
    dynamic_tree: int | None = None
    #: The most nodes a dynamic tree keeps (`DraftModelConfig.tree_budget`); None: all.
    tree_budget: int | None = None
    #: Ranks the target is split over (`verifier.models.tensor_parallel`); 1: not split.
    tensor_parallel_size: int = 1
    #: A Jinja chat template's text used instead of the model's own; None: the model's.
    chat_template: str | None = None


def check_vocabularies(tokenizer: Tokenizer, proposers: Mapping[str, ProposalSource]) -> None:
    """Raise `ValueError` naming the first mismatch when an in-process proposer drafts in a
    vocabulary the target's cannot verify (remote ones are checked by their router)."""
    target = None
    for method, source in proposers.items():
        vocab = getattr(source, "vocab", None)
        if vocab is None:
            continue
        target = target or VocabFingerprint.of(tokenizer)
        why = incompatibility(target, vocab)
        if why is not None:
            raise ValueError(f"proposer {method!r} cannot draft for this target: {why}")


def build_local_engine(spec: LocalEngineSpec) -> Engine:
    model, tokenizer = load_model_and_tokenizer(spec.model, spec.tokenizer, spec.dtype, spec.chat_template)
    model = split_model(model, spec.model, spec.dtype, spec.tensor_parallel_size)
    config = EngineConfig(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
    if spec.speculation == OFF or spec.k == 0:
        return Engine(model, tokenizer, config, None, Controller.off())
    shape = {k: v for k, v in (("tree", None if spec.tree is None else list(spec.tree)),
                               ("dynamic_tree", spec.dynamic_tree), ("tree_budget", spec.tree_budget)) if v is not None}
    methods = [spec.speculation] if spec.fallback is None else [spec.speculation, spec.fallback]
    proposers = {m: build_proposer(m, shape if m == methods[-1] else {}) for m in methods}
    check_vocabularies(tokenizer, proposers)
    return Engine(model, tokenizer, config, proposers, Controller.static(spec.k, (spec.speculation,)),
                  fallbacks=None if spec.fallback is None else {spec.speculation: spec.fallback})


def verifier_threads(verifier: VerifierConfig) -> int | None:
    """torch threads of a verifier replica: as configured, else every core of the machine on
    a CPU-only replica, else None (leave Ray's default); split over the ranks of a
    tensor-parallel replica on CPU (at least one each)."""
    threads = verifier.num_threads or (os.cpu_count() if verifier.resources.num_gpus == 0 else None)
    if threads and verifier.resources.num_gpus == 0:
        threads = max(threads // verifier.tensor_parallel_size, 1)
    return threads


def split_model(model: LlamaModel, path: str | None, dtype: str, tensor_parallel_size: int,
                threads: int | None = None) -> LlamaModel:
    """`model` itself when `tensor_parallel_size` is 1 (or it is split already), else rank 0
    of it split over that many ranks (`TensorParallelModel`; the workers load `path`
    themselves). Each rank runs `threads` torch threads; None: this process's share of its
    own, which this process then keeps too (its model thread included), so the ranks do
    not crowd its cores."""
    if tensor_parallel_size == 1 or isinstance(model, TensorParallelModel):
        return model
    if threads is None:
        import torch

        from verifier.models.threads import run_on_cpu_worker

        threads = max(torch.get_num_threads() // tensor_parallel_size, 1)
        torch.set_num_threads(threads)
        run_on_cpu_worker(torch.set_num_threads, threads)
    return TensorParallelModel.start(path, dtype, tensor_parallel_size, threads=threads, model=model)


def engine_from_config(config: SplitspecConfig, model: LlamaModel, tokenizer: Tokenizer,
                       proposers: Mapping[str, ProposalSource], observer: EngineObserver | None = None) -> Engine:
    """The engine a verifier replica runs for `config`, drafting with `proposers` (method ->
    source, in the config's order) under the configured controller policy, reporting to
    `observer` (metrics). Policy `goodput` profiles the step time here, before the first request."""
    v = config.verifier
    check_vocabularies(tokenizer, proposers)
    model = split_model(model, config.model.path, config.model.dtype, v.tensor_parallel_size, verifier_threads(v))
    engine = Engine(model, tokenizer, EngineConfig(
        max_num_seqs=v.max_num_seqs, max_model_len=v.max_model_len, max_waiting=v.max_waiting,
        max_num_batched_tokens=v.max_num_batched_tokens,
    ), dict(proposers), Controller(config.controller.settings(), tuple(proposers)), observer,
        {p.method: p.fallback for p in config.proposers if p.fallback is not None and p.method in proposers})
    if engine.controller.needs_step_time:
        engine.profile_step_time()
    return engine
