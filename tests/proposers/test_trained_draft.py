"""The draft trained for the bundled model and committed under proposers/assets/.

Its drafts are checked against HF transformers running the same weights (an independent
Llama implementation), the engine's greedy output with it against plain decoding, and the
vocabulary check must accept it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cluster.local import check_vocabularies
from cluster.workloads import load_prompts
from protos.proposal import ProposalRequest
from proposers.registry import build_proposer
from proposers.train import BUNDLED_DRAFT_DIR, CONFIG_FILE, WEIGHTS_FILE
from tests.proposers.tree_check import trees_are_exact_and_accept_more
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.models.vocab import VocabFingerprint, incompatibility
from verifier.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def draft():
    return build_proposer("draft", {"max_num_seqs": 8, "max_k": 4})


def test_committed_draft_is_small_and_its_vocabulary_is_accepted(draft, tokenizer):
    assert (BUNDLED_DRAFT_DIR / WEIGHTS_FILE).stat().st_size <= 30 * 2**20
    assert incompatibility(VocabFingerprint.of(tokenizer), draft.vocab) is None
    check_vocabularies(tokenizer, {"draft": draft})  # raises on a mismatch


def _hf_draft(hf_model):
    """The committed draft as an HF `LlamaForCausalLM` with the target's embeddings (as
    HF dequantised them from the GGUF), and its LM-head subset."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    meta = json.loads((BUNDLED_DRAFT_DIR / CONFIG_FILE).read_text())
    meta.pop("splitspec")
    meta.pop("torch_dtype", None)
    hf = LlamaForCausalLM(LlamaConfig(**meta)).eval()
    state = {k: v.float() for k, v in load_file(str(BUNDLED_DRAFT_DIR / WEIGHTS_FILE)).items()}
    vocab_ids = state.pop("splitspec.vocab_ids").long()
    state["model.embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach().float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf, vocab_ids


def test_drafts_equal_hf_transformers_on_the_same_weights(draft, hf_model, tokenizer):
    hf, vocab_ids = _hf_draft(hf_model)
    for i, prompt in enumerate(load_prompts("chat", tokenizer)[:3]):
        want: list[int] = []
        with torch.no_grad():
            for _ in range(4):  # greedy over the head's subset, whole context each time
                logits = hf(torch.tensor([prompt + want])).logits[0, -1]
                want.append(int(vocab_ids[int(logits[vocab_ids].argmax())]))
        (p,) = draft.propose_sync([ProposalRequest(f"hf{i}", 0, np.asarray(prompt, np.int32), 4, 0.0)])
        assert p.draft_token_ids.tolist() == want
        draft.release([f"hf{i}"])


def test_engine_with_the_trained_draft_is_exact_and_accepts(model, tokenizer, draft, exactness_prompts):
    prompts = exactness_prompts[::3]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    off = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=1024), {"draft": draft},
                    Controller.static(4, ("draft",)))
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    # The untrained start (target layers 0, 1, 29) agrees with the target on 0.02% of
    # held-out tokens (train_info.json, step 0); the trained draft accepts ~10% of drafts.
    assert drafted > 0 and accepted / drafted > 0.03, (accepted, drafted)


def test_a_draft_tree_holds_each_nodes_top_candidates_as_hf_computes(hf_model, tokenizer):
    """With `tree` (3, 2) at k = 3 the draft drafts 3 + 6 + 6 nodes breadth first, and the
    children of every node are the top candidates (over the draft's vocabulary subset, in
    order) of HF transformers running the same weights over the context and that node's
    path, whole each time; a second round on the same sequence drafts from the context
    again (the tree's cache rows were rolled back), as a fresh sequence does."""
    hf, vocab_ids = _hf_draft(hf_model)
    tree = build_proposer("draft", {"max_num_seqs": 2, "max_k": 4, "tree": [3, 2]})
    context = load_prompts("chat", tokenizer)[1]
    (p,) = tree.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 3, 0.0)])
    assert p.draft_parents.tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8]
    drafts = p.draft_token_ids.tolist()
    paths = {-1: []}
    for i, parent in enumerate(p.draft_parents.tolist()):
        paths[i] = paths[parent] + [i]
    for node, w in [(-1, 3), (0, 2), (1, 2), (2, 2)] + [(i, 1) for i in range(3, 9)]:
        with torch.no_grad():
            logits = hf(torch.tensor([context + [drafts[i] for i in paths[node]]])).logits[0, -1]
        want = [int(vocab_ids[c]) for c in torch.topk(logits[vocab_ids], w).indices]
        assert [drafts[i] for i, q in enumerate(p.draft_parents) if q == node] == want, f"children of {node}"
    # Next round: the verifier accepted the first child of the root and emitted a bonus token.
    grown = context + [drafts[0], drafts[3]]
    (again,) = tree.propose_sync([ProposalRequest("s", len(context), np.asarray(grown[len(context):], np.int32),
                                                  3, 0.0)])
    (fresh,) = tree.propose_sync([ProposalRequest("t", 0, np.asarray(grown, np.int32), 3, 0.0)])
    assert again.draft_token_ids.tolist() == fresh.draft_token_ids.tolist()
    assert again.draft_parents.tolist() == fresh.draft_parents.tolist()


def test_engine_with_draft_trees_is_exact_and_accepts_more(model, tokenizer, exactness_prompts):
    """The committed draft's (3, 2, 1) and dynamic trees: exact, and accepting more than its
    chains (`trees_are_exact_and_accept_more`)."""
    trees_are_exact_and_accept_more(model, tokenizer, exactness_prompts[1::4], "draft",
                                    lambda shape: build_proposer("draft", {"max_num_seqs": 5, **shape}))

def test_a_dynamic_tree_keeps_the_most_likely_paths_as_hf_computes(hf_model, tokenizer):
    """With `dynamic_tree` 3 at k = 3 each depth holds the 3 paths, among the best 3
    children of every node of the depth before, with the highest sum of the draft's
    log-probabilities (over its vocabulary subset), as HF transformers computes them on
    the same weights over each path whole; nodes are listed breadth first, grouped by
    parent in the depth's order, siblings best first. With `tree_budget` the most likely
    of those nodes stay."""
    hf, vocab_ids = _hf_draft(hf_model)
    B = 3
    proposer = build_proposer("draft", {"max_num_seqs": 1, "max_k": 4, "dynamic_tree": B})
    context = load_prompts("chat", tokenizer)[3]
    (p,) = proposer.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 3, 0.0)])

    @torch.no_grad()
    def best(path: list[int]) -> list[tuple[float, int]]:  # the B best (log-prob, id) after context + path
        logp = torch.log_softmax(hf(torch.tensor([context + path])).logits[0, -1][vocab_ids].double(), dim=-1)
        top = torch.topk(logp, B)
        return [(float(v), int(vocab_ids[i])) for v, i in zip(top.values, top.indices)]

    want_ids, want_parents, want_scores = [], [], []
    depth = [(-1, [], 0.0)]  # (node index, path of ids, path log-prob)
    for _ in range(3):
        offers = [(score + lp, parent_pos, rank, token)
                  for parent_pos, (_, path, score) in enumerate(depth)
                  for rank, (lp, token) in enumerate(best(path))]
        kept = sorted(sorted(offers, reverse=True)[:B], key=lambda o: (o[1], o[2]))
        nxt = []
        for score, parent_pos, _, token in kept:
            node, path, _ = depth[parent_pos]
            nxt.append((len(want_ids), path + [token], score))
            want_ids.append(token)
            want_parents.append(node)
            want_scores.append(score)
        depth = nxt
    assert p.draft_token_ids.tolist() == want_ids
    assert p.draft_parents.tolist() == want_parents

    # EAGLE-2's rerank, `tree_budget` 5: of those 9 nodes, the 5 of the highest path
    # log-probability, in the same order, parents renumbered among them.
    order = sorted(range(len(want_ids)), key=lambda i: -want_scores[i])
    assert want_scores[order[4]] - want_scores[order[5]] > 1e-3, want_scores  # no near tie decides it
    kept = sorted(order[:5])
    budgeted = build_proposer("draft", {"max_num_seqs": 1, "max_k": 4, "dynamic_tree": B, "tree_budget": 5})
    (r,) = budgeted.propose_sync([ProposalRequest("s", 0, np.asarray(context, np.int32), 3, 0.0)])
    assert r.draft_token_ids.tolist() == [want_ids[i] for i in kept]
    assert r.draft_parents.tolist() == [-1 if want_parents[i] < 0 else kept.index(want_parents[i]) for i in kept]
