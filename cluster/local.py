"""Build an in-process engine from plain arguments (CLI, benchmark, tests)."""

from __future__ import annotations

import dataclasses
import pathlib

from proposers.registry import build_proposer
from verifier.engine import Engine, EngineConfig
from verifier.models.bundled import bundled_model_path
from verifier.models.loader import load_model
from verifier.models.tokenizer import Tokenizer
from verifier.policy import OffPolicy, StaticPolicy

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


def load_tokenizer(model: str | None, tokenizer: str | None = None) -> Tokenizer:
    """The tokenizer of `model`: from `tokenizer` (a directory) if given, else from the
    GGUF metadata or the checkpoint directory itself."""
    if tokenizer is not None:
        return Tokenizer.from_dir(tokenizer)
    path = pathlib.Path(model) if model is not None else bundled_model_path()
    return Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def build_local_engine(spec: LocalEngineSpec) -> Engine:
    model = load_model(spec.model, spec.dtype)
    tokenizer = load_tokenizer(spec.model, spec.tokenizer)
    config = EngineConfig(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
    if spec.speculation == OFF or spec.k == 0:
        return Engine(model, tokenizer, config, None, OffPolicy())
    return Engine(model, tokenizer, config, build_proposer(spec.speculation), StaticPolicy(spec.k))
