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
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
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
        low_freq_wavelen = s.original_max_position / s.low_freq_factor
        high_freq_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
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

        low = max(math.floor(correction_dim(s.beta_fast)), 0)
        high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrapolation = 1 - ramp.clamp(0, 1)
        return (inv_freq / s.factor) * (1 - extrapolation) + inv_freq * extrapolation
    raise ModelLoadError(f"unsupported rope scaling {s.kind!r}")


def rope_attention_scaling(config: ModelConfig) -> float:
    """YaRN scales cos/sin by 0.1 ln(factor) + 1; every other variant by 1."""
    s = config.rope_scaling
    if s.kind == "yarn" and s.factor > 1:
        return 0.1 * math.log(s.factor) + 1.0
    return 1.0
