"""The EAGLE proposer (proposers/eagle.py), its recipe (proposers/train_eagle.py) and the
hidden states the verifier sends it, on the real bundled model.

References: HF transformers for the target's final hidden states; for the head, the
training network (plain causal attention over the whole sequence, recomputed from scratch
for every draft) run on the saved weights, against the proposer's KV-cached rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cluster.workloads import load_prompts
from protos.proposal import ProposalRequest
from proposers.draft_model import DraftModelConfig
from proposers.eagle import EagleProposer, load_eagle
from proposers.train import BUNDLED_EAGLE_DIR, WEIGHTS_FILE
from proposers.train import decoder_layer
from proposers.train_eagle import (EagleNet, TrainEagleConfig, chain_rows, held_out_figures, start_from,
                                     train_eagle)
from tests.proposers.conftest import TINY
from tests.proposers.tree_check import trees_are_exact_and_accept_more
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.errors import ModelLoadError
from verifier.models.vocab import VocabFingerprint
from verifier.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return VocabFingerprint.of(tokenizer)


@pytest.fixture(scope="module")
def tiny_eagle(tiny_draft, model, tokenizer, tmp_path_factory):
    corpus = tiny_draft[0] / "corpus.pt"
    cfg = TrainEagleConfig(**{**dataclasses.asdict(TINY), "init_layers": (29,), "corpus": str(corpus), "steps": 4})
    out = tmp_path_factory.mktemp("eagle")
    info = train_eagle(model, tokenizer, out, cfg, base="bundled", command="splitspec train eagle (test)",
                       log=lambda *a: None)
    return out, info


def _features(model, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states of every position (bfloat16, as the verifier sends them)."""
    cache = model.new_cache(1, len(ids))
    _, hidden = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                              torch.tensor([len(ids) - 1]), hidden_index=torch.arange(len(ids)))
    return hidden.to(torch.bfloat16)


def test_forward_returns_the_final_hidden_states_hf_computes(model, hf_model, tokenizer):
    ids = load_prompts("chat", tokenizer)[0]
    cache = model.new_cache(1, len(ids))
    logits, hidden = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                                   hidden_index=torch.arange(len(ids)))
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(logits, out.logits[0], atol=2e-3, rtol=1e-3)


def _reference_net(model, head_dir) -> tuple[EagleNet, np.ndarray]:
    from safetensors.torch import load_file

    saved = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(head_dir / WEIGHTS_FILE)).items()}
    vocab_ids = saved["splitspec.vocab_ids"].numpy()
    net = EagleNet(model, 29, vocab_ids.astype(np.int32))
    layer = net.layer
    with torch.no_grad():
        net.fc_weight.copy_(saved["fc.weight"])
        net.fc_bias.copy_(saved["fc.bias"])
        layer.wqkv.copy_(torch.cat([saved[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
        layer.wo.copy_(saved["layers.0.self_attn.o_proj.weight"])
        layer.post_norm.copy_(saved["layers.0.post_attention_layernorm.weight"])
        layer.w_gate_up.copy_(torch.cat([saved["layers.0.mlp.gate_proj.weight"], saved["layers.0.mlp.up_proj.weight"]]))
        layer.w_down.copy_(saved["layers.0.mlp.down_proj.weight"])
    return net.eval(), vocab_ids.astype(np.int64)


def _recompute(net, ids: list[int], feats: list[torch.Tensor]) -> torch.Tensor:
    """The head over a whole sequence with plain causal attention (the draft's training
    layer, not `EagleNet.unroll`): row t reads (x_{t+1}, f_t); returns every row's f^."""
    h = F.linear(torch.cat([F.embedding(torch.tensor([ids[1:]]), net.embed), torch.stack(feats)[None]], dim=-1),
                 net.fc_weight, net.fc_bias)
    return decoder_layer(h, net.layer, net.config, net.cos, net.sin, input_norm=False)[0]


@torch.no_grad()
def _reference_chain(net, vocab_ids, context: list[int], features: torch.Tensor, k: int):
    """k greedy drafts and the f^ behind each, recomputing the head over the whole sequence
    for each: rows past the target's features read the head's own outputs."""
    ids, feats, drafts, outs = list(context), [f for f in features.float()], [], []
    for _ in range(k):
        out = _recompute(net, ids, feats)[-1]
        token = int(vocab_ids[int((out @ net.head.t()).argmax())])
        drafts.append(token)
        outs.append(out)
        ids.append(token)
        feats.append(out)
    return drafts, outs


def _reference_drafts(net, vocab_ids, context: list[int], features: torch.Tensor, k: int) -> list[int]:
    return _reference_chain(net, vocab_ids, context, features, k)[0]


def test_chain_rows_follow_the_targets_path_by_hand():
    # Position 0 is prompt (no label); the target's choice at position 3 (99) leaves the text.
    x, y = [10, 11, 12, 13, 14], [-1, 12, 13, 99, 20]
    chain, target, valid = chain_rows(x, y, 3)
    assert chain.tolist() == [[11, 12, 13], [12, 13, 0], [13, 0, 0], [14, 0, 0]]
    assert target.tolist() == [[12, 13, 99], [13, 99, -1], [99, -1, -1], [20, -1, -1]]
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, False, False], [True, False, False]]


@pytest.fixture(scope="module")
def perturbed_head(tiny_eagle, model):
    """The miniature head with noise on its output projections, so that attention and the
    MLP matter (four training steps leave it close to "f^ = f")."""
    net, vocab_ids = _reference_net(model, tiny_eagle[0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in (net.layer.wo, net.layer.w_down, net.fc_weight):
            w.add_(0.05 * torch.randn(w.shape, generator=gen))
    return net, vocab_ids


@pytest.mark.slow
def test_unrolled_steps_are_what_drafting_computes(perturbed_head, model, tokenizer):
    """`EagleNet.unroll` (training-time test) runs k draft steps from every row at once;
    each row's chain must equal drafting from that row alone, recomputed from scratch, while
    the other rows are fed unrelated tokens."""
    net, vocab_ids = perturbed_head
    ids = load_prompts("chat", tokenizer)[0]
    feats = _features(model, ids).float()
    k, n = 3, len(ids) - 1
    chain = torch.randint(5, 40000, (1, n, k), generator=torch.Generator().manual_seed(1))
    chain[0, :, 0] = torch.tensor(ids[1:])
    rows = [0, 3, n // 2, n - 1]
    refs = {}
    for t in rows:
        refs[t] = _reference_chain(net, vocab_ids, ids[: t + 2], feats[: t + 1], k)
        chain[0, t, 1:] = torch.tensor(refs[t][0][:-1])
    with torch.no_grad():
        outs = net.unroll(chain, feats[None, :-1])
    assert len(outs) == k
    for t in rows:
        drafts, want = refs[t]
        for j in range(k):
            torch.testing.assert_close(outs[j][0, t], want[j], atol=2e-3, rtol=1e-3)
        assert [int(vocab_ids[int((o[0, t] @ net.head.t()).argmax())]) for o in outs] == drafts
    # Step 1 is the head over real features: the recompute's rows.
    torch.testing.assert_close(outs[0][0], _recompute(net, ids, list(feats[:-1])), atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_held_out_acceptance_length_counts_drafts_that_match_in_order(perturbed_head, model, tokenizer):
    """The recipe's held-out figures against drafting from every row alone: agreement is
    draft 1 against the target's token; acceptance length 1 + the leading drafts of k = 4
    that are the target's next tokens, over rows with four labelled tokens ahead."""
    net, vocab_ids = perturbed_head
    remap = np.full(model.config.vocab_size, -100, np.int64)
    remap[vocab_ids] = np.arange(vocab_ids.size)
    # An answer made of the head's own three-token chains, each followed by " the", so that
    # matches of every length occur; labels are the answer's tokens (as the recipe's are).
    prompt = load_prompts("chat", tokenizer)[1]
    other = tokenizer.encode(" the")[0]
    answer: list[int] = []
    for _ in range(3):
        ctx = prompt + answer
        answer += _reference_drafts(net, vocab_ids, ctx, _features(model, ctx)[:-1], 3) + [other]
    x, y = prompt + answer[:-1], [-1] * (len(prompt) - 1) + answer
    feats = _features(model, x)
    figures = held_out_figures(net, [(x, y)], [feats], remap, k=4)
    hits, lengths = 0, []
    for t in range(len(prompt) - 2, len(x) - 1):  # rows whose next token is an answer token
        drafts = _reference_drafts(net, vocab_ids, x[: t + 2], feats[: t + 1], 4)
        hits += drafts[0] == y[t + 1]
        if t + 4 <= len(x) - 1:
            ok = [d == y[t + 1 + j] for j, d in enumerate(drafts)]
            lengths.append(1 + (ok + [False]).index(False))
    assert len(lengths) == len(answer) - 3 and max(lengths) >= 3
    assert figures["held_out_agreement"] == pytest.approx(hits / len(answer))
    assert figures["held_out_acceptance_length"] == pytest.approx(np.mean(lengths))


@pytest.mark.slow
def test_rounds_with_features_draft_what_a_full_recompute_drafts(tiny_eagle, model, tokenizer, vocab):
    """Round 1 sends a whole context and its features; round 2 appends two of the round-1
    drafts (as if accepted) plus one other token, with only the new positions' features.
    The proposer must keep its KV of real-feature positions, drop the rest, and draft as
    the from-scratch reference does."""
    net, vocab_ids = _reference_net(model, tiny_eagle[0])
    proposer = EagleProposer(load_eagle(tiny_eagle[0], model, vocab), vocab,
                             DraftModelConfig(max_num_seqs=2, max_k=4))
    for i, context in enumerate(load_prompts("chat", tokenizer)[:2]):
        seq = f"s{i}"
        f1 = _features(model, context)
        (p1,) = proposer.propose_sync([ProposalRequest(seq, 0, np.asarray(context, np.int32), 4, 0.0, f1[:-1])])
        assert p1.draft_token_ids.tolist() == _reference_drafts(net, vocab_ids, context, f1[:-1], 4)
        append = p1.draft_token_ids[:2].tolist() + [int(tokenizer.encode(" yes")[0])]
        longer = context + append
        f2 = _features(model, longer)
        n = len(append)  # positions len(context) - 1 .. len(longer) - 2
        (p2,) = proposer.propose_sync([ProposalRequest(seq, len(context), np.asarray(append, np.int32), 4, 0.0,
                                                       f2[len(context) - 1 : len(longer) - 1])])
        assert f2[len(context) - 1 : len(longer) - 1].shape[0] == n
        assert p2.draft_token_ids.tolist() == _reference_drafts(net, vocab_ids, longer, f2[:-1], 4)
        # A delta that leaves a gap in the features is answered with resync.
        (p3,) = proposer.propose_sync([ProposalRequest(seq, len(longer), np.asarray([5, 6], np.int32), 2, 0.0,
                                                       f2[-1:])])
        assert p3.resync


@pytest.mark.slow
def test_recipe_output_and_refusals(tiny_eagle, model, vocab, tmp_path):
    import hashlib
    import json
    import shutil

    out, info = tiny_eagle
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["splitspec"]["kind"] == "eagle"
    assert config["splitspec"]["weights_sha256"] == hashlib.sha256((out / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert [h["step"] for h in info["history"]] == [0, 2, 4]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad, ignore=shutil.ignore_patterns("*.pt"))
    data = bytearray((bad / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (bad / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="does not match config.json's weights_sha256"):
        load_eagle(bad, model, vocab)


@pytest.mark.slow
def test_published_eagle_layout_loads(tiny_eagle, model, vocab, tmp_path):
    """The EAGLE-1 checkpoint layout as published (a `model.` prefix, an input norm on layer
    0 that EAGLE-1 ignores, its own copy of the embeddings, the full LM head, no splitspec
    block): loads, and drafts over the whole vocabulary."""
    import json

    from safetensors.torch import load_file, save_file

    out, _ = tiny_eagle
    tensors = load_file(str(out / WEIGHTS_FILE))
    tensors.pop("splitspec.vocab_ids")
    tensors = {"model." + k: v for k, v in tensors.items()}
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(576, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = model.embed.to(torch.bfloat16)
    published = tmp_path / "published"
    published.mkdir()
    save_file(tensors, str(published / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.pop("splitspec")
    (published / "config.json").write_text(json.dumps(config))
    head = load_eagle(published, model, vocab)
    assert head.token_map is None and head.model.lm_head.shape[0] == 49152
    assert head.model.layers[0].input_norm is None


@pytest.mark.slow
def test_engine_with_eagle_is_exact(tiny_eagle, model, tokenizer, vocab, exactness_prompts):
    prompts = exactness_prompts[1::4]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    off = Engine(model, tokenizer, EngineConfig(max_num_seqs=5, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    eagle = EagleProposer(load_eagle(tiny_eagle[0], model, vocab), vocab, DraftModelConfig(max_num_seqs=5))
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=5, max_model_len=1024), {"eagle": eagle},
                    Controller.static(4, ("eagle",)))
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want
    assert sum(r.stats.drafted for r in results) > 0 and engine.stats.num_resyncs == 0


@pytest.mark.slow
def test_a_tree_holds_each_nodes_top_candidates_and_the_chain(tiny_eagle, model, tokenizer, vocab):
    """With `tree` (3, 2) at k = 3 the proposer drafts 3 + 6 + 6 nodes breadth first; every
    node's children are the top candidates of the head recomputed from scratch over the
    context and that node's path (its own f^ fed back), in order; the first-child chain is
    what a chain request drafts; a sampled request gets the same tree."""
    net, vocab_ids = _reference_net(model, tiny_eagle[0])
    context = load_prompts("chat", tokenizer)[2]
    feats = _features(model, context)[:-1]
    tree = EagleProposer(load_eagle(tiny_eagle[0], model, vocab), vocab, DraftModelConfig(max_k=4, tree=(3, 2)))
    (p,) = tree.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 3, 0.0, feats)])
    assert p.draft_parents.tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8]
    drafts = p.draft_token_ids.tolist()

    @torch.no_grad()
    def top(path: list[int], w: int) -> tuple[list[int], torch.Tensor]:
        ids = list(context) + [drafts[i] for i in path]
        out = _recompute(net, ids, [f for f in feats.float()] + [outs[i] for i in ([-1] + path)[: len(path)]])[-1]
        return [int(vocab_ids[c]) for c in torch.topk(out @ net.head.t(), w).indices], out

    outs: dict[int, torch.Tensor] = {}
    paths = {-1: []}
    for i, parent in enumerate(p.draft_parents.tolist()):
        paths[i] = paths[parent] + [i]
    for node, w in [(-1, 3), (0, 2), (1, 2), (2, 2)] + [(i, 1) for i in range(3, 9)]:
        want, outs[node] = top(paths[node], w)
        assert [drafts[i] for i, q in enumerate(p.draft_parents) if q == node] == want, f"children of {node}"

    chain = EagleProposer(load_eagle(tiny_eagle[0], model, vocab), vocab, DraftModelConfig(max_k=4))
    (c,) = chain.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 3, 0.0, feats)])
    assert c.draft_parents is None and c.draft_token_ids.tolist() == [drafts[0], drafts[3], drafts[9]]
    # A sampled request gets the same tree (its nodes are the top candidates, whatever the
    # temperature), without probabilities: the verifier counts a tree's drafts as one-hot.
    (q,) = tree.propose_sync([ProposalRequest("t", 0, np.asarray(context, np.int32), 3, 0.8, feats)])
    assert q.draft_parents.tolist() == p.draft_parents.tolist() and q.draft_token_ids.tolist() == drafts
    assert q.draft_probs is None


def test_tree_shapes_are_checked():
    with pytest.raises(ValueError, match="exclude each other"):
        DraftModelConfig(tree=(2,), dynamic_tree=2)
    with pytest.raises(ValueError, match="dynamic_tree must be >= 1"):
        DraftModelConfig(dynamic_tree=0)
    with pytest.raises(ValueError, match="each >= 1"):
        DraftModelConfig(tree=(2, 0))
    with pytest.raises(ValueError, match="tree_budget needs dynamic_tree"):
        DraftModelConfig(tree=(2, 1), tree_budget=2)
    with pytest.raises(ValueError, match="tree_budget must be >= 1"):
        DraftModelConfig(dynamic_tree=2, tree_budget=0)


@pytest.mark.slow
def test_engine_with_eagle_trees_is_exact_and_accepts_more(model, tokenizer, vocab, exactness_prompts):
    """The committed head's (3, 2, 1) and dynamic trees: exact, and accepting more than its
    chains (`trees_are_exact_and_accept_more`)."""
    trees_are_exact_and_accept_more(model, tokenizer, exactness_prompts[2::4], "eagle", lambda shape: EagleProposer(
        load_eagle(BUNDLED_EAGLE_DIR, model, vocab), vocab, DraftModelConfig(max_num_seqs=5, **shape)))


def _engine_run(model, tokenizer, source, prompts, params):
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=1024), {"eagle": source},
                    Controller.static(4, ("eagle",)))
    return engine, engine.generate_all(prompts, params)


@pytest.mark.slow
def test_served_eagle_receives_hidden_states_and_accepts_as_in_process(model, tokenizer, vocab):
    """The committed head behind a real gRPC server: `Info` asks for hidden states, the
    engine sends them, and the drafts, hence tokens and acceptance, equal in-process ones."""
    from proposers.server import ProposerServicer, start_server
    from verifier.proposer_client import GrpcProposalSource

    assert (BUNDLED_EAGLE_DIR / "config.json").is_file()
    prompts = load_prompts("chat", tokenizer)[:3]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    config = DraftModelConfig(max_num_seqs=4)
    local = EagleProposer(load_eagle(BUNDLED_EAGLE_DIR, model, vocab), vocab, config)
    _, job = _engine_run(model, tokenizer, local, prompts, params)
    in_process = asyncio.run(job)

    async def served():
        remote = EagleProposer(load_eagle(BUNDLED_EAGLE_DIR, model, vocab), vocab, config)
        server, port = await start_server(ProposerServicer(remote, max_k=config.max_k))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="eagle", deadline_s=30.0, needs_hidden_states=True)
        try:
            info = await client.info()
            engine, job = _engine_run(model, tokenizer, client, prompts, params)
            return info, await job, remote.num_sequences
        finally:
            await client.close()
            await server.stop(0)

    info, results, _ = asyncio.run(served())
    assert info.needs_hidden_states and info.method == "eagle"
    assert [r.token_ids for r in results] == [r.token_ids for r in in_process]
    got = [(r.stats.drafted, r.stats.accepted) for r in results]
    assert got == [(r.stats.drafted, r.stats.accepted) for r in in_process]
    assert sum(a for _, a in got) > 0


def test_training_can_start_from_a_trained_head(tiny_eagle, tiny_draft, model, tokenizer, tmp_path):
    """`init_from`: the new head's fc and layer are the saved head's (as the test's own reader
    loads them), so the continued run's step-0 held-out figures are the saved head's final ones."""
    out, info = tiny_eagle
    ref, vocab_ids = _reference_net(model, out)
    net = EagleNet(model, 29, vocab_ids.astype(np.int32))
    start_from(net, out, model, tokenizer)
    got = dict(net.named_parameters())
    for name, want in ref.named_parameters():
        if name != "layer.input_norm":  # EAGLE-1's layer has no input norm: neither is read
            torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    assert not torch.equal(ref.fc_weight, EagleNet(model, 29, vocab_ids.astype(np.int32)).fc_weight)
    cfg = TrainEagleConfig(**{**dataclasses.asdict(TINY), "init_layers": (29,), "steps": 1, "eval_every": 1,
                              "corpus": str(tiny_draft[0] / "corpus.pt"), "init_from": str(out)})
    again = train_eagle(model, tokenizer, tmp_path, cfg, base="bundled", command="test", log=lambda *a: None)
    assert again["history"][0] == {"step": 0, "held_out_agreement": info["held_out_agreement"],
                                   "held_out_acceptance_length": info["held_out_acceptance_length"]}
