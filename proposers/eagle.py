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
from verifier.models.vocab import VocabFingerprint


@dataclasses.dataclass
class EagleHead:
    """The head's weights as one `LlamaModel` (target embeddings, its decoder layer(s), no
    final norm unless the checkpoint has one, LM-head rows) plus the fusion `fc`."""

    model: LlamaModel
    fc_weight: torch.Tensor  # [hidden, 2 * hidden]: input [embed(x); feature]
    fc_bias: torch.Tensor | None
    token_map: np.ndarray | None  # LM-head column -> target id; None when column c is id c

    def fuse(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
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
            head = dataclasses.replace(head, fc_weight=pack_weight(head.fc_weight))
        self.head = head

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
        if hidden is not None and (hidden.ndim != 2 or hidden.shape[1] != self.model.config.hidden_size):
            raise ValueError(f"{r.seq_id}: hidden_states of shape {list(hidden.shape)}, "
                             f"want [n, {self.model.config.hidden_size}]")
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
            seq.features[first:new_len - 1] = hidden.to(self.model.dtype)
        seq.num_features = new_len - 1
        # KV rows t < kv_keep were computed from real features and unchanged tokens.
        seq.kv_real = min(seq.kv_real, kept, self.cache.lens[seq.slot])
        self.cache.rollback(seq.slot, seq.kv_real)
        return seq
