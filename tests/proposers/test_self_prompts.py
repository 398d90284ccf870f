"""`splitspec train prompts`: chat prompts the target writes itself (Magpie), for the recipes.

The prompt header is checked against SmolLM2's chat template written out by hand, the
filter against hand-made samples, the benchmark guard against the benchmark's own prompts
and hand-picked neighbours, and the written file against the recipe that reads it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from proposers import train
from cluster.workloads import load_conversations

#: SmolLM2-Instruct's chat template up to a user's message: its default system turn, then
#: the user turn's header (from the model card's template, written out by hand).
SMOLLM2_USER_HEADER = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                       "<|im_end|>\n<|im_start|>user\n")


def test_the_target_continues_the_user_turn_header(tokenizer):
    assert tokenizer.decode(train.user_turn_prefix(tokenizer)) == SMOLLM2_USER_HEADER
    # A prompt rendered with the template starts with those very ids.
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi there."}]))
    header = train.user_turn_prefix(tokenizer)
    assert prompt[: len(header)] == header


def test_the_guard_flags_every_benchmark_prompt_and_its_topics_only():
    near = train.benchmark_guard()
    for workload in ("chat", "summarize", "code_edit"):
        for conv in load_conversations(workload):
            assert near(conv[0]["content"]), conv[0]["content"][:60]
    # On a chat prompt's topic (two of its topic words, or its only one, plurals folded).
    assert near("Tell me about the arms of an octopus.")  # "Tell me a fun fact about octopuses."
    assert near("What are the rules for castling in chess?")  # "... the rules of chess ..."
    assert near("Which capital cities in France are the oldest?")  # "What is the capital of France?"
    assert near("Why is the sky so blue at noon?")
    # Quoting eight words of a summarize passage or a code_edit function.
    passage = load_conversations("summarize")[0][0]["content"].split()
    assert near("Please rewrite this: " + " ".join(passage[-12:]))
    # Elsewhere: one topic word of two, or another topic.
    assert not near("How can I improve my chess game?")
    assert not near("Write a short poem about rivers.")
    assert not near("Can you find a place to eat in Tokyo?")
    assert not near("Can you provide a Python function to filter out duplicates from a list?")


def test_kept_prompts_are_finished_long_enough_new_and_off_the_benchmark(tokenizer):
    eos = sorted(tokenizer.eos_token_ids)[0]
    enc = tokenizer.encode
    samples = [
        enc("How do I fix a flat bicycle tyre?") + [eos],          # kept
        enc("Plan a three-day trip to Lisbon for me") ,            # no EOS: unfinished
        enc("Hello there") + [eos],                                # two words: short
        enc("how do I fix a flat bicycle tyre") + [eos],           # same words: duplicate
        enc("Tell me a fun fact about octopuses.") + [eos],        # a benchmark prompt
        enc("  What makes sourdough bread rise?  ") + [eos],       # kept, stripped
        [],                                                        # nothing: unfinished
    ]
    kept, counts = train.select_self_prompts(samples, tokenizer, train.benchmark_guard())
    assert kept == ["How do I fix a flat bicycle tyre?", "What makes sourdough bread rise?"]
    assert counts == {"unfinished": 2, "short": 1, "duplicate": 1, "near_benchmark": 1}


def test_self_prompts_are_sampled_reproducibly_and_read_by_the_recipe(model, tokenizer, tmp_path, monkeypatch):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    kw = dict(num=10, batch=4, max_tokens=40, log=lambda *x: None)
    info = train.write_self_prompts(model, tokenizer, seed=0, path=a, **kw)
    assert info["sampled"] == 10
    assert info["kept"] + info["unfinished"] + info["short"] + info["duplicate"] + info["near_benchmark"] == 10
    assert info["kept"] >= 3  # about 3 in 4 end within 64 tokens; 10 samples, 40 tokens
    lines = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(lines) == info["kept"]
    near = train.benchmark_guard()
    texts = [line["messages"][0]["content"] for line in lines]
    assert all(line["messages"][0]["role"] == "user" and len(t.split()) >= 3 and not near(t)
               for line, t in zip(lines, texts))
    assert len(set(texts)) == len(texts)
    # Request i samples with seed SEED + i: the same seed writes nearly the same prompts (the
    # engine's n-gram controller sizes passes by measured step times, and float rounding of
    # another pass size can flip a sampled token), another seed others.
    train.write_self_prompts(model, tokenizer, seed=0, path=b, **kw)
    train.write_self_prompts(model, tokenizer, seed=100, path=c, **{**kw, "num": 4})  # 4 suffice to differ
    again = set(b.read_text().splitlines())
    other = set(c.read_text().splitlines())
    assert 2 * len(again & set(a.read_text().splitlines())) >= len(texts)
    assert len(other & set(a.read_text().splitlines())) <= 1

    # The recipe appends them, chat template applied, after the prompt set and the stdlib prompts.
    monkeypatch.setattr(train, "SELF_PROMPTS_PATH", a)
    cfg = train.TrainDraftConfig(num_prompts=2, num_docstring_prompts=1, num_function_prompts=0)
    without = train.recipe_prompts(tokenizer, cfg, np.random.default_rng(0))
    with_self = train.recipe_prompts(tokenizer, train.TrainDraftConfig(
        num_prompts=2, num_docstring_prompts=1, num_function_prompts=0, self_prompts=True), np.random.default_rng(0))
    assert with_self[: len(without)] == without
    assert with_self[len(without):] == [
        tokenizer.encode(SMOLLM2_USER_HEADER + t + "<|im_end|>\n<|im_start|>assistant\n") for t in texts]
    monkeypatch.setattr(train, "SELF_PROMPTS_PATH", tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="self_prompts: missing.jsonl is missing"):
        train.recipe_prompts(tokenizer, train.TrainDraftConfig(self_prompts=True), np.random.default_rng(0))


def test_train_prompts_cli_names_a_bad_flag(capsys):
    from cluster.cli import build_parser, main

    args = build_parser().parse_args(["train", "prompts"])
    assert (args.num, args.seed, args.max_tokens, args.temperature, args.top_p) == (2600, 0, 64, 1.0, 0.95)
    for argv, flag in ((["--num", "0"], "num"), (["--max-tokens", "-3"], "max-tokens"),
                       (["--temperature", "0"], "temperature"), (["--top-p", "1.5"], "top-p")):
        assert main(["train", "prompts", *argv]) == 2
        assert flag in capsys.readouterr().err
    # The recipes and `train answers` take the self-written prompts with --self-prompts.
    assert build_parser().parse_args(["train", "answers", "--self-prompts"]).self_prompts is True
    assert build_parser().parse_args(["train", "eagle", "--self-prompts"]).self_prompts is True
    assert train.TrainDraftConfig().self_prompts is False


def test_the_repo_holds_the_targets_answers_to_its_self_written_prompts(model, tokenizer):
    from tests.proposers.test_train import reference_answers

    convs = train.load_prompt_set(train.SELF_PROMPTS_PATH)
    assert len(convs) >= 2000
    near = train.benchmark_guard()
    assert not any(near(c[0]["content"]) for c in convs)
    cache = train.bundled_answer_cache("bundled", train.TrainDraftConfig(), tokenizer.eos_token_ids)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in convs]
    assert all(cache.get(p, 128) is not None for p in prompts)
    # Spot checks against greedy decoding done the slow way (a full pass per token).
    picks = [prompts[0], prompts[len(prompts) // 2], prompts[-1]]
    want = reference_answers(model, picks, set(tokenizer.eos_token_ids), 10)
    assert [cache.get(p, 10) for p in picks] == want
