"""KV cache: slots, copy-free rollback, and that rollback leaves exactly the accepted state."""

from __future__ import annotations

import pytest
import torch

from verifier.errors import OverloadedError
from verifier.kv_cache import KVCache
from verifier.rejection_sampler import greedy_accept


def test_slots_allocate_free_and_overload():
    cache = KVCache(num_layers=1, num_slots=2, num_kv_heads=1, max_len=8, head_dim=4, dtype=torch.float32)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free_slots == 0
    with pytest.raises(OverloadedError):
        cache.allocate()
    cache.lens[a] = 5
    cache.rollback(a, 3)
    assert cache.lens[a] == 3
    with pytest.raises(AssertionError):
        cache.rollback(a, 4)  # rollback never grows a sequence
    cache.free(a)
    assert cache.num_free_slots == 1 and cache.allocate() == a and cache.lens[a] == 0


def test_rollback_after_rejection_equals_plain_decoding(model, tokenizer):
    """Verify [last, d1..d4] where d3 is wrong; after rollback the next step's logits equal
    those of a cache built by plain one-token decoding of the accepted text."""
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    cache = model.new_cache(num_slots=2, max_len=256)

    # Reference: plain greedy decoding, one token per step.
    ref = cache.allocate()
    logits = model.forward(torch.tensor(prompt), [ref], [len(prompt)], cache)
    greedy = [int(logits[-1].argmax())]
    for _ in range(5):
        logits = model.forward(torch.tensor(greedy[-1:]), [ref], [1], cache)
        greedy.append(int(logits[-1].argmax()))

    # Speculative: drafts = the true greedy continuation with the third draft wrong.
    spec = cache.allocate()
    logits = model.forward(torch.tensor(prompt), [spec], [len(prompt)], cache)
    last = int(logits[-1].argmax())
    assert last == greedy[0]
    wrong = (greedy[3] + 1) % model.config.vocab_size
    drafts = torch.tensor([greedy[1], greedy[2], wrong, greedy[4]], dtype=torch.int32)
    verify = model.forward(torch.tensor([last, *drafts.tolist()]), [spec], [5], cache)
    num_accepted, emitted = greedy_accept(verify.argmax(-1).tolist(), drafts.numpy())
    assert num_accepted == 2 and emitted.tolist() == greedy[1:4]  # d1, d2, then recovered g3
    assert cache.lens[spec] == len(prompt) + 5
    cache.rollback(spec, cache.lens[spec] - (4 - num_accepted))
    assert cache.lens[spec] == len(prompt) + 3  # prompt, last, d1, d2

    # Build the reference state for the same text: prompt + greedy[:3] in the cache.
    cache2 = model.new_cache(num_slots=1, max_len=256)
    p = cache2.allocate()
    model.forward(torch.tensor(prompt), [p], [len(prompt)], cache2)
    for t in greedy[:3]:
        model.forward(torch.tensor([t]), [p], [1], cache2)
    assert cache2.lens[p] == cache.lens[spec]

    n = cache.lens[spec]
    # The cached keys/values of every kept position match (bound: fp32 GEMMs over 1 vs 5
    # rows round differently, ~1e-5 relative; values are O(1-10)).
    assert torch.allclose(cache.k[:, spec, :, :n], cache2.k[:, p, :, :n], atol=1e-3, rtol=1e-4)
    assert torch.allclose(cache.v[:, spec, :, :n], cache2.v[:, p, :, :n], atol=1e-3, rtol=1e-4)
    # And the next step's logits (input: the recovered token) match too.
    nxt_spec = model.forward(torch.tensor([greedy[3]]), [spec], [1], cache)
    nxt_plain = model.forward(torch.tensor([greedy[3]]), [p], [1], cache2)
    assert (nxt_spec - nxt_plain).abs().max().item() < 1e-3
    assert int(nxt_spec.argmax()) == greedy[4]
