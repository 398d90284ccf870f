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
import hashlib
import json
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proposers.train import (CONFIG_FILE, INFO_FILE, WEIGHTS_FILE, Corpus, TrainDraftConfig, _Layer, _Progress,
                             _rotate_half, build_corpus, frequent_ids)
from verifier.models.llama import LlamaModel
from verifier.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class TrainEagleConfig(TrainDraftConfig):
    init_layers: tuple[int, ...] = (29,)
    #: A corpus.pt written by `splitspec train draft` (same recipe fields); None: build one.
    corpus: str | None = None
    steps: int = 300
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
        c = self.config
        B, L = next_ids.shape
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        h = F.linear(torch.cat([F.embedding(next_ids, self.embed), features], dim=-1), self.fc_weight, self.fc_bias)
        layer = self.layer
        cos, sin = self.cos[:L].view(1, L, 1, D), self.sin[:L].view(1, L, 1, D)
        qkv = F.linear(h, layer.wqkv, layer.bqkv)
        qk = qkv[..., : (H + Hkv) * D].view(B, L, H + Hkv, D)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = qkv[..., (H + Hkv) * D :].view(B, L, Hkv, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + F.linear(o.transpose(1, 2).reshape(B, L, H * D), layer.wo)
        x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
        gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, layer.w_down)


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


def _groups(seqs, tokens_per_step, rng):
    while True:
        order = rng.permutation(len(seqs))
        windows = [sorted(order[i : i + 64], key=lambda j: len(seqs[j][0])) for i in range(0, len(order), 64)]
        groups = []
        for w in windows:
            cur: list[int] = []
            for j in w:
                longest = max([len(seqs[x][0]) for x in cur] + [len(seqs[j][0])])
                if cur and longest * (len(cur) + 1) > tokens_per_step:
                    groups.append(cur)
                    cur = []
                cur.append(j)
            if cur:
                groups.append(cur)
        for i in rng.permutation(len(groups)):
            yield groups[i]


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


def _lr(cfg, step):
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_eagle(target: LlamaModel, tokenizer: Tokenizer, out_dir: str | pathlib.Path, cfg: TrainEagleConfig,
                base: str, command: str, resume: bool = False, log=print) -> dict:
    """Run the recipe (module docstring); returns the `train_info.json` dict."""
    from verifier.models.vocab import VocabFingerprint

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    corpus_path = pathlib.Path(cfg.corpus) if cfg.corpus else out / "corpus.pt"
    if corpus_path.is_file() and (cfg.corpus or resume):
        saved = torch.load(corpus_path, weights_only=False)
        corpus = Corpus(saved["train"], saved["held_out"], saved["stats"])
        log(f"corpus: reused {corpus_path.name} ({corpus.stats})")
    else:
        corpus = build_corpus(target, tokenizer, cfg, log)
        torch.save(dataclasses.asdict(corpus), out / "corpus.pt")
        log(f"corpus: {corpus.stats}")
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
    vocab_ids = frequent_ids(corpus, cfg.vocab_subset, target.config.vocab_size, set(tokenizer.eos_token_ids))
    remap = np.full(target.config.vocab_size, -100, np.int64)
    remap[vocab_ids] = np.arange(vocab_ids.size)
    # Sequences of one token have no (input, target) pair.
    train_idx = [i for i, (x, _) in enumerate(corpus.train) if len(x) >= 2]
    seqs = [corpus.train[i] for i in train_idx]
    feats = [train_f[i] for i in train_idx]

    net = EagleNet(target, cfg.init_layers[0], vocab_ids)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, history = 0, []
    ckpt_path = out / "checkpoint.pt"
    rng = np.random.default_rng(cfg.seed + 1)
    if resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        step, history = ckpt["step"], ckpt["history"]
        rng = np.random.default_rng(cfg.seed + 1 + step)
        log(f"resumed at step {step}")
    if step == 0:
        acc = agreement(net, corpus.held_out, held_f, remap)
        history.append({"step": 0, "held_out_agreement": round(acc, 4)})
        log(f"step 0: held-out agreement {acc:.4f}")
    groups = _groups(seqs, cfg.tokens_per_step, rng)
    noise = torch.Generator().manual_seed(cfg.seed + 2 + step)
    bar = _Progress(cfg.steps, "training", log)
    bar.done = step
    t_train = time.perf_counter()
    ewma = None
    while step < cfg.steps:
        ids, f_in, f_out, labels, valid = _batch(seqs, feats, next(groups), remap)
        if cfg.feature_noise:
            f_in = f_in + cfg.feature_noise * (2 * torch.rand(f_in.shape, generator=noise) - 1)
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        pred = net(ids, f_in)
        reg = F.smooth_l1_loss(pred[valid], f_out[valid])
        mask = labels != -100
        cls = F.cross_entropy(pred[mask] @ net.head.t(), labels[mask]) if mask.any() else pred.sum() * 0
        loss = reg + cfg.cls_weight * cls
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        value = loss.item()
        ewma = value if ewma is None else 0.95 * ewma + 0.05 * value
        bar.update(1, f"loss {ewma:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = agreement(net, corpus.held_out, held_f, remap)
            history.append({"step": step, "loss": round(ewma, 4), "held_out_agreement": round(acc, 4)})
            log(f"{chr(10) if bar.tty else ''}step {step}: loss {ewma:.3f}, held-out agreement {acc:.4f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "step": step, "history": history},
                       ckpt_path)
    bar.close()
    train_s = time.perf_counter() - t_train
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    final = agreement(net, corpus.held_out, held_f, remap)
    weights_sha = save_eagle(net, vocab_ids, out)
    fingerprint = VocabFingerprint.of(tokenizer)
    c = target.config
    config = {
        "model_type": c.architecture, "architectures": ["LlamaForCausalLMEagle"],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position, "tie_word_embeddings": True,
        "attention_bias": c.attention_bias, "torch_dtype": "bfloat16",
        "splitspec": {
            "kind": "eagle", "base_model": base, "vocab_subset": int(vocab_ids.size),
            "tokenizer_fingerprint": {
                "vocab_type": fingerprint.vocab_type, "vocab_size": fingerprint.vocab_size,
                "bos_token_id": fingerprint.bos_token_id, "eos_token_ids": list(fingerprint.eos_token_ids),
                "token_texts_sha256": fingerprint.token_texts_sha256,
            },
            "weights_sha256": weights_sha,
        },
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    info = {
        "command": command, "recipe": dataclasses.asdict(cfg), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "corpus": corpus.stats, "features_s": round(features_s, 1),
        "history": history, "held_out_agreement": round(final, 4), "train_s": round(train_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log(f"saved {out / WEIGHTS_FILE} ({(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB), "
        f"held-out agreement {final:.4f}")
    return info


def save_eagle(net: EagleNet, vocab_ids: np.ndarray, out: pathlib.Path) -> str:
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
    path = out / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hashlib.sha256(path.read_bytes()).hexdigest()
