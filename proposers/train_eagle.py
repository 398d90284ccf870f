"""`splitspec train eagle`: distil an EAGLE head (proposers/eagle.py) from the target, on CPU.

Same corpus as `splitspec train draft` (`proposers/train.py`: the target's own greedy
answers to the repo's prompt set and standard-library prompts, plus stdlib source labelled
by the target), read from a `corpus.pt` it wrote (`--corpus`) or built afresh. Then:

1. **Features**: the target's final hidden states (the LM head's input) at every position of
   every corpus sequence, one forward pass each, kept in bfloat16 as the verifier sends them.
2. **Vocabulary subset**: as for the draft (most frequent target tokens + EOS).
3. **Head**: `fc([embed(x_{t+1}); f_t])` -> one Llama decoder layer (no input norm) ->
   f^_{t+1}. The layer starts from the target's layer `init_layers[0]` with its two output
   projections zeroed, and `fc` starts as "pass the feature through", so the untrained head
   predicts f^_{t+1} = f_t.
4. **Training** (EAGLE's objective): smooth-L1 between f^_{t+1} and the target's f_{t+1}
   plus `cls_weight` x cross-entropy of the LM-head rows on the target's next token, with
   uniform noise of `feature_noise` on the input features (drafting feeds the head its own,
   imperfect, features); AdamW, warm-up + cosine, clipping, checkpoints, `--resume`.
5. **Output** (`OUT/`): `model.safetensors` in the published EAGLE-1 layout (`fc.weight`,
   `fc.bias`, `layers.0.*`) plus `splitspec.vocab_ids`, bfloat16; `config.json` (HF Llama
   config, one layer, with a `splitspec` block: kind eagle, vocabulary fingerprint, weights
   sha256); `train_info.json` (command, recipe, figures).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proposers.train import (WEIGHTS_FILE, TrainDraftConfig, _Layer, _Progress, decoder_layer, fit, length_groups,
                             load_or_build_corpus, round_to_bfloat16, vocab_subset, write_outputs)
from verifier.models.llama import LlamaModel
from verifier.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class TrainEagleConfig(TrainDraftConfig):
    init_layers: tuple[int, ...] = (29,)
    #: A corpus.pt written by `splitspec train draft` (same recipe fields); None: build one.
    corpus: str | None = None
    steps: int = 600
    lr: float = 1e-3
    cls_weight: float = 0.1
    feature_noise: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.init_layers) != 1:
            raise ValueError(f"an EAGLE head has one decoder layer: init_layers must name one, got {self.init_layers}")


@torch.inference_mode()
def target_features(model: LlamaModel, seqs: list[tuple[list[int], list[int]]], progress=None) -> list[torch.Tensor]:
    """The target's final hidden states (bfloat16 [len, hidden]) of every position of each sequence."""
    cache = model.new_cache(1, max(len(x) for x, _ in seqs))
    out = []
    for ids, _ in seqs:
        slot = cache.allocate()
        last = torch.tensor([len(ids) - 1])
        _, hidden = model.forward(torch.tensor(ids, dtype=torch.int64), [slot], [len(ids)], cache, last,
                                  hidden_index=torch.arange(len(ids)))
        out.append(hidden.to(torch.bfloat16))
        cache.free(slot)
        if progress is not None:
            progress(1)
    return out


class EagleNet(nn.Module):
    """The head for training over padded [B, L] batches (same math as proposers/eagle.py)."""

    def __init__(self, target: LlamaModel, init_layer: int, vocab_ids: np.ndarray) -> None:
        super().__init__()
        c = target.config
        self.config = c
        H = c.hidden_size
        self.fc_weight = nn.Parameter(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))
        self.fc_bias = nn.Parameter(torch.zeros(H))
        self.layer = _Layer(target.layers[init_layer])
        with torch.no_grad():  # the residual branches start at zero: the head starts as f^ = f
            self.layer.wo.zero_()
            self.layer.w_down.zero_()
        self.register_buffer("embed", target.embed.float(), persistent=False)
        self.register_buffer("head", target.lm_head.float()[torch.from_numpy(vocab_ids).long()].contiguous(),
                             persistent=False)
        self.register_buffer("cos", target._cos.float(), persistent=False)
        self.register_buffer("sin", target._sin.float(), persistent=False)

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """next_ids int64 [B, L] (x_{t+1}), features [B, L, H] (f_t) -> f^_{t+1} [B, L, H]."""
        h = F.linear(torch.cat([F.embedding(next_ids, self.embed), features], dim=-1), self.fc_weight, self.fc_bias)
        return decoder_layer(h, self.layer, self.config, self.cos, self.sin, input_norm=False)


def _batch(seqs, feats, group, remap):
    """Rows t = 0 .. len - 2 of each sequence: inputs (x_{t+1}, f_t), targets f_{t+1} and the
    draft column of the target's token after t + 1 (-100: none)."""
    L = max(len(seqs[j][0]) for j in group) - 1
    Hd = feats[group[0]].shape[1]
    ids = np.zeros((len(group), L), np.int64)
    labels = np.full((len(group), L), -100, np.int64)
    f_in = torch.zeros(len(group), L, Hd)
    f_out = torch.zeros(len(group), L, Hd)
    valid = torch.zeros(len(group), L, dtype=torch.bool)
    for r, j in enumerate(group):
        x, y = seqs[j]
        n = len(x) - 1
        ids[r, :n] = x[1:]
        y = np.asarray(y[1:])
        labels[r, :n] = np.where(y >= 0, remap[np.maximum(y, 0)], -100)
        f = feats[j].float()
        f_in[r, :n] = f[:-1]
        f_out[r, :n] = f[1:]
        valid[r, :n] = True
    return torch.from_numpy(ids), f_in, f_out, torch.from_numpy(labels), valid


@torch.no_grad()
def agreement(net: EagleNet, seqs, feats, remap) -> float:
    """Top-1 agreement of the head's first draft with the target (teacher-forced features)."""
    hit = total = 0
    for j in range(len(seqs)):
        ids, f_in, _, labels, _ = _batch(seqs, feats, [j], remap)
        pred = (net(ids, f_in) @ net.head.t()).argmax(-1)
        mask = torch.from_numpy(np.asarray(seqs[j][1][1:]) >= 0)
        hit += int(((pred[0] == labels[0]) & mask).sum())
        total += int(mask.sum())
    return hit / max(total, 1)


def train_eagle(target: LlamaModel, tokenizer: Tokenizer, out_dir: str | pathlib.Path, cfg: TrainEagleConfig,
                base: str, command: str, resume: bool = False, log=print) -> dict:
    """Run the recipe (module docstring); returns the `train_info.json` dict."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    reuse = pathlib.Path(cfg.corpus) if cfg.corpus else (out / "corpus.pt" if resume else None)
    corpus = load_or_build_corpus(target, tokenizer, cfg, out, reuse, log, base)
    feats_path = out / "features.pt"
    t0 = time.perf_counter()
    if resume and feats_path.is_file():
        saved = torch.load(feats_path, weights_only=False)
        train_f, held_f = saved["train"], saved["held_out"]
    else:
        bar = _Progress(len(corpus.train) + len(corpus.held_out), "target features", log)
        train_f = target_features(target, corpus.train, bar.update)
        held_f = target_features(target, corpus.held_out, bar.update)
        bar.close()
        torch.save({"train": train_f, "held_out": held_f}, feats_path)
    features_s = time.perf_counter() - t0
    vocab_ids, remap, coverage = vocab_subset(corpus, cfg.vocab_subset, target.config.vocab_size,
                                              tokenizer.eos_token_ids)
    # Sequences of one token have no (input, target) pair.
    keep = [i for i, (x, _) in enumerate(corpus.train) if len(x) >= 2]
    seqs, feats = [corpus.train[i] for i in keep], [train_f[i] for i in keep]
    net = EagleNet(target, cfg.init_layers[0], vocab_ids)

    def batches_from(step: int):
        rng = np.random.default_rng(cfg.seed + 1 + step)
        noise = torch.Generator().manual_seed(cfg.seed + 2 + step)
        for group in length_groups([len(x) for x, _ in seqs], cfg.tokens_per_step, rng):
            ids, f_in, f_out, labels, valid = _batch(seqs, feats, group, remap)
            if cfg.feature_noise:
                f_in = f_in + cfg.feature_noise * (2 * torch.rand(f_in.shape, generator=noise) - 1)
            yield ids, f_in, f_out, labels, valid

    def batch_loss(batch) -> torch.Tensor:
        ids, f_in, f_out, labels, valid = batch
        pred = net(ids, f_in)
        reg = F.smooth_l1_loss(pred[valid], f_out[valid])
        mask = labels != -100
        if not mask.any():
            return reg
        return reg + cfg.cls_weight * F.cross_entropy(pred[mask] @ net.head.t(), labels[mask])

    history, train_s = fit(net, cfg, out, batch_loss, batches_from,
                           lambda: agreement(net, corpus.held_out, held_f, remap), resume, log)
    round_to_bfloat16(net)
    final = agreement(net, corpus.held_out, held_f, remap)
    save_eagle(net, vocab_ids, out)
    info = {
        "command": command, "recipe": dataclasses.asdict(cfg), "corpus": corpus.stats,
        "vocab_subset_coverage": round(coverage, 4), "features_s": round(features_s, 1), "history": history,
        "held_out_agreement": round(final, 4), "train_s": round(train_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
    }
    write_outputs(out, target, tokenizer, 1, {"kind": "eagle", "base_model": base, "vocab_subset": int(vocab_ids.size)},
                  info, log)
    return info


def save_eagle(net: EagleNet, vocab_ids: np.ndarray, out: pathlib.Path) -> None:
    """Write the head in the EAGLE-1 layout (bfloat16) plus `splitspec.vocab_ids`."""
    from safetensors.torch import save_file

    c = net.config
    H, Hkv, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    layer = net.layer
    q, k, v = layer.wqkv.detach().split([H * D, Hkv * D, Hkv * D])
    gate, up = layer.w_gate_up.detach().split([I, I])
    tensors = {
        "fc.weight": net.fc_weight.detach(), "fc.bias": net.fc_bias.detach(),
        "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
        "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": layer.wo.detach(),
        "layers.0.post_attention_layernorm.weight": layer.post_norm.detach(),
        "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
        "layers.0.mlp.down_proj.weight": layer.w_down.detach(),
        "splitspec.vocab_ids": torch.from_numpy(vocab_ids),
    }
    if layer.bqkv is not None:
        bq, bk, bv = layer.bqkv.detach().split([H * D, Hkv * D, Hkv * D])
        tensors.update({"layers.0.self_attn.q_proj.bias": bq, "layers.0.self_attn.k_proj.bias": bk,
                        "layers.0.self_attn.v_proj.bias": bv})
    tensors = {k: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
