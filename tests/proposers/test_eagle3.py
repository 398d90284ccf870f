"""EAGLE-3 heads (proposers/eagle.py) on the real bundled target.

No EAGLE-3 head exists for SmolLM2-135M, so the tests write one with seeded random weights
in the published layout (`fc` [H, 3H], `midlayer.*` with q/k/v over 2H inputs and a
`hidden_norm`, `norm`, a `lm_head` over a draft vocabulary, `d2t`, `t2d`). References:
HF transformers for the target's states entering layers 2, 15 and 27 (its
`output_hidden_states`), and for the head an implementation built from HF's own
`LlamaAttention`, `LlamaMLP`, `LlamaRMSNorm` and rotary embedding, wired as the EAGLE-3
paper's layer is, recomputed over the whole sequence for every draft (no cache).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re

import numpy as np
import pytest
import torch

from cluster.workloads import load_prompts
from protos.proposal import ProposalRequest
from proposers.draft_model import DraftModelConfig
from proposers.eagle import EagleProposer, head_hidden_state_layers, load_eagle
from proposers.registry import hidden_state_layers as registry_layers
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.errors import ModelLoadError
from verifier.models.vocab import VocabFingerprint
from verifier.sampling_params import SamplingParams

AUX = (2, 15, 27)  # EAGLE-3's (2, L // 2, L - 3) for the target's 30 layers
DRAFT_VOCAB = 4096


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return VocabFingerprint.of(tokenizer)


def _write_head(out, hf_model, seed: int = 0, **config_extra) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    hc = hf_model.config
    H, I = hc.hidden_size, hc.intermediate_size
    D = H // hc.num_attention_heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    # Draft ids over a spread of target ids: draft id d is target id d + d2t[d].
    targets = torch.arange(DRAFT_VOCAB) * 7 % hc.vocab_size
    targets[:2] = torch.tensor([2, 0])  # keep EOS (id 2) and id 0 drawable
    targets = targets.unique()  # sorted, as EAGLE-3's d2t assumes
    t2d = torch.zeros(hc.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    w = {
        "fc.weight": rand(H, 3 * H, scale=0.03),
        "midlayer.input_layernorm.weight": (1 + rand(H, scale=0.5).float()).to(torch.bfloat16),
        "midlayer.hidden_norm.weight": (1 + rand(H, scale=0.5).float()).to(torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": rand(hc.num_attention_heads * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(hc.num_key_value_heads * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(hc.num_key_value_heads * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, hc.num_attention_heads * D),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": rand(I, H),
        "midlayer.mlp.up_proj.weight": rand(I, H),
        "midlayer.mlp.down_proj.weight": rand(H, I),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        # the target's own LM-head rows, so drafts look like text
        "lm_head.weight": hf_model.lm_head.weight.detach()[targets].to(torch.bfloat16).contiguous(),
        "d2t": targets - torch.arange(targets.numel()),
        "t2d": t2d,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    config = {**hc.to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
              "draft_vocab_size": int(targets.numel()), **config_extra}
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    return w


@pytest.fixture(scope="module")
def eagle3(hf_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3")
    return out, _write_head(out, hf_model)


class _Reference:
    """An EAGLE-3 head from HF's Llama modules (eager attention, explicit causal mask)."""

    def __init__(self, hf_model, w: dict[str, torch.Tensor]) -> None:
        from transformers.models.llama import modeling_llama as m

        hc = type(hf_model.config)(**{**hf_model.config.to_dict(), "num_hidden_layers": 1})
        hc._attn_implementation = "eager"
        H = hc.hidden_size
        self.attn = m.LlamaAttention(hc, 0)
        for x in "qkv":  # the fused input [embeds; hidden] is 2H wide
            out_features = getattr(self.attn, f"{x}_proj").out_features
            setattr(self.attn, f"{x}_proj", torch.nn.Linear(2 * H, out_features, bias=False))
        self.mlp = m.LlamaMLP(hc)
        self.input_norm, self.hidden_norm, self.post_norm, self.norm = (
            m.LlamaRMSNorm(H, eps=hc.rms_norm_eps) for _ in range(4))
        self.rope = m.LlamaRotaryEmbedding(hc)
        f = {k: v.float() for k, v in w.items() if v.is_floating_point()}
        with torch.no_grad():
            for x in "qkvo":
                getattr(self.attn, f"{x}_proj").weight.copy_(f[f"midlayer.self_attn.{x}_proj.weight"])
            for x in ("gate", "up", "down"):
                getattr(self.mlp, f"{x}_proj").weight.copy_(f[f"midlayer.mlp.{x}_proj.weight"])
            self.input_norm.weight.copy_(f["midlayer.input_layernorm.weight"])
            self.hidden_norm.weight.copy_(f["midlayer.hidden_norm.weight"])
            self.post_norm.weight.copy_(f["midlayer.post_attention_layernorm.weight"])
            self.norm.weight.copy_(f["norm.weight"])
        self.fc = f["fc.weight"]
        self.lm_head = f["lm_head.weight"]
        self.d2t = w["d2t"]
        self.embed = hf_model.model.embed_tokens.weight.detach().float()

    @torch.no_grad()
    def layer(self, token_ids: list[int], g: torch.Tensor) -> torch.Tensor:
        """The layer's output (before `norm`) at every row, row t reading (x_{t+1}, g_t)."""
        T = len(token_ids)
        x = torch.cat([self.input_norm(self.embed[token_ids]), self.hidden_norm(g)], dim=-1).unsqueeze(0)
        positions = torch.arange(T).unsqueeze(0)
        cos_sin = self.rope(x, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        h = g.unsqueeze(0) + self.attn(x, position_embeddings=cos_sin, attention_mask=mask)[0]
        h = h + self.mlp(self.post_norm(h))
        return h[0]

    def chain(self, context: list[int], aux: torch.Tensor, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """k greedy drafts after `context`, given the target's aux states of its positions
        0 .. len - 2 ([len - 1, 3H]), and the layer's output behind each."""
        g = aux.float() @ self.fc.T
        tokens = list(context[1:])
        out, outputs = [], []
        for _ in range(k):
            last = self.layer(tokens, g)[-1]
            with torch.no_grad():
                d = int(torch.argmax(self.norm(last) @ self.lm_head.T))
            t = d + int(self.d2t[d])
            out.append(t)
            outputs.append(last)
            tokens.append(t)
            g = torch.cat([g, last.unsqueeze(0)])
        return out, outputs

    def drafts(self, context: list[int], aux: torch.Tensor, k: int) -> list[int]:
        return self.chain(context, aux, k)[0]


def _aux(model, ids: list[int]) -> torch.Tensor:
    """The target's states entering layers 2, 15 and 27 at every position, as the verifier sends them."""
    cache = model.new_cache(1, len(ids))
    _, hidden = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                              torch.tensor([len(ids) - 1]), hidden_index=torch.arange(len(ids)), hidden_layers=AUX)
    return hidden.to(torch.bfloat16)


def test_forward_returns_the_layer_inputs_hf_computes(model, hf_model, tokenizer):
    """`hidden_layers` gives the residual stream entering each layer, HF's
    `hidden_states[i]`; index 30 is the last layer's output, which the final norm turns
    into HF's last entry."""
    from verifier.models.llama import rms_norm

    ids = load_prompts("chat", tokenizer)[1]
    cache = model.new_cache(1, len(ids))
    logits, hidden = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                                   hidden_index=torch.arange(len(ids)), hidden_layers=(*AUX, 30))
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    H = model.config.hidden_size
    assert hidden.shape == (len(ids), 4 * H)
    for j, layer in enumerate(AUX):
        torch.testing.assert_close(hidden[:, j * H : (j + 1) * H], out.hidden_states[layer][0], atol=2e-3, rtol=1e-3)
    last = rms_norm(hidden[:, 3 * H :], model.final_norm, model.config.rms_norm_eps)
    torch.testing.assert_close(last, out.hidden_states[-1][0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(logits, out.logits[0], atol=2e-3, rtol=1e-3)


def test_published_eagle3_layout_loads_and_says_which_states_it_reads(eagle3, model, hf_model, vocab, tmp_path):
    out, w = eagle3
    head = load_eagle(out, model, vocab)
    assert head.eagle3 and head.aux_layers == AUX
    assert head_hidden_state_layers(out, 30) == AUX
    # what a verifier reads from its YAML before the proposer's replicas answer
    assert registry_layers("eagle", {"path": str(out)}, 30) == AUX
    from proposers.train import BUNDLED_EAGLE_DIR

    assert registry_layers("eagle", {}, 30) == (2, 15, 27)  # the default: the committed EAGLE-3 head
    assert registry_layers("eagle", {"path": str(BUNDLED_EAGLE_DIR)}, 30) is None  # EAGLE-1: final states
    assert registry_layers("ngram", {"path": str(out)}, 30) is None
    assert head.model.lm_head.shape[0] == w["lm_head.weight"].shape[0]
    np.testing.assert_array_equal(head.token_map, np.flatnonzero(w["t2d"].numpy()))
    proposer = EagleProposer(head, vocab, DraftModelConfig(max_num_seqs=1))
    assert proposer.needs_hidden_states and proposer.hidden_state_layers == AUX
    # eagle_config names other layers; fc must then read as many
    other = tmp_path / "other"
    _write_head(other, hf_model, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29]})
    assert head_hidden_state_layers(other, 30) == (1, 29)
    with pytest.raises(ModelLoadError, match=r"fc.weight has shape \[576, 1728\], want \[576, 1152\]"):
        load_eagle(other, model, vocab)


def test_eagle3_rounds_draft_what_the_reference_drafts(eagle3, model, hf_model, tokenizer, vocab):
    """Round 1 sends a whole context with its aux states; round 2 two of the drafts (as if
    accepted) plus another token with only the new positions' states. Each round's greedy
    chain equals the from-scratch reference's, and a delta with a gap in the states resyncs."""
    out, w = eagle3
    ref = _Reference(hf_model, w)
    proposer = EagleProposer(load_eagle(out, model, vocab), vocab, DraftModelConfig(max_num_seqs=2, max_k=4))
    for i, context in enumerate(load_prompts("chat", tokenizer)[2:4]):
        seq = f"s{i}"
        a1 = _aux(model, context)
        (p1,) = proposer.propose_sync([ProposalRequest(seq, 0, np.asarray(context, np.int32), 4, 0.0, a1[:-1])])
        want = ref.drafts(context, a1[:-1], 4)
        assert p1.draft_token_ids.tolist() == want
        assert len(set(want)) > 1 or i  # a head that drafts one id over and over would prove little
        append = p1.draft_token_ids[:2].tolist() + [int(tokenizer.encode(" yes")[0])]
        longer = context + append
        a2 = _aux(model, longer)
        (p2,) = proposer.propose_sync([ProposalRequest(seq, len(context), np.asarray(append, np.int32), 4, 0.0,
                                                       a2[len(context) - 1 : len(longer) - 1])])
        assert p2.draft_token_ids.tolist() == ref.drafts(longer, a2[:-1], 4)
        (p3,) = proposer.propose_sync([ProposalRequest(seq, len(longer), np.asarray([5, 6], np.int32), 2, 0.0,
                                                       a2[-1:])])
        assert p3.resync
    # states of the wrong width are refused, naming the shape wanted
    with pytest.raises(ValueError, match=r"want \[n, 1728\]"):
        proposer.propose_sync([ProposalRequest("x", 0, np.asarray([1, 2, 3], np.int32), 2, 0.0,
                                               torch.zeros(2, 576, dtype=torch.bfloat16))])


def _engine(model, tokenizer, source):
    return Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), {"eagle": source},
                  Controller.static(4, ("eagle",)))


@pytest.mark.slow
def test_engine_with_an_eagle3_head_is_exact_and_serves_the_same_drafts(eagle3, model, tokenizer, vocab):
    """Greedy output equals plain decoding; behind a real gRPC server the proposer's `Info`
    names the layers, the verifier sends them, and drafts and acceptance equal in-process."""
    from proposers.server import ProposerServicer, start_server
    from verifier.proposer_client import GrpcProposalSource

    out, _ = eagle3
    prompts = load_prompts("chat", tokenizer)[:3]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    off = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    config = DraftModelConfig(max_num_seqs=4)
    local = _engine(model, tokenizer, EagleProposer(load_eagle(out, model, vocab), vocab, config))
    in_process = local.generate_sync(prompts, params)
    assert [r.token_ids for r in in_process] == want
    assert sum(r.stats.drafted for r in in_process) > 0 and local.stats.num_resyncs == 0
    # token trees feed each node its parent's output as well
    trees = _engine(model, tokenizer, EagleProposer(load_eagle(out, model, vocab), vocab,
                                                     DraftModelConfig(max_num_seqs=4, tree=(3, 2, 1))))
    results = trees.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want and sum(r.stats.drafted for r in results) > 0

    async def served():
        remote = EagleProposer(load_eagle(out, model, vocab), vocab, config)
        server, port = await start_server(ProposerServicer(remote, max_k=config.max_k))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="eagle", deadline_s=30.0, needs_hidden_states=True,
                                    hidden_state_layers=AUX)
        try:
            info = await client.info()
            return info, await _engine(model, tokenizer, client).generate_all(prompts, params)
        finally:
            await client.close()
            await server.stop(0)

    info, results = asyncio.run(served())
    assert info.needs_hidden_states and tuple(info.hidden_state_layers) == AUX
    assert [r.token_ids for r in results] == want
    assert ([(r.stats.drafted, r.stats.accepted) for r in results]
            == [(r.stats.drafted, r.stats.accepted) for r in in_process])


def test_one_engine_sends_one_kind_of_hidden_states(eagle3, model, tokenizer, vocab):
    from proposers.train import BUNDLED_EAGLE_DIR

    out, _ = eagle3
    config = DraftModelConfig(max_num_seqs=1)
    sources = {"eagle": EagleProposer(load_eagle(BUNDLED_EAGLE_DIR, model, vocab), vocab, config),
               "eagle3": EagleProposer(load_eagle(out, model, vocab), vocab, config, method="eagle3")}
    with pytest.raises(ValueError, match=r"eagle: final, eagle3: \[2, 15, 27\]"):
        Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=256), sources,
               Controller.static(2, tuple(sources)))


@pytest.fixture(scope="module")
def tiny_eagle3(tiny_draft, model, tokenizer, tmp_path_factory):
    import dataclasses

    from proposers.train_eagle import TrainEagleConfig, train_eagle
    from tests.proposers.conftest import TINY

    cfg = TrainEagleConfig(**{**dataclasses.asdict(TINY), "init_layers": (29,), "steps": 4, "arch": "eagle3",
                              "corpus": str(tiny_draft[0] / "corpus.pt"), "distil_top": 8})
    out = tmp_path_factory.mktemp("eagle3-trained")
    info = train_eagle(model, tokenizer, out, cfg, base="bundled", command="splitspec train eagle --arch eagle3 (test)",
                       log=lambda *a: None)
    return out, info


@pytest.mark.parametrize("hidden_layers", [None, AUX], ids=["eagle1", "eagle3"])
def test_soft_labels_are_the_targets_probabilities_over_the_subset(model, tokenizer, hidden_layers):
    """`distil_top`: each position's soft label, against the target's full-vocabulary logits
    from a plain forward pass (its own LM head and norm): the K likeliest of the subset's
    columns and their softmax over the subset, renormalised over those K by hand. The
    features are what they are without soft labels."""
    from proposers.train_eagle import target_features

    context = load_prompts("chat", tokenizer)[5]
    rng = np.random.default_rng(0)
    vocab_ids = np.sort(rng.choice(model.config.vocab_size, 600, replace=False))
    K = 5
    head = model.lm_head.float()[torch.from_numpy(vocab_ids)]
    feats, soft = target_features(model, [(context, [])], hidden_layers=hidden_layers, soft=(head, K))
    plain = target_features(model, [(context, [])], hidden_layers=hidden_layers)
    torch.testing.assert_close(feats[0], plain[0], rtol=0, atol=0)
    cache = model.new_cache(1, len(context))
    with torch.no_grad():
        logits = model.forward(torch.tensor(context), [cache.allocate()], [len(context)], cache)
    sub = logits[:, torch.from_numpy(vocab_ids)].double()
    p = torch.softmax(sub, dim=-1)
    cols, probs = soft[0]
    assert cols.shape == probs.shape == (len(context), K)
    for t in range(len(context)):
        want = torch.argsort(p[t], descending=True)[:K]
        assert cols[t].long().tolist() == want.tolist(), t
        torch.testing.assert_close(probs[t].double(), p[t, want] / p[t, want].sum(), atol=2e-3, rtol=2e-3)


def test_soft_labels_line_up_with_the_corpus_labels(tiny_draft, model, tokenizer):
    """`_batch`'s soft labels for step j + 1 of row t are position t + j + 1's: wherever a
    step has a label (the target's own next token, from greedy decoding when the corpus
    was built) in the subset, the soft label's likeliest column is that label."""
    from proposers.train import Corpus, vocab_subset
    from proposers.train_eagle import _batch, target_features

    saved = torch.load(tiny_draft[0] / "corpus.pt", weights_only=False)
    corpus = Corpus(saved["train"], saved["held_out"], saved["stats"])
    vocab_ids, remap, _ = vocab_subset(corpus, 600, model.config.vocab_size, tokenizer.eos_token_ids)
    seqs = [s for s in corpus.train if len(s[0]) >= 2][:4]
    head = model.lm_head.float()[torch.from_numpy(vocab_ids).long()]
    feats, soft = target_features(model, seqs, hidden_layers=AUX, soft=(head, 3))
    *_, labels, valid, (cols, probs) = _batch(seqs, feats, list(range(len(seqs))), remap, 3, soft)
    has = labels != -100
    assert has[..., 2].sum() > 10  # third steps with labels
    assert torch.equal(cols[..., 0][has], labels[has])
    assert torch.allclose(probs.sum(-1)[has], torch.ones(()), atol=1e-2)
    assert (probs[..., 0] >= probs[..., 1]).all()


@pytest.mark.slow
def test_the_eagle3_recipe_writes_a_head_that_drafts_as_it_trained(tiny_eagle3, model, hf_model, tokenizer, vocab,
                                                                   tmp_path):
    """`splitspec train eagle --arch eagle3` writes the published layout; with noise on
    its weights (four steps leave it near its start), the training network's unrolled
    steps (`Eagle3Net.unroll`), the HF-module reference and the proposer draft alike."""
    from safetensors.torch import load_file

    from proposers.train import WEIGHTS_FILE
    from proposers.train_eagle import Eagle3Net, eagle3_config, save_eagle3, start_from

    out, info = tiny_eagle3
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(AUX)}
    assert config["splitspec"]["kind"] == "eagle" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert [h["step"] for h in info["history"]] == [0, 2, 4]
    saved = load_file(str(out / WEIGHTS_FILE))
    vocab_ids = (saved["d2t"] + torch.arange(saved["d2t"].numel())).numpy()
    np.testing.assert_array_equal(np.flatnonzero(saved["t2d"].numpy()), np.sort(vocab_ids))
    net = Eagle3Net(model, 29, vocab_ids, AUX)
    start_from(net, out, model, tokenizer)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in (net.layer.wo, net.layer.w_down, net.fc_weight, net.layer.wqkv):
            w.add_(0.03 * torch.randn(w.shape, generator=gen))
        for w in (net.layer.input_norm, net.hidden_norm, net.norm):
            w.mul_(1 + 0.3 * torch.randn(w.shape, generator=gen))
        for p in net.parameters():  # as saved
            p.copy_(p.to(torch.bfloat16).float())
    noisy = tmp_path / "noisy"
    noisy.mkdir()
    save_eagle3(net, vocab_ids, noisy)
    (noisy / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "splitspec"},
                                                   **eagle3_config(net, vocab_ids)}))
    ref = _Reference(hf_model, load_file(str(noisy / WEIGHTS_FILE)))
    proposer = EagleProposer(load_eagle(noisy, model, vocab), vocab, DraftModelConfig(max_num_seqs=1, max_k=4))
    context = load_prompts("chat", tokenizer)[5]
    aux = _aux(model, context)
    want, want_outputs = ref.chain(context, aux[:-1], 4)
    (p,) = proposer.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 4, 0.0, aux[:-1])])
    assert p.draft_token_ids.tolist() == want
    # the training network, last row fed the reference's drafts
    chain = torch.zeros(1, len(context) - 1, 4, dtype=torch.int64)
    chain[0, :, 0] = torch.tensor(context[1:])
    chain[0, -1, 1:] = torch.tensor(want[:-1])
    with torch.no_grad():
        outs = net.unroll(chain, aux[None, :-1].float())
    assert [int(vocab_ids[int(net.logits(o[0, -1]).argmax())]) for o in outs] == want
    for o, w in zip(outs, want_outputs):
        torch.testing.assert_close(o[0, -1], w, atol=2e-3, rtol=1e-3)


def test_an_eagle1_head_cannot_start_an_eagle3_one(model, tokenizer):
    from proposers.train import BUNDLED_EAGLE_DIR
    from proposers.train_eagle import Eagle3Net, TrainEagleConfig, start_from

    net = Eagle3Net(model, 29, np.arange(16), AUX)
    with pytest.raises(ValueError, match="an EAGLE-1 head cannot start an EAGLE-3 head reading layers"):
        start_from(net, BUNDLED_EAGLE_DIR, model, tokenizer)
    with pytest.raises(ValueError, match="arch must be eagle1 or eagle3"):
        TrainEagleConfig(arch="eagle2")


@pytest.mark.slow
def test_the_committed_eagle3_head_is_small_reads_three_layers_and_is_exact(model, tokenizer, vocab, exactness_prompts):
    """The head trained for the bundled target (proposers/assets/smollm2-135m-eagle3): at
    most 30 MB, reads the states entering layers 2, 30 // 2 and 30 - 3 (the target has 30),
    loads with its checksum, and drafts chains that keep greedy output exact and are
    accepted well beyond chance on chat prompts."""
    from proposers.train import BUNDLED_EAGLE3_DIR, WEIGHTS_FILE

    assert (BUNDLED_EAGLE3_DIR / WEIGHTS_FILE).stat().st_size <= 30 * 10**6
    assert model.config.num_layers == 30
    assert head_hidden_state_layers(BUNDLED_EAGLE3_DIR, 30) == (2, 15, 27)
    assert registry_layers("eagle", {"path": str(BUNDLED_EAGLE3_DIR)}, 30) == (2, 15, 27)
    head = load_eagle(BUNDLED_EAGLE3_DIR, model, vocab)
    assert head.eagle3 and head.aux_layers == (2, 15, 27)
    prompts = exactness_prompts[13:17]  # four chat prompts
    params = SamplingParams(max_tokens=32, temperature=0.0)
    off = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    engine = _engine(model, tokenizer, EagleProposer(head, vocab, DraftModelConfig(max_num_seqs=4)))
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want
    rounds = sum(r.stats.rounds_with_drafts for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert rounds > 0 and 1 + accepted / rounds >= 1.3, (rounds, accepted)


@pytest.mark.slow
def test_a_relative_asset_path_is_found_from_any_working_directory(tmp_path, monkeypatch):
    """`options: {path: proposers/assets/smollm2-135m-eagle3}` (as in bench-cpu-ngram-eagle.yaml)
    names the committed head wherever the replica's working directory is; a relative path
    that exists from the working directory is taken from there."""
    from proposers.registry import PROJECT_ROOT, resolve_path
    from proposers.train import BUNDLED_EAGLE3_DIR

    monkeypatch.chdir(tmp_path)
    relative = "proposers/assets/smollm2-135m-eagle3"
    assert resolve_path(relative) == BUNDLED_EAGLE3_DIR and PROJECT_ROOT / relative == BUNDLED_EAGLE3_DIR
    assert registry_layers("eagle", {"path": relative}, 30) == (2, 15, 27)
    (tmp_path / relative).mkdir(parents=True)
    assert resolve_path(relative) == pathlib.Path(relative)
    assert resolve_path("no/such/head") == pathlib.Path("no/such/head")  # the loader names it
    assert resolve_path("~/x") == pathlib.Path.home() / "x" and resolve_path(None) is None


def test_ngram_falling_back_to_the_committed_head_is_exact_and_drafts_where_ngram_cannot(
        model, tokenizer, vocab, exactness_prompts):
    """`Engine.fallbacks` {"ngram": "eagle"}: the rounds where n-gram lookup finds no match
    ask the trained EAGLE-3 head instead. On two summaries (which quote their text) and two
    chats (which mostly do not), greedy output equals plain decoding, both methods draft,
    and the fallback leaves fewer passes than n-gram alone, which emits one token in each
    round without a match."""
    from proposers.ngram import NgramProposer
    from proposers.train import BUNDLED_EAGLE3_DIR

    prompts = exactness_prompts[7:9] + exactness_prompts[13:15]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    config = EngineConfig(max_num_seqs=4, max_model_len=1024)
    off = Engine(model, tokenizer, config, None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    ngram = Engine(model, tokenizer, config, {"ngram": NgramProposer()}, Controller.static(4, ("ngram",)))
    assert [r.token_ids for r in ngram.generate_sync(prompts, params)] == want
    head = EagleProposer(load_eagle(BUNDLED_EAGLE3_DIR, model, vocab), vocab, DraftModelConfig(max_num_seqs=4))
    both = Engine(model, tokenizer, config, {"ngram": NgramProposer(), "eagle": head},
                  Controller.static(4, ("ngram",)), fallbacks={"ngram": "eagle"})
    results = both.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want
    by_method = {m: sum(r.stats.rounds_by_method.get(m, 0) for r in results) for m in ("ngram", "eagle")}
    assert by_method["ngram"] > 0 and by_method["eagle"] > 0, by_method
    assert both.stats.num_fallback_rounds == by_method["eagle"]
    assert max(r.stats.drafted / max(r.stats.rounds_with_drafts, 1) for r in results) <= 4
    assert both.stats.num_steps < ngram.stats.num_steps, (both.stats.num_steps, ngram.stats.num_steps)
    # A request that pins its method (speculation.method: ngram) gets n-gram only.
    pinned = both.generate_sync(prompts, params, method="ngram")
    assert [r.token_ids for r in pinned] == want
    assert [r.stats.rounds_by_method for r in pinned] == [r.stats.rounds_by_method for r in
                                                          ngram.generate_sync(prompts, params)]
    assert both.stats.num_fallback_rounds == by_method["eagle"]


def test_a_fallback_must_name_two_configured_methods(model, tokenizer):
    from proposers.ngram import NgramProposer

    with pytest.raises(ValueError, match=re.escape(
            "fallbacks: ngram's fallback must be another configured method (['ngram'] configured), got 'eagle'")):
        Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=64), {"ngram": NgramProposer()},
               Controller.static(4, ("ngram",)), fallbacks={"ngram": "eagle"})
    with pytest.raises(ValueError, match="fallbacks: ngram's fallback must be another .* got 'ngram'"):
        Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=64), {"ngram": NgramProposer()},
               Controller.static(4, ("ngram",)), fallbacks={"ngram": "ngram"})
    with pytest.raises(ValueError, match=re.escape("fallbacks: 'draft' has a fallback but is not a configured method")):
        Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=64), {"ngram": NgramProposer()},
               Controller.static(4, ("ngram",)), fallbacks={"draft": "ngram"})
