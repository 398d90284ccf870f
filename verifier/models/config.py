"""Architecture hyper-parameters of a Llama-family decoder (Llama 2/3, Qwen2, SmolLM/SmolLM2)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from verifier.errors import ModelLoadError

#: model_type values (HF config.json) / general.architecture values (GGUF) we can run.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind`: "default" | "linear" | "llama3" | "yarn"."""

    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    truncate: bool = True  # yarn: round the correction range to whole dims


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling = RopeScaling()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads=} is not a multiple of {self.num_kv_heads=}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` dict (model_type llama or qwen2)."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported model_type {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelLoadError(f"config.json lacks {missing}")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        unsupported = sorted({"mscale", "mscale_all_dim", "short_factor", "long_factor"} & rope.keys())
        if unsupported:
            raise ModelLoadError(f"unsupported RoPE parameters {unsupported} in {rope}")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        scaling = RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
        )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            rope_scaling=scaling,
        )


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2] with the config's scaling applied.

    `freq_factors` (GGUF `rope_freqs.weight`, float32 [head_dim // 2]) divides the
    frequencies, which is how llama.cpp stores Llama 3 scaling; it replaces "llama3".
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if freq_factors is not None:
        return inv_freq / freq_factors.float()
    if s.kind in ("default", "dynamic") or s.factor == 1.0:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between low_freq_wavelen and high_freq_wavelen is interpolated smoothly.
        orig = s.original_max_position or config.max_position
        low_freq_wavelen = orig / s.low_freq_factor
        high_freq_wavelen = orig / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (orig / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    if s.kind == "yarn":
        # YaRN (Peng et al. 2023): interpolate low frequencies by `factor`, keep high ones,
        # ramp linearly between the dims that complete beta_fast and beta_slow rotations.
        orig = s.original_max_position or config.max_position

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(config.rope_theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrapolation = 1 - ramp.clamp(0, 1)
        return (inv_freq / s.factor) * (1 - extrapolation) + inv_freq * extrapolation
    raise ModelLoadError(f"unsupported rope scaling {s.kind!r}")


def rope_attention_scaling(config: ModelConfig) -> float:
    """YaRN scales cos/sin by `attention_factor` or 0.1 ln(factor) + 1; others by 1."""
    s = config.rope_scaling
    if s.kind == "yarn" and s.attention_factor is not None:
        return float(s.attention_factor)
    if s.kind == "yarn" and s.factor > 1:
        return 0.1 * math.log(s.factor) + 1.0
    return 1.0
