"""Load a Llama-family target from a GGUF file (dequantised) or an HF safetensors directory.

Both paths end in the same HF-layout tensors, so one model implementation serves both.
GGUF files of the "llama" architecture store Q and K rows permuted for llama.cpp's
interleaved RoPE; they are permuted back to HF's `rotate_half` layout here.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Callable

import torch

from verifier.errors import ModelLoadError
from verifier.models.dequant import dequantize
from verifier.models.gguf_file import open_gguf
from verifier.models.config import ModelConfig, RopeScaling
from verifier.models.llama import LayerWeights, LlamaModel
from verifier.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: (the checkpoint's config, a whole layer) -> what of it to keep (`load_model`).
LayerShare = Callable[[ModelConfig, LayerWeights], LayerWeights]

_HF_LAYER = {
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
_GGUF_LAYER = {
    "input_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight",
    "post_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}
_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def load_model(path: str | pathlib.Path | None = None, dtype: str | torch.dtype = "float32",
               gguf_reader=None, layer_share: LayerShare | None = None) -> LlamaModel:
    """Load the bundled model (path None), a `.gguf` file, or an HF checkpoint directory.

    `gguf_reader`: an already open `GGUFFile` of that file, so a caller that also
    builds the tokenizer from it reads the file's header once.
    `layer_share(config, layer)`: what to keep of each layer, applied as it is read, so
    that no more than one whole layer is in memory at a time (a tensor-parallel rank's
    share, `verifier.models.tensor_parallel.load_share`); the model's config stays the
    checkpoint's.
    """
    from verifier.models.bundled import bundled_model_path

    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    p = pathlib.Path(path) if path is not None else bundled_model_path()
    if p.is_dir():
        return _load_hf_dir(p, torch_dtype, layer_share)
    if p.suffix == ".gguf" and p.is_file():
        return _load_gguf(p, torch_dtype, gguf_reader, layer_share)
    raise ModelLoadError(f"model path {str(p)!r} is neither a .gguf file nor a checkpoint directory")


def load_tokenizer(model: str | None, tokenizer: str | None = None, gguf_reader=None,
                   chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of `model`: from `tokenizer` (a directory) if given, else from the
    GGUF metadata (read through `gguf_reader` when given) or the checkpoint directory;
    with `chat_template` (a Jinja template's text) instead of the model's own."""
    if tokenizer is not None:
        tok = Tokenizer.from_dir(tokenizer)
    else:
        from verifier.models.bundled import bundled_model_path

        path = pathlib.Path(model) if model is not None else bundled_model_path()
        tok = Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf(
            gguf_reader if gguf_reader is not None else path)
    return tok if chat_template is None else tok.with_chat_template(chat_template)


def load_model_and_tokenizer(model: str | None, tokenizer: str | None, dtype: str,
                             chat_template: str | None = None) -> tuple[LlamaModel, Tokenizer]:
    """Both halves of a target, parsing a GGUF file once for the two."""
    from verifier.models.bundled import bundled_model_path

    path = pathlib.Path(model) if model is not None else bundled_model_path()
    reader = None
    if path.suffix == ".gguf" and path.is_file():
        reader = open_gguf(path)
    return load_model(model, dtype, gguf_reader=reader), load_tokenizer(model, tokenizer, reader, chat_template)


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs interleaved) → halves."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, reader=None, layer_share: LayerShare | None = None) -> LlamaModel:
    reader = reader if reader is not None else open_gguf(path)
    meta = reader.value

    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{path.name}: unsupported GGUF architecture {arch!r}")
    num_heads = int(meta(f"{arch}.attention.head_count"))
    hidden = int(meta(f"{arch}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    scaling_type = meta(f"{arch}.rope.scaling.type", "none")
    rope_scaling = RopeScaling()
    if scaling_type in ("linear", "yarn"):
        rope_scaling = RopeScaling(
            kind=scaling_type,
            factor=float(meta(f"{arch}.rope.scaling.factor", 1.0)),
            original_max_position=int(meta(f"{arch}.rope.scaling.original_context_length", 0)),
        )
    vocab_size = meta(f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = meta("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{path.name}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        num_layers=int(meta(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(meta(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(meta(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=rope_scaling,
    )

    def get(name: str) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            return None
        w = dequantize(t.data, t.tensor_type)  # float32, [rows, cols], writable
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if "attn_q" in name else config.num_kv_heads
            w = _unpermute_rope(w, heads)
        return w

    freq_factors = get("rope_freqs.weight")
    return _assemble(config, get, _GGUF_GLOBAL, _GGUF_LAYER, dtype, freq_factors, source=path.name,
                     layer_share=layer_share)


def _load_hf_dir(path: pathlib.Path, dtype: torch.dtype, layer_share: LayerShare | None = None) -> LlamaModel:
    from safetensors import safe_open

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    config = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    handles = {}
    for f in files:
        h = safe_open(str(f), framework="pt")
        for key in h.keys():
            handles[key] = h

    def get(name: str) -> torch.Tensor | None:
        h = handles.get(name)
        return None if h is None else h.get_tensor(name).float()

    return _assemble(config, get, _HF_GLOBAL, _HF_LAYER, dtype, None, source=str(path), layer_share=layer_share)


def _assemble(
    config: ModelConfig,
    get: Callable[[str], torch.Tensor | None],
    global_names: dict[str, str],
    layer_names: dict[str, str],
    dtype: torch.dtype,
    freq_factors: torch.Tensor | None,
    source: str,
    layer_share: LayerShare | None = None,
) -> LlamaModel:
    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"{source}: missing tensor {name!r}")
        return t.to(dtype)

    layers = []
    for i in range(config.num_layers):
        n = {key: tmpl.format(i=i) for key, tmpl in layer_names.items()}
        biases = [get(n[b]) for b in ("q_bias", "k_bias", "v_bias")]
        bqkv = torch.cat(biases).to(dtype) if all(b is not None for b in biases) else None
        layer = LayerWeights(
            input_norm=need(n["input_norm"]),
            wqkv=torch.cat([need(n["q"]), need(n["k"]), need(n["v"])]).contiguous(),
            bqkv=bqkv,
            wo=need(n["o"]),
            post_norm=need(n["post_norm"]),
            w_gate_up=torch.cat([need(n["gate"]), need(n["up"])]).contiguous(),
            w_down=need(n["down"]),
        )
        layers.append(layer if layer_share is None else layer_share(config, layer))
    embed = need(global_names["embed"])
    lm_head = get(global_names["lm_head"])
    lm_head = embed if (lm_head is None or config.tie_word_embeddings) else lm_head.to(dtype)
    logger.info("loaded %s: %d layers, hidden %d, vocab %d, %s", source, config.num_layers,
                config.hidden_size, config.vocab_size, dtype)
    return LlamaModel(config, embed, layers, need(global_names["norm"]), lm_head, dtype, freq_factors)
