"""Build an in-process engine from plain arguments (CLI, benchmark, tests)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Mapping

from cluster.config import SplitspecConfig, VerifierConfig
from protos.proposal import ProposalSource
from proposers.registry import build_proposer
from verifier.engine import Engine, EngineConfig
from verifier.models.bundled import bundled_model_path
from verifier.models.llama import LlamaModel
from verifier.models.loader import load_model
from verifier.models.tokenizer import Tokenizer
from verifier.controller import Controller

#: Speculation method that means "no proposer".
OFF = "off"


@dataclasses.dataclass(frozen=True)
class LocalEngineSpec:
    """What to serve and how. `model` None means the bundled SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    speculation: str = "ngram"
    k: int = 4
    max_num_seqs: int = 8
    max_model_len: int = 2048


def load_tokenizer(model: str | None, tokenizer: str | None = None, gguf_reader=None) -> Tokenizer:
    """The tokenizer of `model`: from `tokenizer` (a directory) if given, else from the
    GGUF metadata (read through `gguf_reader` when given) or the checkpoint directory."""
    if tokenizer is not None:
        return Tokenizer.from_dir(tokenizer)
    path = pathlib.Path(model) if model is not None else bundled_model_path()
    if path.is_dir():
        return Tokenizer.from_dir(path)
    return Tokenizer.from_gguf(gguf_reader if gguf_reader is not None else path)


def load_model_and_tokenizer(model: str | None, tokenizer: str | None, dtype: str) -> tuple[LlamaModel, Tokenizer]:
    """Both halves of a target, parsing a GGUF file once for the two."""
    path = pathlib.Path(model) if model is not None else bundled_model_path()
    reader = None
    if path.suffix == ".gguf" and path.is_file():
        import gguf

        reader = gguf.GGUFReader(str(path))
    return load_model(model, dtype, gguf_reader=reader), load_tokenizer(model, tokenizer, gguf_reader=reader)


def build_local_engine(spec: LocalEngineSpec) -> Engine:
    model, tokenizer = load_model_and_tokenizer(spec.model, spec.tokenizer, spec.dtype)
    config = EngineConfig(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
    if spec.speculation == OFF or spec.k == 0:
        return Engine(model, tokenizer, config, None, Controller.off())
    return Engine(model, tokenizer, config, build_proposer(spec.speculation), Controller.static(spec.k))


def verifier_threads(verifier: VerifierConfig) -> int | None:
    """torch threads of a verifier replica: as configured, else every core of the machine on
    a CPU-only replica, else None (leave Ray's default)."""
    return verifier.num_threads or (os.cpu_count() if verifier.resources.num_gpus == 0 else None)


def engine_from_config(config: SplitspecConfig, model: LlamaModel, tokenizer: Tokenizer,
                       proposers: Mapping[str, ProposalSource]) -> Engine:
    """The engine a verifier replica runs for `config`, drafting with `proposers` (method ->
    source, in the config's order) under the configured controller policy. Policy
    `goodput` profiles the step time here, before the first request."""
    v = config.verifier
    engine = Engine(model, tokenizer, EngineConfig(
        max_num_seqs=v.max_num_seqs, max_model_len=v.max_model_len, max_waiting=v.max_waiting,
    ), dict(proposers), Controller(config.controller.settings(), tuple(proposers)))
    if engine.controller.needs_step_time:
        engine.profile_step_time()
    return engine
