"""EAGLE proposer: a one-layer head that drafts at feature level from the target's hidden states.

EAGLE (Li et al. 2024) predicts the target's next *feature* (its final hidden state, the LM
head's input) rather than the next token: at position t the head reads the target's
feature f_t and the embedding of the next token x_{t+1},

    g_t = fc([embed(x_{t+1}); f_t])  ->  Llama decoder layer(s) (the first without input norm)
        -> f^_{t+1},  logits of x_{t+2} = lm_head(f^_{t+1}),

and drafts autoregressively by feeding its own f^ back. The verifier sends the features of
committed positions in the proposer stream (`ProposalRequest.hidden_states`: the n
positions before the last context token, bfloat16), so a round feeds the head only the new
positions and then drafts k tokens, all sequences batched into each pass:

    pass 0:       (x_{t+1}, f_t) for each new position t up to new_len - 2  -> draft 1
    pass j >= 1:  (draft j, f^ of the previous pass)                        -> draft j + 1

The head's KV cache keeps the positions computed from real features; positions computed
from its own f^ are rolled back next round, when the real features have arrived.

Weights: the published EAGLE-1 layout (`fc.weight` [hidden, 2 hidden], optional `fc.bias`,
`layers.0.*` HF Llama decoder-layer names, optional `model.` prefix, an `embed_tokens` or
`lm_head` that may be left out because the target's are used), in `*.safetensors` next to
an HF `config.json`; `splitspec train eagle` writes the same layout plus `splitspec.vocab_ids`
(the frequency-ranked subset of LM-head rows the head drafts over, mapped back exactly).

EAGLE-3 heads (Li et al. 2025) are loaded too, from their published layout: the feature is
`fc` [hidden, 3 hidden] of the target's residual stream entering three of its layers
(`eagle_config.eagle_aux_hidden_state_layer_ids` in `config.json`, by default 2, L // 2 and
L - 3 of the target's L layers, as EAGLE-3 and vLLM take them), and one decoder layer
(`midlayer.*`, or `layers.0.*`) whose attention reads [input_layernorm(embed(x_{t+1}));
hidden_norm(g_t)] (q/k/v take 2 hidden) on the residual stream g_t. Its output before
`norm` is the feature fed back for the next draft; `lm_head` [draft vocab, hidden] with
`d2t` (draft id d is target id d + d2t[d]). The verifier then sends those three layers'
states instead of the final ones (`Info.hidden_state_layers`); the head combines them with
`fc` as they arrive, so it keeps one hidden-size feature per position either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np
import torch

from protos.proposal import ProposalRequest
from proposers.draft_model import DraftModelConfig, DraftModelProposer, _Seq, hf_layers
from verifier.errors import ModelLoadError
from verifier.models.config import ModelConfig
from verifier.models.llama import LlamaModel, linear, pack_weight
from verifier.models.threads import run_on_cpu_worker
from verifier.models.vocab import VocabFingerprint


@dataclasses.dataclass
class EagleHead:
    """The head's weights as one `LlamaModel` (target embeddings, its decoder layer(s), no
    final norm unless the checkpoint has one, LM-head rows) plus the fusion `fc`."""

    model: LlamaModel
    #: EAGLE-1: [hidden, 2 * hidden], input [embed(x); feature]. EAGLE-3: [hidden, 3 * hidden],
    #: the target's states at `aux_layers` combined into the feature.
    fc_weight: torch.Tensor
    fc_bias: torch.Tensor | None
    token_map: np.ndarray | None  # LM-head column -> target id; None when column c is id c
    #: EAGLE-3: the target layers whose input states the head reads; None: EAGLE-1 (final states).
    aux_layers: tuple[int, ...] | None = None

    @property
    def eagle3(self) -> bool:
        return self.aux_layers is not None

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The features of context positions from what the verifier sent: EAGLE-1 uses the
        target's final states as they are, EAGLE-3 `fc` of its states at `aux_layers`."""
        x = target_states.to(self.model.dtype)
        return linear(x, self.fc_weight, self.fc_bias) if self.eagle3 else x

    def fuse(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """A pass's input rows (the residual stream): EAGLE-1 fuses the token embeddings
        with the features; an EAGLE-3 layer reads the embeddings itself."""
        if self.eagle3:
            return features.to(self.model.dtype)
        x = torch.cat([self.model.embed[token_ids], features.to(self.model.dtype)], dim=-1)
        return linear(x, self.fc_weight, self.fc_bias)


def load_eagle(path: str | pathlib.Path, target: LlamaModel, target_vocab: VocabFingerprint,
               dtype: torch.dtype = torch.float32) -> EagleHead:
    """An EAGLE head for `target` from a directory: `config.json` + `*.safetensors`.

    A head written by `splitspec train eagle` is checked against its recorded weights
    sha256 and vocabulary fingerprint; any head must match the target's hidden and
    vocabulary sizes. Raises `ModelLoadError` naming what is wrong.
    """
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (an EAGLE head directory holds config.json and *.safetensors)")
    meta = json.loads(cfg_path.read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    ours = meta.get("splitspec")
    if ours is not None:
        if ours.get("kind") != "eagle":
            raise ModelLoadError(f"{path}: splitspec.kind is {ours.get('kind')!r}, not 'eagle'")
        digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
        if len(files) != 1 or digest != ours.get("weights_sha256"):
            raise ModelLoadError(f"{files[0]}: sha256 {digest} does not match config.json's weights_sha256 "
                                 f"{ours.get('weights_sha256')}; the file is corrupt or was replaced")
        fp = ours.get("tokenizer_fingerprint", {})
        if fp.get("token_texts_sha256") != target_vocab.token_texts_sha256:
            raise ModelLoadError(f"{path}: trained for another vocabulary (texts sha256 "
                                 f"{str(fp.get('token_texts_sha256'))[:12]}...) than the target's "
                                 f"({target_vocab.token_texts_sha256[:12]}...)")
    meta.setdefault("model_type", "llama")
    config = ModelConfig.from_hf(meta)
    tc = target.config
    if (config.hidden_size, config.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ModelLoadError(f"{path}: hidden size {config.hidden_size} and vocabulary {config.vocab_size} do not "
                             f"match the target's {tc.hidden_size} and {tc.vocab_size}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})

    def need(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {name!r}")
        return tensors[name].to(dtype)

    H = config.hidden_size
    eagle3 = any(k in tensors for k in ("midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"))
    if eagle3:
        return _load_eagle3(path, meta, config, tensors, target, dtype)
    fc_weight = need("fc.weight")
    if tuple(fc_weight.shape) != (H, 2 * H):
        raise ModelLoadError(f"{path}: fc.weight has shape {list(fc_weight.shape)}, want [{H}, {2 * H}]")
    fc_bias = tensors["fc.bias"].to(dtype) if "fc.bias" in tensors else None
    # EAGLE-1 drops layer 0's input norm (the fused input is not a residual stream).
    layers = hf_layers(tensors, "layers.", config.num_layers, dtype, str(path), first_input_norm=False)
    token_map = None
    head = tensors["lm_head.weight"].to(dtype) if "lm_head.weight" in tensors else target.lm_head.to(dtype)
    if "splitspec.vocab_ids" in tensors:
        token_map = tensors["splitspec.vocab_ids"].numpy().astype(np.int64)
        if token_map.min() < 0 or token_map.max() >= tc.vocab_size:
            raise ModelLoadError(f"{path}: splitspec.vocab_ids outside [0, {tc.vocab_size})")
        head = head[torch.from_numpy(token_map)].contiguous()
    norm = tensors["norm.weight"].to(dtype) if "norm.weight" in tensors else None
    model = LlamaModel(config, target.embed.to(dtype), layers, norm, head, dtype)
    return EagleHead(model, fc_weight, fc_bias, token_map)


def head_hidden_state_layers(path: str | pathlib.Path, target_layers: int) -> tuple[int, ...] | None:
    """Which target states the head in `path` reads, without loading it: None (the final
    states) for an EAGLE-1 head, its aux layers for an EAGLE-3 one (a verifier sets up its
    passes from this before the proposer's replicas answer `Info`)."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    keys: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            keys.update(k.removeprefix("model.") for k in handle.keys())
    if not keys & {"midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"}:
        return None
    return eagle3_aux_layers(json.loads((path / "config.json").read_text()), target_layers)


def eagle3_aux_layers(meta: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (their input states), from its config.json:
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else EAGLE-3's (2, L // 2, L - 3)."""
    ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)


def _load_eagle3(path: pathlib.Path, meta: dict, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 target: LlamaModel, dtype: torch.dtype) -> EagleHead:
    tc = target.config
    H = config.hidden_size
    tensors = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    if config.num_layers != 1:
        raise ModelLoadError(f"{path}: an EAGLE-3 head has one decoder layer, config.json says {config.num_layers}")
    aux = eagle3_aux_layers(meta, tc.num_layers)
    if not aux or any(not 0 <= i <= tc.num_layers for i in aux):
        raise ModelLoadError(f"{path}: eagle_aux_hidden_state_layer_ids {list(aux)} must lie in "
                             f"[0, {tc.num_layers}] (the target's layers)")
    for name in ("fc.weight", "norm.weight"):
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {name!r}")
    fc_weight = tensors["fc.weight"].to(dtype)
    if tuple(fc_weight.shape) != (H, len(aux) * H):
        raise ModelLoadError(f"{path}: fc.weight has shape {list(fc_weight.shape)}, want [{H}, {len(aux) * H}] "
                             f"(the target's states at layers {list(aux)})")
    fc_bias = tensors["fc.bias"].to(dtype) if "fc.bias" in tensors else None
    (layer,) = hf_layers(tensors, "layers.", 1, dtype, str(path))
    layer.hidden_norm = tensors["layers.0.hidden_norm.weight"].to(dtype)
    qkv_in = layer.wqkv.shape[1]
    if qkv_in != 2 * H:
        raise ModelLoadError(f"{path}: q/k/v projections read {qkv_in} inputs, an EAGLE-3 layer reads {2 * H}")
    head = tensors["lm_head.weight"].to(dtype) if "lm_head.weight" in tensors else target.lm_head.to(dtype)
    token_map = None
    if "d2t" in tensors:
        d2t = tensors["d2t"].numpy().astype(np.int64)
        if d2t.shape != (head.shape[0],):
            raise ModelLoadError(f"{path}: d2t has shape {list(d2t.shape)}, want [{head.shape[0]}] (lm_head's rows)")
        token_map = np.arange(head.shape[0], dtype=np.int64) + d2t
        if token_map.min() < 0 or token_map.max() >= tc.vocab_size:
            raise ModelLoadError(f"{path}: d2t maps draft ids outside the target's vocabulary [0, {tc.vocab_size})")
    elif head.shape[0] != tc.vocab_size:
        raise ModelLoadError(f"{path}: lm_head has {head.shape[0]} rows (draft_vocab_size) but no d2t maps them "
                             f"to the target's {tc.vocab_size} ids")
    model = LlamaModel(config, target.embed.to(dtype), [layer], tensors["norm.weight"].to(dtype), head, dtype)
    return EagleHead(model, fc_weight, fc_bias, token_map, aux_layers=aux)


@dataclasses.dataclass
class _EagleSeq(_Seq):
    #: float32 [capacity, hidden]: the target's features of positions 0 .. num_features - 1.
    features: torch.Tensor | None = None
    num_features: int = 0
    #: Leading KV positions computed from real features (the rest are last round's drafts).
    kv_real: int = 0


class EagleProposer(DraftModelProposer):
    """`ProposalSource` drafting with an EAGLE head; see the module docstring."""

    needs_hidden_states = True

    def __init__(self, head: EagleHead, vocab: VocabFingerprint | None = None,
                 config: DraftModelConfig | None = None, method: str = "eagle") -> None:
        super().__init__(head.model, vocab, config, method, token_map=head.token_map)
        if self.model.packed and not head.fc_weight.is_mkldnn:
            head = dataclasses.replace(head, fc_weight=run_on_cpu_worker(pack_weight, head.fc_weight))
        self.head = head
        #: The target states the verifier must send (`Info.hidden_state_layers`): None for
        #: its final ones (EAGLE-1), the layers' input states for an EAGLE-3 head.
        self.hidden_state_layers = head.aux_layers
        # An EAGLE-3 head feeds back its layer's output before the final norm.
        self._feedback_layers = (len(self.model.layers),) if head.eagle3 else None

    _state = _EagleSeq
    _min_context = 2  # drafting reads at least one feature

    def _context_feed(self, seq: _EagleSeq) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_{t+1}, f_t) for t = kv_real .. ctx_len - 2: at least the last one (the root)."""
        start = min(self.cache.lens[seq.slot], seq.ctx_len - 2)
        self.cache.rollback(seq.slot, start)
        return (torch.from_numpy(seq.ids[start + 1 : seq.ctx_len].astype(np.int64)),
                seq.features[start : seq.ctx_len - 1])

    def _root(self, seq: _EagleSeq) -> int:
        return seq.ctx_len - 2  # the head's row t reads x_{t+1} and gives x_{t+2}

    def _embeds(self, token_ids: torch.Tensor, features: list[torch.Tensor | None]) -> torch.Tensor:
        return self.head.fuse(token_ids, torch.cat(features))

    def _fed_context(self, seq: _EagleSeq) -> None:
        seq.kv_real = seq.ctx_len - 1

    def _update(self, r: ProposalRequest) -> _EagleSeq | None:
        """Apply the delta and place the features; None (resync) when state is missing."""
        found = self._lookup(r)
        if found is None:
            return None
        seq, append = found
        new_len = r.base_len + append.size
        hidden = r.hidden_states
        n = 0 if hidden is None else int(hidden.shape[0])
        width = self.model.config.hidden_size * len(self.hidden_state_layers or (None,))
        if hidden is not None and (hidden.ndim != 2 or hidden.shape[1] != width):
            raise ValueError(f"{r.seq_id}: hidden_states of shape {list(hidden.shape)}, want [n, {width}]")
        first = new_len - 1 - n  # position of the first row
        if first < 0:
            raise ValueError(f"{r.seq_id}: {n} hidden-state rows for a context of {new_len} tokens")
        if seq is None:
            seq = self._new(r.seq_id, new_len)
        kept = min(seq.num_features, max(r.base_len - 1, 0), first)
        if first > kept:  # a gap: positions kept .. first - 1 have no feature
            self._drop(r.seq_id)
            return None
        self._reserve(seq, new_len)
        seq.ids[r.base_len:new_len] = append
        seq.ctx_len = new_len
        cap = new_len + self.max_k
        if seq.features is None or seq.features.shape[0] < cap:
            grown_f = torch.zeros(max(2 * cap, 256), self.model.config.hidden_size, dtype=self.model.dtype)
            if seq.features is not None:
                grown_f[:kept] = seq.features[:kept]
            seq.features = grown_f
        if n:
            seq.features[first:new_len - 1] = self.head.combine(hidden)
        seq.num_features = new_len - 1
        # KV rows t < kv_keep were computed from real features and unchanged tokens.
        seq.kv_real = min(seq.kv_real, kept, self.cache.lens[seq.slot])
        self.cache.rollback(seq.slot, seq.kv_real)
        return seq
