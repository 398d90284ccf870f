"""LlamaModel and load_model against transformers' own implementations.

Independent references:
- `hf_model`: transformers' LlamaForCausalLM on the same bundled GGUF (its own GGUF
  dequantiser and Q/K un-permutation), fp32;
- tiny seeded Qwen2 / Llama models that transformers builds, saves with save_pretrained
  and runs itself, one per RoPE variant;
- transformers' RoPE init functions (`ROPE_INIT_FUNCTIONS`) for `rope_inv_freq`.
Batch invariance (ragged batches, chunked prefill, decode steps) is checked against the
same model run one sequence / one pass at a time.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from verifier.errors import ModelLoadError
from verifier.models.config import ModelConfig, RopeScaling, rope_attention_scaling, rope_inv_freq
from verifier.models.llama import (LINEAR_WEIGHTS, LlamaModel, dense, gemm_rows, linear, lm_head_rows,
                                   onednn_available, pack_weight)
from verifier.models.loader import load_model

# fp32 logits of the bundled model vs HF on the same GGUF: measured max abs error 3e-5 to
# 7e-5 on logits of magnitude 30-38 (relative ~2e-6: fp32 summation order differs between
# our fused wqkv / w_gate_up GEMMs and HF's separate Linear layers over 30 layers). 1e-3
# leaves ~15x headroom, yet is ~10x below the smallest top-1/top-2 logit gap seen on these
# prompts (0.012), and any real fault (wrong RoPE layout, position or mask) moves logits by
# O(1).
HF_LOGITS_ATOL = 1e-3
# Our model against itself with different batch shapes: only the GEMM row count (and so
# MKL's blocking and summation order) changes; measured max abs differences are 3e-5 to
# 5e-5. 5e-4 allows for other CPUs' blocking and is still 20x below the smallest top-2
# gap, while reading a wrong cache position or mask changes logits by O(1).
BATCH_ATOL = 5e-4
# Tiny fp32 models (2 layers, logits ~7): measured max abs error 7e-6 to 8e-6, while
# dropping the variant's RoPE scaling (or Qwen2's theta) changes logits by ~8.
TINY_ATOL = 1e-4
# bfloat16 keeps 8 significant bits (relative step 2^-8 = 0.4%), so with logits up to ~37
# and 30 bf16 layers the measured max abs diff against fp32 is 0.9-1.2 and greedy argmax
# agrees on 108 of 110 positions (98%). The bounds leave ~2.5x headroom on the diff and
# allow up to 10% argmax flips, where near-ties (gaps down to 0.01 here) can flip.
BF16_MAX_ABS_DIFF = 3.0
BF16_MIN_ARGMAX_AGREEMENT = 0.90

PLAIN_TEXTS = {
    "greeting": "Hello, world!",
    "code": "The quick brown fox jumps over the lazy dog. " * 6 + "def f(x):\n    return x * 2\n",
}
CHAT_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    """Token ids of three prompts: greeting (4 tokens), code (72), chat template (38)."""
    texts = dict(PLAIN_TEXTS, chat=tokenizer.apply_chat_template(CHAT_MESSAGES))
    return {name: tokenizer.encode(text) for name, text in texts.items()}


def ids_tensor(token_ids: list[int]) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.int32)  # [T] int32, as on the wire


def prefill(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits float32 [len(token_ids), vocab] of one sequence prefilled in one pass."""
    cache = model.new_cache(num_slots=1, max_len=len(token_ids))
    slot = cache.allocate()
    return model.forward(ids_tensor(token_ids), [slot], [len(token_ids)], cache)


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF reference logits float32 [len(token_ids), vocab]."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{a.shape=} {b.shape=}"
    return (a - b).abs().max().item()


# --- 1. the bundled model against HF on the same GGUF ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["greeting", "code", "chat"])
def test_logits_match_hf_on_bundled_gguf(model, hf_model, prompts, name):
    token_ids = prompts[name]
    ours, ref = prefill(model, token_ids), hf_logits(hf_model, token_ids)
    assert ours.dtype == torch.float32 and ours.shape == (len(token_ids), model.config.vocab_size)
    err = max_abs(ours, ref)
    assert err < HF_LOGITS_ATOL, f"{name}: {err=} over {len(token_ids)} positions"
    mismatched = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatched, f"{name}: greedy argmax differs at positions {mismatched}"


# --- 2. batch invariance ----------------------------------------------------------------


def test_ragged_batch_matches_each_sequence_alone(model, prompts):
    """One pass mixing the three attention paths: a prefill from position 0 (causal), a
    3-token continuation after a 40-token prefix (explicit mask) and a 1-token decode step
    after a 3-token prefix, against each run alone; then the same pass with logits_index
    picking only each sequence's last row."""
    chat, code, greeting = prompts["chat"], prompts["code"], prompts["greeting"]
    # (prefix already in the cache, tokens of the ragged pass)
    seqs = [([], chat), (code[:40], code[40:43]), (greeting[:3], greeting[3:4])]

    alone = []
    for prefix, new in seqs:
        cache = model.new_cache(num_slots=1, max_len=64)
        slot = cache.allocate()
        if prefix:
            model.forward(ids_tensor(prefix), [slot], [len(prefix)], cache)
        alone.append(model.forward(ids_tensor(new), [slot], [len(new)], cache))

    cache = model.new_cache(num_slots=3, max_len=64)
    slots = [cache.allocate() for _ in seqs]
    for slot, (prefix, _) in zip(slots, seqs):
        if prefix:
            model.forward(ids_tensor(prefix), [slot], [len(prefix)], cache)
    token_ids = ids_tensor([t for _, new in seqs for t in new])
    num_tokens = [len(new) for _, new in seqs]
    batched = model.forward(token_ids, slots, num_tokens, cache)
    assert cache.lens == [len(p) + len(n) for p, n in seqs]
    err = max_abs(batched, torch.cat(alone))
    assert err < BATCH_ATOL, f"ragged {num_tokens=}: {err=}"

    for slot, (prefix, _) in zip(slots, seqs):
        cache.rollback(slot, len(prefix))
    last_rows = torch.tensor(num_tokens).cumsum(0) - 1  # int64 [3]: 37, 40, 41
    picked = model.forward(token_ids, slots, num_tokens, cache, logits_index=last_rows)
    err = max_abs(picked, torch.stack([a[-1] for a in alone]))
    assert err < BATCH_ATOL, f"logits_index {last_rows.tolist()}: {err=}"


def run_alone_and_together(model, text, prefix_lens, new, num_slots, idle):
    """Each sequence continued alone (its prefix `text[:n]` cached, then `new[slot]`), and
    all of them in one pass over a cache of `num_slots` whose slot `idle` is free. Returns
    (rows alone, concatenated in slot order; rows of the shared pass; the shared cache)."""
    alone = {}
    for slot, n in prefix_lens.items():
        cache = model.new_cache(num_slots=1, max_len=96)
        s = cache.allocate()
        if n:
            model.forward(ids_tensor(text[:n]), [s], [n], cache)
        alone[slot] = model.forward(ids_tensor(new[slot]), [s], [len(new[slot])], cache)

    cache = model.new_cache(num_slots=num_slots, max_len=96)
    assert [cache.allocate() for _ in range(num_slots)] == list(range(num_slots))
    cache.free(idle)
    for slot, n in prefix_lens.items():
        if n:
            model.forward(ids_tensor(text[:n]), [slot], [n], cache)
    slots = list(prefix_lens)
    batched = model.forward(ids_tensor([t for s in slots for t in new[s]]), slots, [len(new[s]) for s in slots],
                            cache)
    return torch.cat([alone[s] for s in slots]), batched, cache


def test_grouped_decode_steps_match_each_sequence_alone(model, prompts):
    """Five one-token decode steps (cache lengths 3 to 60, an idle slot among theirs) run
    their attention as one batched product over the slot range; with a 3-token
    continuation beside them (its own masked path) every row equals the sequence alone."""
    from verifier.models.llama import GROUP_MIN, _SeqSpan, _SpanGroup

    text = prompts["chat"] + prompts["code"]
    prefix_lens = {0: 3, 1: 60, 2: 17, 4: 41, 5: 29, 6: 25}  # slot -> tokens already cached
    new = {slot: text[n : n + (3 if slot == 6 else 1)] for slot, n in prefix_lens.items()}

    slots = list(prefix_lens)
    num_tokens = [len(new[s]) for s in slots]
    assert sum(n == 1 for n in num_tokens) == 5 >= GROUP_MIN
    # Slot 3 is idle, inside the group's slot range.
    alone, batched, cache = run_alone_and_together(model, text, prefix_lens, new, num_slots=7, idle=3)
    assert cache.lens == [4, 61, 18, 0, 42, 30, 28]
    err = max_abs(batched, alone)
    assert err < BATCH_ATOL, f"{err=}"
    # The grouping itself: slots 0-4 (five, four members), each blocked past its own length.
    spans = [_SeqSpan(s, i, 1, n, None, False) for i, (s, n) in enumerate([(0, 4), (1, 61), (2, 18), (4, 42)])]
    group = _SpanGroup.of(spans)
    assert (group.lo, group.hi, group.width, group.kv_len) == (0, 5, 1, 61)
    assert group.blocked[:, 0, 0, 0].sum(-1).tolist() == [61 - 4, 0, 61 - 18, 61 - 1, 61 - 42]
    assert _SpanGroup.of(spans[:3]) is None  # fewer than GROUP_MIN
    # In the pass above the 3-token span stays out: at width 3 the six spans' 8 tokens
    # fill 8 of 7 slots x 3 rows = 21 (less than half), at width 1 five fill 5 of 6.
    spans = [_SeqSpan(s, sum(num_tokens[:i]), n, prefix_lens[s] + n, None, False)
             for i, (s, n) in enumerate(zip(slots, num_tokens))]
    group = _SpanGroup.of(spans)
    assert (group.lo, group.hi, group.width) == (0, 6, 1)
    assert [s.grouped for s in spans] == [True] * 5 + [False]


def test_grouped_verification_spans_match_each_sequence_alone(model, prompts):
    """Spans of 1-4 tokens continuing caches of 5-50 positions (an idle slot among them)
    run their attention as one batched product, 4 query rows per slot, each row masked
    to its own causal prefix; a 12-token prefill beside them keeps its own path. Every
    row equals the sequence run alone."""
    from verifier.models.llama import _SeqSpan, _SpanGroup

    text = prompts["chat"] + prompts["code"]
    prefix_lens = {0: 5, 1: 50, 2: 17, 4: 33, 5: 9, 6: 26, 7: 0}  # slot -> tokens already cached
    widths = {0: 3, 1: 1, 2: 4, 4: 2, 5: 1, 6: 3, 7: 12}
    new = {slot: text[n : n + widths[slot]] for slot, n in prefix_lens.items()}

    slots = list(prefix_lens)
    num_tokens = [widths[s] for s in slots]
    # Slot 3 is idle, inside the group's slot range.
    alone, batched, cache = run_alone_and_together(model, text, prefix_lens, new, num_slots=8, idle=3)
    assert cache.lens == [8, 51, 21, 0, 35, 10, 29, 12]
    err = max_abs(batched, alone)
    assert err < BATCH_ATOL, f"{err=}"
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))

    # The group, by hand: slots 0-6 (seven, six members), width 4 because their 14 tokens
    # fill at least half of 7 x 4 rows; the prefill (12 > GROUP_MAX_WIDTH) stays out.
    starts = [sum(num_tokens[:i]) for i in range(len(slots))]
    spans = [_SeqSpan(s, t0, widths[s], prefix_lens[s] + widths[s], None, False) for s, t0 in zip(slots, starts)]
    group = _SpanGroup.of(spans)
    assert (group.lo, group.hi, group.width, group.kv_len) == (0, 7, 4, 51)
    assert [s.grouped for s in spans] == [True] * 6 + [False]
    assert group.slot_index.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 4, 4, 5, 6, 6, 6]
    assert group.row_index.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 0, 0, 1, 2]
    assert group.token_index.tolist() == list(range(14))
    # Keys each row may attend: row j of slot 0 (5 cached) sees positions 0 .. 5 + j;
    # dead rows (j past the span) and the idle slot 3 see key 0 only.
    allowed = (~group.blocked[:, 0, 0]).sum(-1).tolist()
    assert allowed == [[6, 7, 8, 1], [51, 1, 1, 1], [18, 19, 20, 21], [1, 1, 1, 1],
                       [34, 35, 1, 1], [10, 1, 1, 1], [27, 28, 29, 1]]
    # Two 5-token spans among six decodes (slots 0-7): at width 5 their 16 tokens fill
    # less than half of 8 x 5 rows, so only the decodes group.
    spans = [_SeqSpan(s, 0, 5 if s in (3, 7) else 1, 40, None, False) for s in range(8)]
    group = _SpanGroup.of(spans)
    assert (group.lo, group.hi, group.width) == (0, 7, 1)
    assert sum(s.grouped for s in spans) == 6


def test_gathered_verification_spans_match_each_sequence_alone(model, prompts):
    """Five decodes and three verification rounds of 3, 9 and 5 tokens spread over slots
    0-8 (idle slot 6 among them): at width 9 or 5 the rounds' tokens fill too little of the
    range's rows, so the decodes group over the range at width 1 and the rounds are
    gathered into a group of their own over their three slots, 9 query rows each; a
    12-token prefill beside them keeps its own path. Every row equals the sequence alone."""
    from verifier.models.llama import GATHER_MIN, _SeqSpan, _SpanGroup

    text = prompts["chat"] + prompts["code"]
    prefix_lens = {0: 7, 1: 50, 2: 12, 3: 31, 4: 9, 5: 44, 7: 21, 8: 26, 9: 0}  # slot -> tokens cached
    widths = {0: 1, 1: 3, 2: 1, 3: 1, 4: 9, 5: 1, 7: 1, 8: 5, 9: 12}
    new = {slot: text[n : n + widths[slot]] for slot, n in prefix_lens.items()}
    alone, batched, cache = run_alone_and_together(model, text, prefix_lens, new, num_slots=10, idle=6)
    assert cache.lens == [8, 53, 13, 32, 18, 45, 0, 22, 31, 12]
    err = max_abs(batched, alone)
    assert err < BATCH_ATOL, f"{err=}"
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))

    # The groups, by hand. At widths 9, 5 and 3 the short spans fill too little of the
    # range's rows (22 of 9 x 9, 13 of 9 x 5, 8 of 8 x 3), so the range group is the five
    # decodes at width 1 over slots 0-7; the three rounds are gathered.
    slots = list(prefix_lens)
    starts = dict(zip(slots, [sum(widths[s] for s in slots[:i]) for i in range(len(slots))]))
    spans = [_SeqSpan(s, starts[s], widths[s], prefix_lens[s] + widths[s], None, False) for s in slots]
    ranged = _SpanGroup.of(spans)
    assert (ranged.lo, ranged.hi, ranged.width, ranged.slots) == (0, 8, 1, None)
    # One gathered group: 3 x 9 rows + 8 for the group = 35, no more than [3, 5] + [9]
    # (2 x 5 + 9 + 2 x 8 = 35) or one group each (17 + 24 = 41).
    (gathered,) = _SpanGroup.gathered(spans)
    assert len(spans) - sum(s.grouped for s in spans) == 1  # the prefill
    assert 3 >= GATHER_MIN
    assert gathered.slots.tolist() == [1, 4, 8] and (gathered.width, gathered.kv_len) == (9, 53)
    assert gathered.slot_index.tolist() == [0] * 3 + [1] * 9 + [2] * 5
    assert gathered.row_index.tolist() == [0, 1, 2] + list(range(9)) + list(range(5))
    assert gathered.token_index.tolist() == [1, 2, 3] + list(range(6, 15)) + list(range(17, 22))
    # Row j of slot 1 (50 cached) sees keys 0 .. 50 + j; dead rows key 0 only.
    allowed = (~gathered.blocked[:, 0, 0]).sum(-1).tolist()
    assert allowed == [[51, 52, 53] + [1] * 6, list(range(10, 19)), [27, 28, 29, 30, 31] + [1] * 4]
    # Fewer than GATHER_MIN rounds left out: no gathered group, the round attends alone.
    spans = [_SeqSpan(s, 0, 5 if s == 3 else 1, 40, None, False) for s in range(8)]
    assert _SpanGroup.of(spans).width == 1 and _SpanGroup.gathered(spans) == []


def test_gathered_spans_split_by_width_match_each_sequence_alone(model, prompts):
    """Seven decodes and one verification round of 9 tokens on every third slot of 22: too
    sparse for a range group (8 of 22 rows at width 1), so all eight are gathered, in two
    groups by width: 7 rows at width 1 and 9 at width 9, 16 + 2 x GATHER_GROUP_ROWS = 32
    rows against 8 x 9 + 8 = 80 as one group padded to 9. Every row equals the sequence
    alone."""
    from verifier.models.llama import GATHER_GROUP_ROWS, _SeqSpan, _SpanGroup

    assert GATHER_GROUP_ROWS == 8  # the sums above
    text = prompts["chat"] + prompts["code"]
    slots = list(range(0, 22, 3))  # 0, 3, ..., 21
    prefix_lens = {s: 8 + 5 * i for i, s in enumerate(slots)}  # 8 .. 43 tokens cached
    widths = {s: 9 if s == 9 else 1 for s in slots}
    new = {slot: text[n : n + widths[slot]] for slot, n in prefix_lens.items()}
    alone, batched, cache = run_alone_and_together(model, text, prefix_lens, new, num_slots=22, idle=1)
    err = max_abs(batched, alone)
    assert err < BATCH_ATOL, f"{err=}"
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))

    starts = dict(zip(slots, [sum(widths[s] for s in slots[:i]) for i in range(len(slots))]))
    spans = [_SeqSpan(s, starts[s], widths[s], prefix_lens[s] + widths[s], None, False) for s in slots]
    assert _SpanGroup.of(spans) is None
    decodes, round_ = _SpanGroup.gathered(spans)
    assert decodes.slots.tolist() == [0, 3, 6, 12, 15, 18, 21] and decodes.width == 1
    assert round_.slots.tolist() == [9] and round_.width == 9 and round_.kv_len == prefix_lens[9] + 9
    assert round_.token_index.tolist() == list(range(starts[9], starts[9] + 9))

def test_chunked_prefill_matches_one_shot(model, prompts):
    """Chunks [0:20] (causal from 0), [20:21] (decode path) and [21:72] (masked)."""
    token_ids = prompts["code"]
    one_shot = prefill(model, token_ids)
    cache = model.new_cache(num_slots=1, max_len=len(token_ids))
    slot = cache.allocate()
    chunks = [token_ids[:20], token_ids[20:21], token_ids[21:]]
    chunked = torch.cat([model.forward(ids_tensor(c), [slot], [len(c)], cache) for c in chunks])
    assert cache.lens[slot] == len(token_ids)
    err = max_abs(chunked, one_shot)
    assert err < BATCH_ATOL, f"{err=}"


@pytest.fixture(scope="session")
def mkl_model():
    """The bundled model with its linears left to MKL (not packed)."""
    return load_model(None, "float32")


@pytest.mark.parametrize("n, mkl_rows", [(2, 4), (5, 8), (9, 16), (17, 24)])
@pytest.mark.parametrize("backend", ["onednn", "mkl"])
def test_decode_steps_match_one_padded_pass(request, prompts, backend, n, mkl_rows):
    """A verification pass of n tokens equals n one-token decode steps, row for row. MKL
    pads the pass's GEMMs to `mkl_rows` rows (the LM head's too) and runs the steps'
    unpadded (LM head padded 1 -> 2); packed oneDNN weights pad nothing but a lone row."""
    model = request.getfixturevalue("model" if backend == "onednn" else "mkl_model")
    if backend == "onednn" and not model.packed:
        pytest.skip("this torch has no oneDNN packed linear")
    assert not model.packed if backend == "mkl" else model.gemm_rows(1) == model.lm_head_rows(1) == 2
    assert model.gemm_rows(n) == (mkl_rows if backend == "mkl" else n)
    token_ids = prompts["chat"]
    prefix, tail = token_ids[:-n], token_ids[-n:]
    cache = model.new_cache(num_slots=2, max_len=len(token_ids))
    s_pass, s_steps = cache.allocate(), cache.allocate()
    for slot in (s_pass, s_steps):
        model.forward(ids_tensor(prefix), [slot], [len(prefix)], cache)
    one_pass = model.forward(ids_tensor(tail), [s_pass], [n], cache)
    steps = torch.cat([model.forward(ids_tensor([t]), [s_steps], [1], cache) for t in tail])
    assert one_pass.shape == steps.shape == (n, model.config.vocab_size)
    assert cache.lens[s_pass] == cache.lens[s_steps] == len(token_ids)
    err = max_abs(one_pass, steps)
    assert err < BATCH_ATOL, f"{err=}"
    assert torch.equal(one_pass.argmax(-1), steps.argmax(-1))


# --- token trees ---------------------------------------------------------------------------

# A tree over code[40:]: root r = code[40]; children a = code[41], b = code[50]; a's
# children c = code[42], d = code[45]; b's child e = code[43]. Node order is parents first.
TREE_PARENTS = [-1, 0, 0, 1, 1, 2]
TREE_PATHS = {"r-a-c": [0, 1, 3], "r-a-d": [0, 1, 4], "r-b-e": [0, 2, 5]}


def tree_tokens(code: list[int]) -> list[int]:
    return [code[40], code[41], code[50], code[42], code[45], code[43]]


def chain_logits(model, prefix: list[int], chain: list[int]) -> torch.Tensor:
    """Logits of `chain` run alone after `prefix`: the reference each tree path must match."""
    cache = model.new_cache(num_slots=1, max_len=64)
    slot = cache.allocate()
    model.forward(ids_tensor(prefix), [slot], [len(prefix)], cache)
    return model.forward(ids_tensor(chain), [slot], [len(chain)], cache)


def test_a_tree_pass_computes_each_path_as_its_own_chain(model, prompts):
    """One pass over a 6-node tree (beside a plain 2-token round of another sequence) gives
    every node the logits that its root-to-node path gets run alone as a chain; the same
    tree fed in two passes (root and depth 1, then depth 2, as an EAGLE head drafts) too."""
    code, chat = prompts["code"], prompts["chat"]
    prefix, nodes = code[:40], tree_tokens(code)
    refs = {name: chain_logits(model, prefix, [nodes[i] for i in path]) for name, path in TREE_PATHS.items()}
    other_ref = chain_logits(model, chat[:30], chat[30:32])

    cache = model.new_cache(num_slots=2, max_len=64)
    s_tree, s_other = cache.allocate(), cache.allocate()
    model.forward(ids_tensor(prefix), [s_tree], [len(prefix)], cache)
    model.forward(ids_tensor(chat[:30]), [s_other], [30], cache)
    out = model.forward(ids_tensor(nodes + chat[30:32]), [s_tree, s_other], [6, 2], cache,
                        trees=[(40, TREE_PARENTS), None])
    assert cache.lens == [46, 32]
    for name, path in TREE_PATHS.items():
        err = max_abs(out[path], refs[name])
        assert err < BATCH_ATOL, f"{name}: {err=}"
    assert max_abs(out[6:], other_ref) < BATCH_ATOL

    cache = model.new_cache(num_slots=1, max_len=64)
    slot = cache.allocate()
    model.forward(ids_tensor(prefix), [slot], [40], cache)
    first = model.forward(ids_tensor(nodes[:3]), [slot], [3], cache, trees=[(40, TREE_PARENTS[:3])])
    second = model.forward(ids_tensor(nodes[3:]), [slot], [3], cache, trees=[(40, TREE_PARENTS)])
    both = torch.cat([first, second])
    for name, path in TREE_PATHS.items():
        err = max_abs(both[path], refs[name])
        assert err < BATCH_ATOL, f"two passes, {name}: {err=}"


def test_keeping_a_tree_path_leaves_the_cache_of_that_chain(model, prompts):
    """After a tree pass, `KVCache.keep` of the path r-a-d moves its K/V into positions
    40..42; the next decode step then equals the one after prefix + r, a, d run as a chain."""
    code = prompts["code"]
    prefix, nodes = code[:40], tree_tokens(code)
    cache = model.new_cache(num_slots=1, max_len=64)
    slot = cache.allocate()
    model.forward(ids_tensor(prefix), [slot], [40], cache)
    model.forward(ids_tensor(nodes), [slot], [6], cache, trees=[(40, TREE_PARENTS)])
    cache.keep(slot, 40, [40 + i for i in TREE_PATHS["r-a-d"]])
    assert cache.lens[slot] == 43
    after_tree = model.forward(ids_tensor([code[60]]), [slot], [1], cache)

    ref = model.new_cache(num_slots=1, max_len=64)
    r = ref.allocate()
    model.forward(ids_tensor(prefix + [nodes[i] for i in TREE_PATHS["r-a-d"]]), [r], [43], ref)
    plain = model.forward(ids_tensor([code[60]]), [r], [1], ref)
    assert max_abs(after_tree, plain) < BATCH_ATOL
    assert torch.allclose(cache.k[:, slot, :, :44], ref.k[:, r, :, :44], atol=1e-3, rtol=1e-4)


def test_a_tree_must_list_parents_first(model, prompts):
    code = prompts["code"]
    cache = model.new_cache(num_slots=1, max_len=64)
    slot = cache.allocate()
    model.forward(ids_tensor(code[:40]), [slot], [40], cache)
    with pytest.raises(ValueError, match=r"parents\[1\] is 2"):
        model.forward(ids_tensor(code[40:43]), [slot], [3], cache, trees=[(40, [-1, 2, 0])])
    with pytest.raises(ValueError, match="needs parents for indices 40..42, got 2"):
        model.forward(ids_tensor(code[40:43]), [slot], [3], cache, trees=[(40, [-1, 0])])


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("n, k", [(3072, 576), (576, 1536), (896, 4864)])
def test_packed_linear(n, k):
    """A packed weight unpacks bit for bit, gives MKL's product to rounding, and (from two
    rows up) the same numbers for a row whatever the row count, as measured here."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    packed = pack_weight(w)
    assert packed.is_mkldnn and torch.equal(dense(packed), w) and dense(w) is w
    got, ref = linear(x, packed, b), x @ w.t() + b
    assert got.shape == (40, n) and torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    two = linear(x[:2], packed, b)
    for rows in (3, 8, 17, 40):
        assert torch.equal(linear(x[:rows], packed, b)[:2], two), f"{rows} rows"


def test_pack_weights_only_where_it_serves(tmp_path, monkeypatch):
    """Packing is for CPU float32 inference: not a bfloat16 model, not weights that need a
    gradient, not with SPLITSPEC_CPU_GEMM=mkl; it packs the layers in place, the LM head
    into a copy, and is idempotent."""
    build_tiny(*TINY_VARIANTS["qwen2"]).save_pretrained(tmp_path, safe_serialization=True)
    assert not load_model(tmp_path, "bfloat16").pack_weights()
    grad = load_model(tmp_path, "float32")
    grad.layers[0].wqkv.requires_grad_(True)
    assert not grad.pack_weights() and not grad.packed
    monkeypatch.setenv("SPLITSPEC_CPU_GEMM", "mkl")
    assert not onednn_available() and not load_model(tmp_path, "float32").pack_weights()
    monkeypatch.delenv("SPLITSPEC_CPU_GEMM")
    if not onednn_available():
        pytest.skip("this torch has no oneDNN packed linear")
    m = load_model(tmp_path, "float32")
    head, wqkv = m.lm_head, m.layers[0].wqkv
    assert m.pack_weights() and m.packed and m.pack_weights()
    assert m.lm_head is head and not head.is_mkldnn and torch.equal(dense(m.lm_head_packed), head)
    assert all(getattr(layer, name).is_mkldnn for layer in m.layers for name in LINEAR_WEIGHTS)
    assert torch.equal(dense(m.layers[0].wqkv), wqkv)


def test_gemm_rows_pads_to_the_fast_sizes():
    # By hand from the rule: 1 stays, 2-4 -> 4, 5-8 -> 8, 9-16 -> 16, then multiples of 8.
    assert [gemm_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 24, 25, 113)] == [
        1, 4, 4, 4, 8, 8, 16, 16, 16, 24, 24, 32, 120]
    assert [lm_head_rows(n) for n in (0, 1, 2, 3, 9)] == [0, 2, 4, 4, 16]


# --- 3. the HF checkpoint-directory path on the same weights ---------------------------


@pytest.mark.slow
def test_safetensors_dir_loads_the_same_model_as_gguf(model, hf_model, prompts, tmp_path):
    """Save HF's own dequantised, un-permuted weights as a checkpoint directory: our
    directory loader must give the GGUF loader's weights bit for bit (so our GGUF Q/K
    un-permutation agrees with HF's) and the same logits."""
    state = hf_model.state_dict()
    assert hf_model.config.tie_word_embeddings
    # Tied: lm_head.weight shares storage with the embedding, which safetensors refuses to
    # save twice; HF checkpoints of tied models store the embedding only.
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf_model.config.to_json_string())

    loaded = load_model(tmp_path, "float32")
    assert loaded.pack_weights() == model.packed  # as the fixture's
    c, ref_c = loaded.config, model.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (
        ref_c.architecture, ref_c.num_layers, ref_c.num_heads, ref_c.num_kv_heads, ref_c.head_dim, ref_c.rope_theta
    )
    assert loaded.lm_head is loaded.embed
    for i, (a, b) in enumerate(zip(loaded.layers, model.layers)):
        assert torch.equal(dense(a.wqkv), dense(b.wqkv)), f"layer {i}: q/k/v weights differ"
    assert torch.equal(loaded.embed, model.embed)
    token_ids = prompts["chat"]
    # Same weights, same config values, same code: bit-identical logits (measured: 0).
    assert torch.equal(prefill(loaded, token_ids), prefill(model, token_ids))


# --- 4. tiny transformers-built models of other variants --------------------------------

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=512,
    # 10x HF's default 0.02: with std 0.02 attention is nearly uniform (logits ~0.6), and
    # dropping RoPE scaling moves logits by only 4e-3; at 0.2 it moves them by ~8.
    initializer_range=0.2,
)
# transformers 5 writes RoPE settings to config.json as `rope_parameters` (rope_theta
# inside it), not as the v4 `rope_scaling` + top-level `rope_theta`.
TINY_VARIANTS = {
    "qwen2": (
        "Qwen2ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False},
    ),
    "llama3": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "linear-tied": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, "tie_word_embeddings": True},
    ),
    "yarn": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,  # = max_position_embeddings / original_max_position_embeddings
                "original_max_position_embeddings": 64,
            }
        },
    ),
}
TINY_SEQ_LEN = 100  # past original_max_position_embeddings (64), where scaling matters most


def build_tiny(class_name: str, overrides: dict, seed: int = 0):
    """A seeded random transformers model; attention biases (zero at HF init) randomised."""
    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**TINY_SHAPE, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = model_class(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, TINY_SHAPE["initializer_range"])
    return hf


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_checkpoint_matches_hf(variant, tmp_path):
    class_name, overrides = TINY_VARIANTS[variant]
    hf = build_tiny(class_name, overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(tmp_path, "float32")

    rope = overrides["rope_parameters"]
    c = ours.config
    assert c.architecture == hf.config.model_type
    assert (c.rope_theta, c.rope_scaling.kind) == (rope["rope_theta"], rope["rope_type"])
    assert c.rope_scaling.factor == rope.get("factor", 1.0)
    assert c.rope_scaling.original_max_position == rope.get("original_max_position_embeddings", 0)
    assert (ours.layers[0].bqkv is not None) == (variant == "qwen2")
    assert (ours.lm_head is ours.embed) == hf.config.tie_word_embeddings

    token_ids = torch.randint(0, TINY_SHAPE["vocab_size"], (TINY_SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    logits = prefill(ours, token_ids.tolist())
    ref = hf_logits(hf, token_ids.tolist())
    err = max_abs(logits, ref)
    assert err < TINY_ATOL, f"{variant}: {err=}"
    if ours.pack_weights():  # oneDNN's linears, as the model serves
        err = max_abs(prefill(ours, token_ids.tolist()), ref)
        assert err < TINY_ATOL, f"{variant}, packed: {err=}"

    # The comparison can see RoPE: plain RoPE at theta 1e4 on the same weights is far off.
    plain = dataclasses.replace(c, rope_theta=10000.0, rope_scaling=RopeScaling())
    unscaled = LlamaModel(plain, ours.embed, ours.layers, ours.final_norm, ours.lm_head, ours.dtype)
    assert max_abs(prefill(unscaled, token_ids.tolist()), ref) > 100 * TINY_ATOL


# --- 5. bfloat16 -----------------------------------------------------------------------


@pytest.mark.slow
def test_bfloat16_tracks_float32(model, prompts):
    bf16 = load_model(None, "bfloat16")
    assert bf16.embed.dtype == bf16.layers[0].wqkv.dtype == torch.bfloat16
    diffs, agree, total = [], 0, 0
    for name in ("code", "chat"):  # 110 positions
        got, ref = prefill(bf16, prompts[name]), prefill(model, prompts[name])
        assert got.dtype == torch.float32
        diffs.append(max_abs(got, ref))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(prompts[name])
    assert max(diffs) < BF16_MAX_ABS_DIFF, f"{diffs=}"
    assert agree / total >= BF16_MIN_ARGMAX_AGREEMENT, f"argmax agrees on {agree}/{total} positions"


# --- 6. RoPE frequencies against transformers ---------------------------------------------

ROPE_CONFIGS = {
    # Llama 3.1 8B's published RoPE settings.
    "llama3-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "llama3-head64": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            max_position_embeddings=32768,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "linear": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            max_position_embeddings=16384,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
    ),
    # Qwen2.5-7B-Instruct's documented long-context setting.
    "yarn-qwen2.5": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        ),
    ),
    "yarn-betas": (
        "LlamaConfig",
        dict(
            hidden_size=1024,
            num_attention_heads=16,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 2048,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
        ),
    ),
}


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_rope_inv_freq_matches_transformers(name):
    config_class, kwargs = ROPE_CONFIGS[name]
    hf_config = getattr(transformers, config_class)(**kwargs)
    ref_inv_freq, ref_attention_factor = ROPE_INIT_FUNCTIONS[kwargs["rope_parameters"]["rope_type"]](hf_config, "cpu")
    ours = ModelConfig.from_hf(hf_config.to_dict())  # through the config.json path
    inv_freq = rope_inv_freq(ours)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (ours.head_dim // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0.0)
    assert rope_attention_scaling(ours) == pytest.approx(ref_attention_factor, rel=1e-9)
    # Scaling did change the frequencies (the default would fail the comparison above).
    assert not torch.allclose(inv_freq, rope_inv_freq(dataclasses.replace(ours, rope_scaling=RopeScaling())))


# --- 7. loader errors ------------------------------------------------------------------


def write_config(directory: pathlib.Path, config: dict) -> None:
    (directory / "config.json").write_text(json.dumps(config))


def tiny_llama_config() -> dict:
    return transformers.LlamaConfig(**TINY_SHAPE).to_dict()


def test_load_dir_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_load_unsupported_architecture(tmp_path):
    # A Llama-shaped config (every key our parser reads) of an architecture we do not run.
    config = transformers.MistralConfig(**TINY_SHAPE).to_dict()
    write_config(tmp_path, config)
    with pytest.raises(ModelLoadError, match="unsupported model_type 'mistral'"):
        load_model(tmp_path)


def test_load_non_llama_config_names_the_architecture(tmp_path):
    write_config(tmp_path, transformers.GPT2Config().to_dict())
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path)


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="unsupported dtype 'fp8'"):
        load_model(None, "fp8")


def test_load_dir_without_weights(tmp_path):
    write_config(tmp_path, tiny_llama_config())
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)


def test_load_dir_with_a_missing_tensor(tmp_path):
    hf = build_tiny("LlamaForCausalLM", {})
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, hf.config.to_dict())
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_model(tmp_path)


@pytest.mark.parametrize("name", ["model.bin", "absent.gguf", "absent-dir"])
def test_load_path_neither_gguf_nor_dir(tmp_path, name):
    path = tmp_path / name
    if name == "model.bin":
        path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a checkpoint directory"):
        load_model(path)
