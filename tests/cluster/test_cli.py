"""The `splitspec` command line, run as a user runs it (a subprocess, the real model)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

CODE_PROMPT = "Add type hints. Reply with the full code only.\n\n```\ndef scale(values, factor):\n    return [v * factor for v in values]\n```"


def splitspec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def ngram_json():
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "ngram",
                     "--k", "4", "--logprobs", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_json_shape_and_stats(ngram_json, tokenizer):
    out = ngram_json
    assert {"text", "token_ids", "stats"} <= out.keys()
    stats = out["stats"]
    assert {"rounds", "drafted", "accepted", "mean_acceptance_length", "tokens_per_second"} <= stats.keys()
    assert 0 < len(out["token_ids"]) <= 40
    body = [t for t in out["token_ids"] if t not in tokenizer.eos_token_ids]
    assert out["text"] == tokenizer.decode(body, skip_special_tokens=True)
    assert stats["accepted"] <= stats["drafted"]
    assert stats["accepted"] > 0, "the answer quotes the prompt, so n-gram drafts must be accepted"
    assert stats["mean_acceptance_length"] > 1.0
    assert stats["tokens_per_second"] > 0
    # --logprobs 2: per token its own and the 2 most likely tokens', the chosen one first (greedy).
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    for e in out["logprobs"]:
        assert e["token"] == tokenizer.token_text(e["token_id"]) and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] >= e["top_logprobs"][1]["logprob"]


def test_generate_speculation_off_gives_the_same_tokens(ngram_json):
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "off",
                     "--json")
    assert proc.returncode == 0, proc.stderr
    off = json.loads(proc.stdout)
    assert off["token_ids"] == ngram_json["token_ids"]
    assert off["stats"]["drafted"] == 0 and off["stats"]["mean_acceptance_length"] == 1.0


def test_generate_with_eagle_trees_gives_the_same_tokens(ngram_json):
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "eagle",
                     "--k", "3", "--tree", "3,2,1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ngram_json["token_ids"] and out["tree"] == [3, 2, 1]
    # Depth 3 of a (3, 2, 1) tree: 3 + 6 + 6 drafts a round, at most 3 of them accepted.
    stats = out["stats"]
    assert stats["drafted"] <= 15 * stats["rounds_with_drafts"] and stats["accepted"] <= 3 * stats["rounds_with_drafts"]
    assert stats["drafted"] > 3 * stats["rounds_with_drafts"] and stats["mean_acceptance_length"] > 1.0


def test_generate_with_dynamic_draft_trees_gives_the_same_tokens(ngram_json):
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "draft",
                     "--k", "3", "--dynamic-tree", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ngram_json["token_ids"] and out["dynamic_tree"] == 4 and out["tree"] is None
    # Depth 3 of a dynamic tree of 4 nodes a depth: 12 drafts a round, at most 3 of them accepted.
    stats = out["stats"]
    assert stats["drafted"] <= 12 * stats["rounds_with_drafts"] and stats["accepted"] <= 3 * stats["rounds_with_drafts"]
    assert stats["drafted"] > 3 * stats["rounds_with_drafts"] and stats["mean_acceptance_length"] > 1.0


def test_generate_with_reranked_dynamic_trees_gives_the_same_tokens(ngram_json):
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "draft",
                     "--k", "4", "--dynamic-tree", "3", "--tree-budget", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ngram_json["token_ids"] and out["tree_budget"] == 5
    # Trees of 3 nodes a depth to depth 4 (12 nodes), reranked to 5: at most 5 drafts a round.
    stats = out["stats"]
    assert stats["drafted"] <= 5 * stats["rounds_with_drafts"] and stats["accepted"] <= 4 * stats["rounds_with_drafts"]
    assert stats["drafted"] > 4 * stats["rounds_with_drafts"] and stats["mean_acceptance_length"] > 1.0


def test_generate_with_an_eagle_fallback_gives_the_same_tokens(ngram_json):
    # The answer's first words quote nothing of the prompt: n-gram has no match there, the head drafts.
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--speculation", "ngram",
                     "--fallback", "eagle", "--k", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ngram_json["token_ids"] and out["fallback"] == "eagle"
    assert out["stats"]["rounds_by_method"].get("eagle", 0) > 0, out["stats"]
    assert out["stats"]["rounds_with_drafts"] > ngram_json["stats"]["rounds_with_drafts"], (out["stats"],
                                                                                             ngram_json["stats"])
    assert out["stats"]["rounds"] < ngram_json["stats"]["rounds"], (out["stats"], ngram_json["stats"])


def test_generate_stops_at_a_stop_token_id_or_right_after_an_included_stop_string(ngram_json):
    """vLLM's stop_token_ids and include_stop_str_in_output from the command line: the
    reference is the same request without them (`ngram_json`), cut by hand."""
    ref_ids, ref_text = ngram_json["token_ids"], ngram_json["text"]
    stop_id = ref_ids[8]
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--stop-token-id",
                     str(stop_id), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == ref_ids[: ref_ids.index(stop_id) + 1] and out["finish_reason"] == "stop"
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40", "--stop", "factor",
                     "--include-stop-str", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == ref_text[: ref_text.index("factor") + len("factor")] and out["finish_reason"] == "stop"


def test_generate_truncates_the_prompt_and_keeps_to_allowed_tokens_without_bad_words(tokenizer):
    """The prompt's last 3 tokens only (" of France is"); the output only from " Paris",
    " the", " a" and ".", never " Paris" (a bad word), 6 tokens since EOS is not allowed."""
    prompt = "The capital of France is"
    allowed = {tokenizer.encode(w)[0] for w in (" Paris", " the", " a", ".")}
    assert len(allowed) == 4 and all(len(tokenizer.encode(w)) == 1 for w in (" Paris", " the", " a", "."))
    ids = [a for w in allowed for a in ("--allowed-token-id", str(w))]
    proc = splitspec("generate", "--prompt", prompt, "--max-tokens", "6", "--ignore-eos", "--truncate-prompt-tokens",
                     "3", *ids, "--bad-word", " Paris", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"] == tokenizer.encode(prompt)[-3:]
    assert len(out["token_ids"]) == 6 and set(out["token_ids"]) <= allowed - set(tokenizer.encode(" Paris"))


def test_generate_with_a_chat_template_of_its_own(tmp_path, model, tokenizer):
    """--chat-template FILE: the prompt is the conversation as that template writes it
    (here by hand: the content upper-cased, no system turn), and the output plain
    decoding's from it."""
    from verifier.controller import Controller
    from verifier.engine import Engine, EngineConfig
    from verifier.sampling_params import SamplingParams

    template = tmp_path / "upper.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    proc = splitspec("generate", "--prompt", "What is 2+2?", "--chat", "--chat-template", str(template),
                     "--max-tokens", "8", "--speculation", "off", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    want = tokenizer.encode("<|im_start|>user\nWHAT IS 2+2?<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    assert out["prompt_token_ids"] == want
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=512), None, Controller.off())
    (plain,) = engine.generate_sync([want], SamplingParams(max_tokens=8, temperature=0.0))
    assert out["token_ids"] == plain.token_ids


def test_generate_writes_compact_json_and_the_prompts_logprobs(tokenizer):
    """--json-object --disable-any-whitespace: no whitespace outside the JSON's strings;
    --prompt-logprobs 1: one entry per prompt token (the first's logprob null), each with
    its rank and the most likely token's."""
    proc = splitspec("generate", "--prompt", "Reply with JSON: Alice is 34 and lives in Lyon.", "--chat",
                     "--max-tokens", "32", "--json-object", "--disable-any-whitespace", "--prompt-logprobs", "1",
                     "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    text = out["text"]
    assert text.startswith("{") and not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"?', "", text)), text
    entries = out["prompt_logprobs"]
    assert [e["token_id"] for e in entries] == out["prompt_token_ids"]
    assert entries[0]["logprob"] is None and entries[0]["rank"] is None and entries[0]["top_logprobs"] == []
    for e in entries[1:]:
        assert e["logprob"] <= 0 and e["rank"] >= 1 and e["token"] == tokenizer.token_text(e["token_id"])
        (top,) = e["top_logprobs"]
        assert top["rank"] == 1 and top["logprob"] >= e["logprob"]
        assert (top["token_id"] == e["token_id"]) == (e["rank"] == 1)


def test_generate_streams_text_then_a_summary(ngram_json):
    proc = splitspec("generate", "--prompt", CODE_PROMPT, "--chat", "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    *text, summary = proc.stdout.rstrip("\n").split("\n")
    assert "\n".join(text) == ngram_json["text"]
    assert summary.startswith(f"[{len(ngram_json['token_ids'])} tokens") and "mean acceptance length" in summary


@pytest.mark.parametrize(
    "args, field",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", ""], "prompt"),
        (["--prompt", "hi", "--k", "-2"], "k"),
        (["--prompt", "hi", "--tree", "3,2"], "tree"),  # n-gram: no trees
        (["--prompt", "hi", "--speculation", "eagle", "--tree", "3,0"], "tree"),
        (["--prompt", "hi", "--dynamic-tree", "4"], "dynamic_tree"),  # n-gram: no trees
        (["--prompt", "hi", "--speculation", "draft", "--dynamic-tree", "0"], "dynamic_tree"),
        (["--prompt", "hi", "--speculation", "draft", "--dynamic-tree", "2", "--tree", "2,1"], "tree"),
        (["--prompt", "hi", "--speculation", "draft", "--tree-budget", "4"], "tree_budget"),
        (["--prompt", "hi", "--speculation", "eagle", "--dynamic-tree", "2", "--tree-budget", "0"], "tree_budget"),
        (["--prompt", "hi", "--fallback", "ngram"], "fallback"),  # n-gram already
        (["--prompt", "hi", "--speculation", "off", "--fallback", "eagle"], "fallback"),
        (["--prompt", "hi", "--k", "0", "--fallback", "eagle"], "fallback"),
        (["--prompt", "hi", "--speculation", "eagle", "--fallback", "ngram", "--tree", "2,1"], "tree"),  # n-gram's
        (["--prompt", "hi", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
        (["--prompt", "hi", "--json", "--logprobs", "21"], "logprobs"),
        (["--prompt", "hi", "--logprobs", "1"], "logprobs"),  # printed with --json only
        (["--prompt", "hi", "--presence-penalty", "3"], "presence_penalty"),
        (["--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
        (["--prompt", "hi", "--logit-bias", "198"], "logit_bias"),
        (["--prompt", "hi", "--max-tokens", "4", "--min-tokens", "5"], "min_tokens"),
        (["--prompt", "hi", "--grammar", "@no-such-file.lark"], "grammar"),
        (["--prompt", "hi", "--json-schema", "{not json"], "json_schema"),
        (["--prompt", "hi", "--truncate-prompt-tokens", "0"], "truncate_prompt_tokens"),
        (["--prompt", "hi", "--stop-token-id", "-1"], "stop_token_ids"),
        (["--prompt", "hi", "--allowed-token-id", "-1"], "allowed_token_ids"),
        (["--prompt", "hi", "--bad-word", ""], "bad_words"),
        (["--prompt", "hi", "--prompt-logprobs", "1"], "prompt_logprobs"),  # printed with --json only
        (["--prompt", "hi", "--json", "--prompt-logprobs", "21"], "prompt_logprobs"),
        (["--prompt", "hi", "--regex", "a+", "--disable-any-whitespace"], "disable_any_whitespace"),
        (["--prompt", "hi", "--whitespace-pattern", " "], "whitespace_pattern"),
        (["--prompt", "hi", "--json-object", "--whitespace-pattern", ""], "json_object"),
        (["--prompt", "hi", "--chat-template", "{{ messages }}"], "chat_template"),  # with --chat only
        (["--prompt", "hi", "--chat", "--chat-template", "no/such/chat.jinja"], "chat_template"),
        (["--prompt", "hi", "--chat", "--chat-template", "{% if %}"], "chat_template"),
    ],
)
def test_bad_input_exits_2_naming_the_parameter(args, field, capsys):
    """Checked before the model loads: in this process, through the CLI's own `main`
    (a subprocess costs about 3 s of imports each; the cases below run as one)."""
    from cluster.cli import main

    assert main(["generate", *args]) == 2
    assert capsys.readouterr().err.startswith(f"error: {field}: ")


@pytest.mark.parametrize("args, field", [
    (["--prompt", "hi", "--tensor-parallel-size", "4"], "tensor_parallel_size"),  # 3 key/value heads
    (["--prompt", "hi", "--regex", "(ab"], "regex"),  # compiled with the model's tokenizer
])
def test_bad_input_found_with_the_model_exits_2_naming_the_parameter(args, field):
    proc = splitspec("generate", *args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {field}: "), proc.stderr


def test_prompt_longer_than_context_is_refused():
    proc = splitspec("generate", "--prompt", "word " * 300, "--max-model-len", "128", "--max-tokens", "4")
    assert proc.returncode == 2 and proc.stderr.startswith("error: prompt: has "), proc.stderr


def test_engine_bench_runs_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    proc = splitspec("engine-bench", "--workload", "code_edit", "--batch", "1", "--requests", "1", "--repeats", "1",
                     "--max-tokens", "16", "--no-hf", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert {r["mode"] for r in report["rows"]} == {"off", "ngram:4"}
    assert report["greedy_mismatches"] == 0
    (summary,) = report["summary"]
    assert summary["workload"] == "code_edit" and summary["speedup_median"] > 0
    assert "speedup" in proc.stdout


def test_engine_bench_takes_the_draft_model_to_use(tmp_path):
    # The target itself as the draft: its greedy drafts are the target's own next tokens,
    # so all are accepted (bar a near-tie that the draft's one-row and the verifier's
    # several-row products break apart); the default trained draft accepts about a third.
    from verifier.models.bundled import bundled_model_path

    out = tmp_path / "bench.json"
    proc = splitspec("engine-bench", "--workload", "chat", "--batch", "1", "--requests", "1", "--repeats", "1",
                     "--max-tokens", "12", "--no-hf", "--modes", "off,draft:3", "--draft-model",
                     str(bundled_model_path()), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert report["greedy_mismatches"] == 0
    assert rows["draft:3"]["acceptance_rate"] >= 0.8 and rows["draft:3"]["mean_acceptance_length"] > 2.5


def test_engine_bench_cuts_the_draft_models_lm_head_to_a_subset(tmp_path):
    # The target drafting for itself (all drafts accepted above) over a subset of one token,
    # an EOS id: it can draft only EOS, which none of these 12 tokens is (a code_edit
    # answer runs longer), so nothing is accepted, and the output is still the target's own.
    from verifier.models.bundled import bundled_model_path

    out = tmp_path / "bench.json"
    proc = splitspec("engine-bench", "--workload", "code_edit", "--batch", "1", "--requests", "1", "--repeats", "1",
                     "--max-tokens", "12", "--no-hf", "--modes", "off,draft:3", "--draft-model",
                     str(bundled_model_path()), "--draft-vocab-subset", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert report["greedy_mismatches"] == 0 and rows["off"]["output_tokens"] == 12
    assert rows["draft:3"]["acceptance_rate"] == 0.0 and rows["draft:3"]["mean_acceptance_length"] == 1.0


@pytest.mark.parametrize("args", [["--draft-vocab-subset", "4096"],  # the default draft is a trained one
                                  ["--draft-model", "TRAINED", "--draft-vocab-subset", "4096"],
                                  ["--draft-model", "x.gguf", "--draft-vocab-subset", "0"]])
def test_engine_bench_refuses_a_vocab_subset_it_cannot_cut(args):
    from proposers.train import BUNDLED_DRAFT_DIR

    args = [str(BUNDLED_DRAFT_DIR) if a == "TRAINED" else a for a in args]
    proc = splitspec("engine-bench", "--modes", "off,draft:3", "--no-hf", *args, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: draft_vocab_subset: "), proc.stderr


def test_engine_bench_drafts_with_the_eagle_head_it_is_given(tmp_path):
    # A copy of the committed head with one byte of its weights changed: the run must load
    # that copy (and refuse it, as the proposer refuses a changed head), not the default.
    import shutil

    from proposers.train import BUNDLED_EAGLE_DIR, WEIGHTS_FILE

    head = tmp_path / "head"
    shutil.copytree(BUNDLED_EAGLE_DIR, head)
    data = bytearray((head / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (head / WEIGHTS_FILE).write_bytes(bytes(data))
    proc = splitspec("engine-bench", "--workload", "chat", "--batch", "1", "--requests", "1", "--repeats", "1",
                     "--max-tokens", "4", "--no-hf", "--modes", "off,eagle:3", "--eagle-head", str(head), timeout=120)
    assert proc.returncode != 0 and f"{head / WEIGHTS_FILE}: sha256" in proc.stderr, proc.stderr
    proc = splitspec("engine-bench", "--modes", "off,eagle:3", "--no-hf", "--eagle-head", str(tmp_path / "none"),
                     timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: eagle_head: "), proc.stderr


def test_engine_bench_modes_parse_as_their_examples_say():
    import doctest

    import cluster.engine_bench

    assert doctest.testmod(cluster.engine_bench).failed == 0


def test_engine_bench_runs_a_method_with_a_fallback(tmp_path):
    # n-gram finds no match in the first rounds of a chat answer: the head drafts those.
    out = tmp_path / "bench.json"
    proc = splitspec("engine-bench", "--workload", "chat", "--batch", "1", "--requests", "1", "--repeats", "1",
                     "--max-tokens", "16", "--no-hf", "--modes", "off,ngram>eagle:3,auto:ngram>eagle",
                     "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "ngram>eagle:3", "auto:ngram>eagle"} and report["greedy_mismatches"] == 0
    assert rows["ngram>eagle:3"]["passes"] < rows["off"]["passes"]
    proc = splitspec("engine-bench", "--modes", "off,auto:4", "--no-hf", timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: modes: "), proc.stderr


@pytest.mark.parametrize("mode", ["ngram>:3", "auto:ngram", "ngram>eagle>draft:3", "ngram>ngram:3", "auto:4",
                                  "auto>eagle:3"])
def test_engine_bench_refuses_a_malformed_mode(mode, capsys):
    from cluster.cli import main

    assert main(["engine-bench", "--modes", f"off,{mode}", "--no-hf"]) == 2
    assert capsys.readouterr().err.startswith("error: modes: "), mode


def _bench_3_requests_at_batch_2(tmp_path, flag: str, max_tokens: int) -> dict[str, dict]:
    """engine-bench's rows by mode for 3 code_edit requests at batch 2 with `flag`
    (`--interleave` or `--continuous`), after checking that both modes served all 3 and
    gave `off`'s tokens request by request (a lost or reordered result would show as a
    mismatch or a short row)."""
    out = tmp_path / "bench.json"
    proc = splitspec("engine-bench", "--workload", "code_edit", "--batch", "2", flag, "--requests", "3",
                     "--repeats", "1", "--max-tokens", str(max_tokens), "--no-hf", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["args"][flag.removeprefix("--")] is True and report["greedy_mismatches"] == 0
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"off", "ngram:4"}
    for r in rows.values():
        assert r["num_requests"] == 3 and r["batch"] == 2 and r["output_tokens"] <= 3 * max_tokens
    return rows


def test_engine_bench_interleave_runs_every_request_in_every_mode(tmp_path):
    # Groups of 2 and 1, each run in both modes before the next; a mode's row sums its groups.
    rows = _bench_3_requests_at_batch_2(tmp_path, "--interleave", 8)
    # Two groups: at least one prefill pass each, and 8 tokens need 7 decode passes.
    assert rows["off"]["passes"] >= 2 * 8 and rows["off"]["wall_s"] > 0
    proc = splitspec("engine-bench", "--interleave", "--continuous", "--no-hf")
    assert proc.returncode == 2 and proc.stderr.startswith("error: interleave: "), proc.stderr


def test_engine_bench_continuous_serves_every_request_to_its_clients(tmp_path):
    # 3 requests to 2 clients: the third starts when either client's first finishes.
    rows = _bench_3_requests_at_batch_2(tmp_path, "--continuous", 12)
    # Without drafts, a pass emits one token per running sequence: 3 requests of 12
    # tokens (unless one stops early) need at least 36 / 2 = 18 passes, prompts included.
    assert rows["off"]["passes"] >= -(-rows["off"]["output_tokens"] // 2)
    assert 0 < rows["ngram:4"]["passes"] <= rows["off"]["passes"]
    # Where the time went: the passes and the proposer calls are parts of the wall time,
    # and `off` calls no proposer.
    for row in rows.values():
        assert 0 < row["pass_s"] and 0 <= row["propose_s"] and row["pass_s"] + row["propose_s"] <= row["wall_s"]
    assert rows["off"]["propose_s"] < 0.05 * rows["off"]["pass_s"]
