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


def reference_answers(model, prompts, eos_ids, max_tokens):
    """Greedy answers the slow, independent way: one full pass over a fresh cache per token."""
    answers = []
    for p in prompts:
        want = []
        for _ in range(max_tokens):
            ids = p + want
            cache = model.new_cache(1, len(ids))
            logits = model.forward(torch.tensor(ids), [cache.allocate()], [len(ids)], cache,
                                   torch.tensor([len(ids) - 1]))
            want.append(int(logits[0].argmax()))
            if want[-1] in eos_ids:
                break
        answers.append(want)
    return answers


ANSWER_PROMPTS = ("Name a colour.", "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
                  "Say hello in French.", "Count from one to ten in words.")


def chat_prompts(tokenizer, texts):
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in texts]


def test_engine_answers_are_the_targets_own_tokens(model, tokenizer):
    """Four prompts over two slots (two wait, then take the freed slots), drafting with
    n-gram k = 3 every round: each answer is the target's greedy tokens, EOS kept."""
    from verifier.controller import Controller

    prompts = chat_prompts(tokenizer, ANSWER_PROMPTS)
    controller = Controller.static(3, ("ngram",))
    engine = train.answer_engine(model, tokenizer, batch=2, max_model_len=128, max_waiting=4, controller=controller)
    got = train.engine_answers(engine, prompts, max_tokens=16)
    assert got == reference_answers(model, prompts, set(tokenizer.eos_token_ids), 16)
    assert controller.decisions["static"] > 0  # rounds that asked for drafts


def test_answer_cache_serves_prefixes_of_its_answers_and_only_for_its_model(tmp_path):
    path = tmp_path / "answers.jsonl.gz"
    cache = train.AnswerCache(path, "model-a", eos_ids=[2])
    cache.put([1, 5, 6], 5, [10, 11, 12, 13, 14])  # stopped by max_tokens 5
    cache.put([1, 7], 10, [7, 8, 2])  # ended at EOS 2
    cache.save()
    first = path.read_bytes()
    cache.save()
    assert path.read_bytes() == first  # no timestamp: the same entries give the same bytes

    again = train.AnswerCache(path, "model-a", eos_ids=[2])
    assert len(again) == 2
    assert again.get([1, 5, 6], 3) == [10, 11, 12]  # greedy: the answer at 3 is the first 3 at 5
    assert again.get([1, 5, 6], 5) == [10, 11, 12, 13, 14]
    assert again.get([1, 5, 6], 6) is None  # it was cut at 5, the 6th token is unknown
    assert again.get([1, 7], 50) == [7, 8, 2]  # finished: serves any length
    assert again.get([1, 7], 2) == [7, 8]
    assert again.get([1, 5], 3) is None  # another prompt
    # A shorter answer never replaces a longer one for the same prompt; a longer one does.
    again.put([1, 5, 6], 2, [10, 11])
    assert again.get([1, 5, 6], 5) == [10, 11, 12, 13, 14]
    again.put([1, 5, 6], 8, [10, 11, 12, 13, 14, 15, 16, 17])
    assert again.get([1, 5, 6], 6) == [10, 11, 12, 13, 14, 15]

    other = train.AnswerCache(path, "model-b", eos_ids=[2])
    assert len(other) == 0 and other.get([1, 7], 3) is None  # written for another model: ignored


def test_cached_answers_are_generated_once_then_read(model, tokenizer, tmp_path):
    from verifier.controller import Controller

    prompts = chat_prompts(tokenizer, ANSWER_PROMPTS)
    eos = set(tokenizer.eos_token_ids)
    path = tmp_path / "answers.jsonl.gz"
    want = reference_answers(model, prompts, eos, 6)
    off = Controller.off()

    got, hits = train.cached_greedy_answers(model, tokenizer, prompts[:3], 6, 2, train.AnswerCache(path, "m", eos),
                                            controller=off)
    assert (got, hits) == (want[:3], 0)
    # Read back from the file alone: no model at all is needed for what it holds.
    got, hits = train.cached_greedy_answers(None, None, prompts[:3], 4, 2, train.AnswerCache(path, "m", eos))
    assert (got, hits) == ([a[:4] for a in want[:3]], 3)
    # One new prompt: three read, one generated and added to the file.
    got, hits = train.cached_greedy_answers(model, tokenizer, prompts, 6, 2, train.AnswerCache(path, "m", eos),
                                            controller=off)
    assert (got, hits) == (want, 3)
    assert len(train.AnswerCache(path, "m", eos)) == 4


def test_train_cli_switches_the_answer_cache(capsys):
    from cluster.cli import build_parser, main

    assert build_parser().parse_args(["train", "draft"]).answer_cache is None  # the recipe's default: on
    assert build_parser().parse_args(["train", "eagle", "--no-answer-cache"]).answer_cache is False
    # `train answers` takes only the fields that shape the answers, and checks them first.
    assert build_parser().parse_args(["train", "answers", "--num-prompts", "948"]).num_prompts == 948
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "answers", "--steps", "5"])
    capsys.readouterr()
    assert main(["train", "answers", "--num-prompts", "-1"]) == 2
    assert "num_prompts must be >= 0, got -1" in capsys.readouterr().err
    assert train.TrainDraftConfig().answer_cache is True
    cfg = train.TrainDraftConfig(answer_cache=False)
    assert train.bundled_answer_cache("bundled", cfg, [2]) is None
    assert train.bundled_answer_cache("other.gguf", train.TrainDraftConfig(), [2]) is None
    cache = train.bundled_answer_cache("bundled", train.TrainDraftConfig(), [2])
    assert cache.path == train.ANSWERS_PATH and cache.model_id.startswith("bundled:")


def _saved_layer(saved: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i of a saved draft (HF names, as the test reads them) under the training
    network's parameter names, float32."""
    p = f"model.layers.{i}."
    return {k: v.float() for k, v in {
        "wqkv": torch.cat([saved[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "w_gate_up": torch.cat([saved[p + "mlp.gate_proj.weight"], saved[p + "mlp.up_proj.weight"]]),
        "wo": saved[p + "self_attn.o_proj.weight"], "w_down": saved[p + "mlp.down_proj.weight"],
        "input_norm": saved[p + "input_layernorm.weight"], "post_norm": saved[p + "post_attention_layernorm.weight"],
    }.items()}


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
            for name, value in _saved_layer(saved, i).items():
                getattr(layer, name).copy_(value)
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


@pytest.mark.slow
def test_distilling_the_top_one_token_is_training_on_the_targets_token(tiny_draft, model, tokenizer, tmp_path):
    """`distil_top = 1`: the soft label of a position is all its mass on the target's most
    likely subset token, which is the corpus's label (its greedy token), so training is the
    hard-label run's, step for step (same held-out figures); with K = 8 it is not. The soft
    labels are saved and a resumed run reuses them."""
    import dataclasses

    corpus = tiny_draft[0] / "corpus.pt"
    runs = {}
    for k in (0, 1, 8):
        out = tmp_path / f"k{k}"
        out.mkdir()
        (out / "corpus.pt").write_bytes(corpus.read_bytes())
        cfg = dataclasses.replace(TINY, distil_top=k)
        runs[k] = train.train_draft(model, tokenizer, out, cfg, base="bundled", command="test", resume=True,
                                    log=lambda *a: None)
    hard, one, eight = ([h.get("loss") for h in runs[k]["history"]] for k in (0, 1, 8))
    np.testing.assert_allclose(one[1:], hard[1:], rtol=1e-3)
    assert [h["held_out_agreement"] for h in runs[1]["history"]] == [h["held_out_agreement"]
                                                                      for h in runs[0]["history"]]
    assert eight[1:] != pytest.approx(hard[1:], rel=1e-3)
    saved = torch.load(tmp_path / "k8" / "soft_labels.pt", weights_only=False)
    assert saved["k"] == 8 and saved["labels"][0][0].shape[1] == 8
    logs = []
    (tmp_path / "k8" / "checkpoint.pt").unlink()
    train.train_draft(model, tokenizer, tmp_path / "k8", dataclasses.replace(TINY, distil_top=8), base="bundled",
                      command="test", resume=True, log=logs.append)
    assert "soft labels: reused soft_labels.pt" in logs


@pytest.mark.slow
def test_training_can_start_from_a_trained_draft(tiny_draft, model, tokenizer, tmp_path):
    """`init_from`: the new draft's layers and final norm are the saved draft's tensors (read
    here straight from its safetensors), so the continued run's step-0 held-out agreement is
    the saved draft's final one; a draft of another depth is refused."""
    import dataclasses

    from safetensors.torch import load_file

    out, info = tiny_draft
    saved = load_file(str(out / train.WEIGHTS_FILE))
    net = train.DraftNet(model, TINY.init_layers, saved["splitspec.vocab_ids"].numpy())
    with torch.no_grad():  # so that a tensor left uncopied shows (a few steps barely move the norms)
        for value in net.parameters():
            value.zero_()
    train.start_draft_from(net, out, model, tokenizer)
    for i, layer in enumerate(net.layers):
        for name, value in _saved_layer(saved, i).items():
            torch.testing.assert_close(getattr(layer, name), value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(net.norm, saved["model.norm.weight"].float(), rtol=0, atol=0)

    again = tmp_path / "again"
    again.mkdir()
    (again / "corpus.pt").write_bytes((out / "corpus.pt").read_bytes())
    cfg = dataclasses.replace(TINY, steps=1, eval_every=1, init_from=str(out))
    more = train.train_draft(model, tokenizer, again, cfg, base="bundled", command="test", resume=True,
                             log=lambda *a: None)
    assert more["history"][0] == {"step": 0, "held_out_agreement": info["held_out_agreement"]}
    deeper = train.DraftNet(model, (*TINY.init_layers, 5), saved["splitspec.vocab_ids"].numpy())
    with pytest.raises(ValueError, match=f"a draft of {len(TINY.init_layers)} layers cannot start one of"):
        train.start_draft_from(deeper, out, model, tokenizer)


def test_distil_top_is_checked():
    with pytest.raises(ValueError, match="distil_top"):
        train.TrainDraftConfig(distil_top=-1)
    with pytest.raises(ValueError, match="distil_top"):
        train.TrainDraftConfig(vocab_subset=16, distil_top=17)
