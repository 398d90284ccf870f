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
   plus `cls_weight` x cross-entropy of the LM-head rows on the target's next token (with
   `distil_top` K, on the target's probabilities of its K likeliest subset tokens, taken
   in the features' pass), with
   uniform noise of `feature_noise` on the input features; AdamW, warm-up + cosine,
   clipping, checkpoints, `--resume`.
   **Training-time test** (as in HASS and EAGLE-3): drafting feeds the head its own f^
   after the first step, which a head trained on real features only has never seen (one
   trained that way drafted the target's next token 64% of the time at the first step but
   22% at the second, after a first that was right). So each
   batch runs `unroll` draft steps from every row at once (`EagleNet.unroll`: step j + 1
   of row t reads its own step-j output and attends to the real rows up to t and to its
   own earlier steps, exactly as the proposer's KV cache does), and step j + 1 of row t is
   trained on the target's feature of position t + j + 1 and the target's token after it,
   weighted `unroll_decay ** j`, wherever the text follows the target's own choices that
   far (`chain_rows`).
5. **Output** (`OUT/`): `model.safetensors` in the published EAGLE-1 layout (`fc.weight`,
   `fc.bias`, `layers.0.*`) plus `splitspec.vocab_ids`, bfloat16; `config.json` (HF Llama
   config, one layer, with a `splitspec` block: kind eagle, vocabulary fingerprint, weights
   sha256); `train_info.json` (command, recipe, figures: held-out agreement of the first
   draft, and held-out mean acceptance length of greedy 4-token chains, `held_out_figures`).

`arch="eagle3"` (`--arch eagle3`) trains an EAGLE-3 head instead (`Eagle3Net`): the features
are the target's states entering layers 2, L // 2 and L - 3, the loss is the tokens'
cross-entropy only, and the output is the published EAGLE-3 layout (`save_eagle3`), which
`proposers/eagle.py` serves with those states sent by the verifier.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proposers.eagle import eagle3_aux_layers
from proposers.train import (TrainDraftConfig, _figures, _Layer, _Progress, copy_layer, fit, layer_tensors,
                             length_groups, load_or_build_corpus, register_target_buffers, round_to_bfloat16,
                             save_bfloat16, soft_cross_entropy, subset_head, target_features, vocab_subset,
                             write_outputs)
from verifier.models.llama import LlamaModel, dense, rotate_half
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
    #: Training-time test: draft steps unrolled in training (1: EAGLE-1, the head sees real
    #: features only); step j's loss is weighted unroll_decay ** (j - 1).
    unroll: int = 3
    unroll_decay: float = 0.8
    #: "eagle1": the head reads the target's final states and regresses the next one (the
    #: layout above); "eagle3": it reads the states entering layers 2, L // 2 and L - 3 and
    #: trains on tokens only, written in the published EAGLE-3 layout.
    arch: str = "eagle1"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch not in ("eagle1", "eagle3"):
            raise ValueError(f"arch must be eagle1 or eagle3, got {self.arch!r}")
        if len(self.init_layers) != 1:
            raise ValueError(f"an EAGLE head has one decoder layer: init_layers must name one, got {self.init_layers}")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if not 0 < self.unroll_decay <= 1:
            raise ValueError(f"unroll_decay must be in (0, 1], got {self.unroll_decay}")


class EagleNet(nn.Module):
    """The head for training over padded [B, L] batches, run by `unroll` (same math as
    proposers/eagle.py)."""

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
        register_target_buffers(self, target, vocab_ids)

    def unroll(self, chain: torch.Tensor, features: torch.Tensor) -> list[torch.Tensor]:
        """Draft steps 1 .. D from every row at once, as drafting runs them (training-time test).

        chain int64 [B, L, D]: column 0 is x_{t+1}, column j the token fed at step j + 1
        (draft j; the target's own token on the accepted path); features [B, L, H]: f_t.
        Step 1 is the plain causal pass over real features. Step j + 1 of row t reads
        (chain[t, j], its own step-j output) at position t + j and attends, as the proposer's
        KV cache does, to step-1 rows 0 .. t and to row t of steps 2 .. j + 1.
        Returns D tensors [B, L, H]: step j + 1's f^_{t+j+1}.
        """
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        f = features
        for j in range(chain.shape[-1]):
            h = F.linear(torch.cat([F.embedding(chain[..., j], self.embed), f], dim=-1), self.fc_weight, self.fc_bias)
            f = _unrolled_layer(h, self.layer, self.config, self.cos, self.sin, keys, values)
            outs.append(f)
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the subset's columns of a step's output."""
        return out @ self.head.t()


class Eagle3Net(nn.Module):
    """An EAGLE-3 head for training (same math as proposers/eagle.py's EAGLE-3 path):
    g_t = fc([the target's states entering `aux_layers` at t]); the layer's attention reads
    [input_norm(embed(x_{t+1})); hidden_norm(g_t)] on the residual stream g_t; its output
    (before `norm`) is fed back as the next step's g, and norm -> LM-head rows give the draft.

    Starts from the target's layer `init_layer`: its q/k/v read the hidden half (the
    embedding half starts at zero, `hidden_norm` is the layer's input norm), its output
    projections are zeroed, and `fc` passes the deepest state read through, so the untrained
    head reads the target's logits off that state."""

    def __init__(self, target: LlamaModel, init_layer: int, vocab_ids: np.ndarray, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        c = target.config
        self.config = c
        self.aux_layers = tuple(aux_layers)
        H, n = c.hidden_size, len(aux_layers)
        self.fc_weight = nn.Parameter(torch.cat([torch.zeros(H, (n - 1) * H), torch.eye(H)], dim=1))
        self.layer = _Layer(target.layers[init_layer])
        with torch.no_grad():
            self.layer.wqkv = nn.Parameter(torch.cat([torch.zeros_like(self.layer.wqkv), self.layer.wqkv], dim=1))
            self.layer.wo.zero_()
            self.layer.w_down.zero_()
        self.hidden_norm = nn.Parameter(self.layer.input_norm.detach().clone())
        self.norm = nn.Parameter(target.final_norm.float().clone())
        register_target_buffers(self, target, vocab_ids)

    def unroll(self, chain: torch.Tensor, features: torch.Tensor) -> list[torch.Tensor]:
        """As `EagleNet.unroll`; features [B, L, n * H] are the target's aux states at t,
        and each step's output is the layer's before `norm`."""
        c = self.config
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        g = F.linear(features, self.fc_weight)
        for j in range(chain.shape[-1]):
            e = F.rms_norm(F.embedding(chain[..., j], self.embed), (c.hidden_size,), self.layer.input_norm,
                           c.rms_norm_eps)
            x = torch.cat([e, F.rms_norm(g, (c.hidden_size,), self.hidden_norm, c.rms_norm_eps)], dim=-1)
            g = _unrolled_layer(g, self.layer, c, self.cos, self.sin, keys, values, x=x)
            outs.append(g)
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        c = self.config
        return F.rms_norm(out, (c.hidden_size,), self.norm, c.rms_norm_eps) @ self.head.t()


def _unrolled_layer(h: torch.Tensor, layer: _Layer, c, cos: torch.Tensor, sin: torch.Tensor,
                    keys: list[torch.Tensor], values: list[torch.Tensor], x: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The head's decoder layer (no input norm) for step len(keys) + 1 of `EagleNet.unroll`;
    appends this step's keys and values. `x`: what the attention reads instead of the
    residual stream `h` (an EAGLE-3 layer's [embeddings; hidden])."""
    B, L, _ = h.shape
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    j = len(keys)
    qkv = F.linear(h if x is None else x, layer.wqkv, layer.bqkv)
    qk = qkv[..., : (H + Hkv) * D].view(B, L, H + Hkv, D)
    qk = qk * cos[j : j + L].view(1, L, 1, D) + rotate_half(qk) * sin[j : j + L].view(1, L, 1, D)
    q = qk[:, :, :H].transpose(1, 2)
    keys.append(qk[:, :, H:].transpose(1, 2))
    values.append(qkv[..., (H + Hkv) * D :].view(B, L, Hkv, D).transpose(1, 2))
    if j == 0:
        o = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=True)
    else:
        eye = torch.eye(L, dtype=torch.bool)
        mask = torch.cat([torch.ones(L, L, dtype=torch.bool).tril()] + [eye] * j, dim=1)
        o = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                           enable_gqa=True)
    h = h + F.linear(o.transpose(1, 2).reshape(B, L, H * D), layer.wo)
    x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
    gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, layer.w_down)


def chain_rows(x: list[int], y: list[int], depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows t = 0 .. len(x) - 2 of one sequence: (chain [n, depth] tokens fed at each step,
    target [n, depth] the target's token after step j's position (-1: none), valid [n, depth]).

    Step j + 1 of row t predicts the feature of position t + j + 1 and the target's token
    y[t+j+1]. It is valid when that position exists and the text follows the target's own
    choices up to it (x[t+i+1] == y[t+i] for 1 <= i <= j), so that the real feature there is
    the one an accepted draft leads to; its input token is then y[t+j]."""
    x, y = np.asarray(x, np.int64), np.asarray(y, np.int64)
    n = len(x) - 1
    t = np.arange(n)
    chain = np.zeros((n, depth), np.int64)
    target = np.full((n, depth), -1, np.int64)
    valid = np.zeros((n, depth), bool)
    chain[:, 0] = x[1:]
    ok = np.ones(n, bool)
    for j in range(depth):
        if j:
            inside = t + j + 1 <= n
            prev = np.where(inside, y[np.minimum(t + j, n)], -1)
            ok &= inside & (prev >= 0) & (x[np.minimum(t + j + 1, n)] == prev)
            chain[:, j] = np.where(ok, prev, 0)
        valid[:, j] = ok
        target[:, j] = np.where(ok, y[np.minimum(t + j + 1, n)], -1)
    return chain, target, valid


def _batch(seqs, feats, group, remap, depth: int = 1, soft=None):
    """Padded rows of `group` (see `chain_rows`): chain [B, L, D], f_t [B, L, H], the real
    features [B, L + D, H] (step j + 1's targets are columns j + 1 .. j + L), labels
    [B, L, D] (draft columns; -100: none or outside the subset), valid [B, L, D] and, with
    `soft` (per sequence the `soft_labels` of its positions), the soft labels of step j + 1
    of row t, those of position t + j + 1: (columns int64 [B, L, D, K], probabilities
    [B, L, D, K]), else None."""
    L = max(len(seqs[j][0]) for j in group) - 1
    Hd = feats[group[0]].shape[1]
    chain = np.zeros((len(group), L, depth), np.int64)
    labels = np.full((len(group), L, depth), -100, np.int64)
    valid = np.zeros((len(group), L, depth), bool)
    f_in = torch.zeros(len(group), L, Hd)
    f_real = torch.zeros(len(group), L + depth, Hd)
    if soft is not None:
        K = soft[group[0]][0].shape[1]
        soft_cols = torch.zeros(len(group), L, depth, K, dtype=torch.int64)
        soft_p = torch.zeros(len(group), L, depth, K)
    for r, j in enumerate(group):
        x, y = seqs[j]
        n = len(x) - 1
        c, tgt, ok = chain_rows(x, y, depth)
        chain[r, :n], valid[r, :n] = c, ok
        labels[r, :n] = np.where(tgt >= 0, remap[np.maximum(tgt, 0)], -100)
        f = feats[j].float()
        f_in[r, :n] = f[:-1]
        f_real[r, : n + 1] = f
        if soft is not None:
            cols, p = soft[j]
            for d in range(depth):  # rows t < n - d have a position t + d + 1
                soft_cols[r, : n - d, d] = cols[d + 1 : n + 1].long()
                soft_p[r, : n - d, d] = p[d + 1 : n + 1].float()
    return (torch.from_numpy(chain), f_in, f_real, torch.from_numpy(labels), torch.from_numpy(valid),
            None if soft is None else (soft_cols, soft_p))


#: Draft length of the held-out mean acceptance length (the benchmark's k).
EVAL_K = 4


@torch.no_grad()
def held_out_figures(net: EagleNet | Eagle3Net, seqs, feats, remap, k: int = EVAL_K) -> dict:
    """`held_out_agreement`: top-1 agreement of the head's first draft with the target
    (teacher-forced features; a target token outside the subset is a miss);
    `held_out_acceptance_length`: mean acceptance length of greedy k-token chains drafted
    from every row with k known target tokens ahead (1 + the drafts matching them in order)."""
    hit = total = 0
    accepted = chains = 0
    for j in range(len(seqs)):
        chain, f_in, _, labels, valid, _ = _batch(seqs, feats, [j], remap, k)
        outs = net.unroll(chain, f_in)
        preds = torch.stack([net.logits(o).argmax(-1) for o in outs], dim=-1)[0]  # [L, k]
        match = (preds == labels[0]).numpy()
        has_label = np.asarray(seqs[j][1][1:]) >= 0
        hit += int((match[:, 0] & has_label).sum())
        total += int(has_label.sum())
        full = valid[0, :, k - 1].numpy()
        accepted += int(np.cumprod(match[full], axis=1).sum())
        chains += int(full.sum())
    return {"held_out_agreement": hit / max(total, 1), "held_out_acceptance_length": 1 + accepted / max(chains, 1)}


def train_eagle(target: LlamaModel, tokenizer: Tokenizer, out_dir: str | pathlib.Path, cfg: TrainEagleConfig,
                base: str, command: str, resume: bool = False, log=print) -> dict:
    """Run the recipe (module docstring); returns the `train_info.json` dict."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    reuse = pathlib.Path(cfg.corpus) if cfg.corpus else (out / "corpus.pt" if resume else None)
    corpus = load_or_build_corpus(target, tokenizer, cfg, out, reuse, log, base)
    eagle3 = cfg.arch == "eagle3"
    aux = eagle3_aux_layers({}, target.config.num_layers) if eagle3 else None
    vocab_ids, remap, coverage = vocab_subset(corpus, cfg.vocab_subset, target.config.vocab_size,
                                              tokenizer.eos_token_ids)
    feats_path = out / "features.pt"
    t0 = time.perf_counter()
    saved = torch.load(feats_path, weights_only=False) if resume and feats_path.is_file() else None
    if saved is not None and (saved.get("distil_top", 0) == cfg.distil_top):
        train_f, held_f, train_soft = saved["train"], saved["held_out"], saved.get("train_soft")
    else:
        bar = _Progress(len(corpus.train) + len(corpus.held_out), "target features", log)
        soft = None
        if cfg.distil_top:
            soft = (subset_head(target, vocab_ids), cfg.distil_top)
            train_f, train_soft = target_features(target, corpus.train, bar.update, aux, soft)
        else:
            train_f, train_soft = target_features(target, corpus.train, bar.update, aux), None
        held_f = target_features(target, corpus.held_out, bar.update, aux)
        bar.close()
        torch.save({"train": train_f, "held_out": held_f, "train_soft": train_soft, "distil_top": cfg.distil_top},
                   feats_path)
    features_s = time.perf_counter() - t0
    # Sequences of one token have no (input, target) pair.
    keep = [i for i, (x, _) in enumerate(corpus.train) if len(x) >= 2]
    seqs, feats = [corpus.train[i] for i in keep], [train_f[i] for i in keep]
    soft_of = None if train_soft is None else [train_soft[i] for i in keep]
    net = Eagle3Net(target, cfg.init_layers[0], vocab_ids, aux) if eagle3 else EagleNet(target, cfg.init_layers[0],
                                                                                        vocab_ids)
    if cfg.init_from:
        start_from(net, cfg.init_from, target, tokenizer)
        log(f"starting from the head in {cfg.init_from}")

    def batches_from(step: int):
        rng = np.random.default_rng(cfg.seed + 1 + step)
        noise = torch.Generator().manual_seed(cfg.seed + 2 + step)
        for group in length_groups([len(x) for x, _ in seqs], cfg.tokens_per_step, rng):
            chain, f_in, f_real, labels, valid, soft = _batch(seqs, feats, group, remap, cfg.unroll, soft_of)
            if cfg.feature_noise:
                f_in = f_in + cfg.feature_noise * (2 * torch.rand(f_in.shape, generator=noise) - 1)
            yield chain, f_in, f_real, labels, valid, soft

    def batch_loss(batch) -> torch.Tensor:
        chain, f_in, f_real, labels, valid, soft = batch
        L = chain.shape[1]
        loss = torch.zeros(())
        for j, pred in enumerate(net.unroll(chain, f_in)):
            ok = valid[..., j]
            if not ok.any():
                break
            mask = labels[..., j] != -100
            if not mask.any():
                ce = torch.zeros(())
            elif soft is None:
                ce = F.cross_entropy(net.logits(pred[mask]), labels[..., j][mask])
            else:
                ce = soft_cross_entropy(net.logits(pred[mask]), soft[0][:, :, j][mask], soft[1][:, :, j][mask])
            if eagle3:  # tokens only: the head's feature is its own
                step = ce
            else:
                step = F.smooth_l1_loss(pred[ok], f_real[:, j + 1 : j + 1 + L][ok]) + cfg.cls_weight * ce
            loss = loss + cfg.unroll_decay ** j * step
        return loss

    history, train_s = fit(net, cfg, out, batch_loss, batches_from,
                           lambda: held_out_figures(net, corpus.held_out, held_f, remap), resume, log)
    round_to_bfloat16(net)
    final = held_out_figures(net, corpus.held_out, held_f, remap)
    if eagle3:
        save_eagle3(net, vocab_ids, out)
    else:
        save_eagle(net, vocab_ids, out)
    info = {
        "command": command, "recipe": dataclasses.asdict(cfg), "corpus": corpus.stats,
        "vocab_subset_coverage": round(coverage, 4), "features_s": round(features_s, 1), "history": history,
        **_figures(final), "train_s": round(train_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
    }
    write_outputs(out, target, tokenizer, 1, {"kind": "eagle", "base_model": base, "vocab_subset": int(vocab_ids.size)},
                  info, log, eagle3_config(net, vocab_ids) if eagle3 else None)
    return info


def start_from(net: EagleNet, path: str | pathlib.Path, target: LlamaModel, tokenizer: Tokenizer) -> None:
    """Set `net`'s trained weights (`fc`, the decoder layer) to the head in `path`, loaded
    and checked as the proposer loads it (`proposers.eagle.load_eagle`: sha256, vocabulary,
    sizes). The LM-head rows are not taken: they are the target's, for this corpus's subset."""
    from proposers.eagle import load_eagle
    from verifier.models.vocab import VocabFingerprint

    head = load_eagle(path, target, VocabFingerprint.of(tokenizer))
    if len(head.model.layers) != 1:
        raise ValueError(f"{path}: an EAGLE head with {len(head.model.layers)} layers; training has one")
    eagle3 = isinstance(net, Eagle3Net)
    if head.eagle3 != eagle3 or (eagle3 and head.aux_layers != net.aux_layers):
        def kind(h3, aux):
            return f"an EAGLE-3 head reading layers {list(aux)}" if h3 else "an EAGLE-1 head"
        raise ValueError(f"{path}: {kind(head.eagle3, head.aux_layers)} cannot start "
                         f"{kind(eagle3, getattr(net, 'aux_layers', ()))}")
    w = head.model.layers[0]
    # An EAGLE-1 head's layer skips its input norm (`decoder_layer(input_norm=False)`).
    copy_layer(net.layer, w, f"{path}: the head's layer", input_norm=eagle3)
    with torch.no_grad():
        net.fc_weight.copy_(dense(head.fc_weight))
        if eagle3:
            net.hidden_norm.copy_(w.hidden_norm)
            net.norm.copy_(head.model.final_norm)
        else:
            net.fc_bias.copy_(head.fc_bias if head.fc_bias is not None else torch.zeros_like(net.fc_bias))


def save_eagle(net: EagleNet, vocab_ids: np.ndarray, out: pathlib.Path) -> None:
    """Write the head in the EAGLE-1 layout (bfloat16) plus `splitspec.vocab_ids`."""
    save_bfloat16({"fc.weight": net.fc_weight.detach(), "fc.bias": net.fc_bias.detach(),
                   **layer_tensors(net.layer, net.config, "layers.0"),
                   "splitspec.vocab_ids": torch.from_numpy(vocab_ids)}, out)


def save_eagle3(net: Eagle3Net, vocab_ids: np.ndarray, out: pathlib.Path) -> None:
    """Write the head in the published EAGLE-3 layout (bfloat16): `fc`, `midlayer.*`,
    `norm`, `lm_head` (the subset's rows), `d2t` (draft id d is target id d + d2t[d]) and
    `t2d` (which target ids the head can draft), as vLLM and SGLang read it too."""
    ids = torch.from_numpy(vocab_ids.astype(np.int64))
    t2d = torch.zeros(net.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    save_bfloat16({"fc.weight": net.fc_weight.detach(),
                   "midlayer.input_layernorm.weight": net.layer.input_norm.detach(),
                   "midlayer.hidden_norm.weight": net.hidden_norm.detach(),
                   **layer_tensors(net.layer, net.config, "midlayer"),
                   "norm.weight": net.norm.detach(), "lm_head.weight": net.head,
                   "d2t": ids - torch.arange(ids.numel()), "t2d": t2d}, out)


def eagle3_config(net: Eagle3Net, vocab_ids: np.ndarray) -> dict:
    """The EAGLE-3 fields of the head's config.json."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": int(vocab_ids.size),
            "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(net.aux_layers)}}
