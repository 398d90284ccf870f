"""`splitspec train draft` (proposers/train.py), run in miniature on the real target.

The recipe's pieces are checked against hand computation (vocabulary ranking), against
the target itself (the corpus answers are its greedy tokens) and against a second
implementation (the saved draft run by the inference decoder with a KV cache must give
the logits of the training network, which uses plain causal attention).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from proposers import train
from proposers.draft_model import DraftModelConfig, DraftModelProposer, load_trained_draft
from protos.proposal import ProposalRequest
from verifier.errors import ModelLoadError
from verifier.models.vocab import VocabFingerprint

from tests.proposers.conftest import TINY


def test_vocabulary_subset_is_the_most_frequent_labels_plus_eos():
    # Labels: 5 twice, 7 three times, 9 once; -1 means "no loss here".
    corpus = train.Corpus(train=[([0, 0, 0, 0], [-1, 5, 5, 7]), ([0, 0, 0], [7, 7, 9])], held_out=[], stats={})
    assert train.frequent_ids(corpus, 2, 16, always={2}).tolist() == [2, 7]
    assert train.frequent_ids(corpus, 3, 16, always={2}).tolist() == [2, 5, 7]
    # Ties go to the lower id: 0 and 1 were never labelled, 0 comes first.
    assert train.frequent_ids(corpus, 5, 16, always={2}).tolist() == [0, 2, 5, 7, 9]


def test_greedy_answers_are_the_targets_own_tokens(model, tokenizer):
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in ("Name a colour.", "What is two plus two?", "Say hello in French.")]
    got = train.greedy_answers(model, prompts, set(tokenizer.eos_token_ids), max_tokens=6, batch=2)
    for p, answer in zip(prompts, got):
        want = []
        for _ in range(6):  # one full pass over a fresh cache per token
            ids = p + want
            cache = model.new_cache(1, len(ids))
            logits = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                                   torch.tensor([len(ids) - 1]))
            want.append(int(logits[0].argmax()))
            if want[-1] in tokenizer.eos_token_ids:
                break
        assert answer == want


@pytest.mark.slow
def test_recipe_writes_a_draft_the_proposer_loads(tiny_draft, model, tokenizer):
    out, info = tiny_draft
    config = json.loads((out / train.CONFIG_FILE).read_text())
    meta = config["splitspec"]
    assert meta["weights_sha256"] == hashlib.sha256((out / train.WEIGHTS_FILE).read_bytes()).hexdigest()
    assert meta["tokenizer_fingerprint"]["token_texts_sha256"] == VocabFingerprint.of(tokenizer).token_texts_sha256
    assert config["num_hidden_layers"] == 2 and meta["vocab_subset"] == 600
    assert info["command"] == "splitspec train draft (test)"
    stats = info["corpus"]
    assert stats["prompts"] == 8 and stats["train_sequences"] + stats["held_out_sequences"] >= 8
    assert 0 < stats["answer_tokens"] <= 8 * TINY.max_answer_tokens
    assert [h["step"] for h in info["history"]] == [0, 2, 4]
    assert (out / "checkpoint.pt").is_file() and (out / "corpus.pt").is_file()

    vocab = VocabFingerprint.of(tokenizer)
    draft, token_map = load_trained_draft(out, model, vocab)
    assert token_map.shape == (600,) and np.all(np.diff(token_map) > 0)
    assert set(tokenizer.eos_token_ids) <= set(token_map.tolist())

    # The inference decoder (KV cache, fed in two passes) against the training network
    # (plain causal attention over the whole row), same bf16-rounded weights.
    net = train.DraftNet(model, TINY.init_layers, token_map.astype(np.int32))
    from safetensors.torch import load_file

    saved = load_file(str(out / train.WEIGHTS_FILE))
    with torch.no_grad():
        for i, layer in enumerate(net.layers):
            p = f"model.layers.{i}."
            layer.wqkv.copy_(torch.cat([saved[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float())
            layer.w_gate_up.copy_(torch.cat([saved[p + "mlp.gate_proj.weight"], saved[p + "mlp.up_proj.weight"]]).float())
            layer.wo.copy_(saved[p + "self_attn.o_proj.weight"].float())
            layer.w_down.copy_(saved[p + "mlp.down_proj.weight"].float())
            layer.input_norm.copy_(saved[p + "input_layernorm.weight"].float())
            layer.post_norm.copy_(saved[p + "post_attention_layernorm.weight"].float())
        net.norm.copy_(saved["model.norm.weight"].float())
        ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
        want = net(torch.tensor([ids])) @ net.head.t()
    cache = draft.new_cache(1, len(ids))
    slot = cache.allocate()
    got = torch.cat([draft.forward(torch.tensor(ids[:5]), [slot], [5], cache),
                     draft.forward(torch.tensor(ids[5:]), [slot], [len(ids) - 5], cache)])
    assert got.shape == (len(ids), 600)
    torch.testing.assert_close(got, want[0], atol=2e-3, rtol=1e-3)

    # The proposer drafts target ids: column c of the draft's head is token_map[c].
    proposer = DraftModelProposer(draft, vocab, DraftModelConfig(max_num_seqs=1), token_map=token_map)
    (p,) = proposer.propose_sync([ProposalRequest("s", 0, np.asarray(ids, np.int32), 1, 0.0)])
    assert p.draft_token_ids.tolist() == [int(token_map[int(want[0, -1].argmax())])]


@pytest.mark.slow
def test_a_changed_or_foreign_draft_is_refused(tiny_draft, model, tokenizer, tmp_path):
    import shutil

    out, _ = tiny_draft
    vocab = VocabFingerprint.of(tokenizer)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad, ignore=shutil.ignore_patterns("*.pt"))
    data = bytearray((bad / train.WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (bad / train.WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="does not match config.json's weights_sha256"):
        load_trained_draft(bad, model, vocab)
    texts = list(vocab.token_texts)
    texts[255], texts[260] = texts[260], texts[255]
    other = VocabFingerprint(vocab.vocab_type, vocab.vocab_size, vocab.bos_token_id, vocab.eos_token_ids, tuple(texts))
    with pytest.raises(ModelLoadError, match="trained for another vocabulary"):
        load_trained_draft(out, model, other)


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(tiny_draft, model, tokenizer, tmp_path):
    import shutil

    out, _ = tiny_draft
    again = tmp_path / "again"
    shutil.copytree(out, again)
    more = train.TrainDraftConfig(**{**TINY.__dict__, "steps": 6})
    lines: list[str] = []
    info = train.train_draft(model, tokenizer, again, more, base="bundled", command="c", resume=True,
                             log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any(line.startswith("corpus: reused") for line in lines)
    assert any(line == "resumed at step 4" for line in lines)
    assert [h["step"] for h in info["history"]] == [0, 2, 4, 6]
