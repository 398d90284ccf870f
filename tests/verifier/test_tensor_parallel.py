"""Tensor parallelism: the bundled target split over processes computes what it computes whole.

References: the unsplit model (checked against HF transformers in test_model.py) for
logits, within a float tolerance (the split sums each layer's partial products in another
order); plain decoding on the same split model for greedy speculation, token for token.
The shares themselves are worked out by hand (SmolLM2-135M: 9 query heads over 3
key/value heads of 64 dims, 1536 MLP units, 576 hidden).
"""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.workloads import load_prompts
from proposers.ngram import NgramProposer
from tests.verifier.test_engine import _OracleTreeProposer
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.errors import InvalidRequestError
from verifier.models.tensor_parallel import (SHM_SLOT_BYTES, ShardedKVCache, SharedMemoryAllReduce, TensorParallelModel,
                                             load_share, shard_bounds, shard_model, shm_file_bytes)
from verifier.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
LOGITS_ATOL = 1e-3  # the bound test_model.py holds our logits to against HF's


def test_shares_split_units_contiguously_the_first_ranks_taking_one_more():
    assert [shard_bounds(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [shard_bounds(3, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [shard_bounds(1536, 2, r) for r in range(2)] == [(0, 768), (768, 1536)]


def test_a_share_holds_its_heads_and_units(model):
    """Rank 1 of 2: key/value head 2, query heads 6-8, and MLP units 688-1535, so that
    both ranks' linears hold about as many weights: rank 0's attention has 2 * 6 + 2 * 2
    heads' rows of 64 (q, k, v, o's columns), rank 1's 2 * 3 + 2 * 1, and a unit takes 3
    rows (gate, up, down): 1024 + 3 * 688 = 3088 and 512 + 3 * 848 = 3056. Vocabulary
    ids 24576-49151 of the LM head."""
    s = shard_model(model, 1, 2)
    assert (s.config.num_heads, s.config.num_kv_heads, s.config.intermediate_size) == (3, 1, 848)
    assert s.vocab_bounds == (24576, 49152) and torch.equal(s.lm_head, model.lm_head[24576:])
    layer = s.layers[0]
    assert tuple(layer.wqkv.shape) == ((3 + 2) * 64, 576) and tuple(layer.wo.shape) == (576, 3 * 64)
    assert tuple(layer.w_gate_up.shape) == (2 * 848, 576) and tuple(layer.w_down.shape) == (576, 848)
    from verifier.models.llama import dense

    whole = {n: dense(getattr(model.layers[0], n)) for n in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert torch.equal(layer.wqkv[:192], whole["wqkv"][6 * 64 : 9 * 64])  # q heads 6-8
    assert torch.equal(layer.wqkv[192:256], whole["wqkv"][(9 + 2) * 64 : (9 + 3) * 64])  # k head 2
    assert torch.equal(layer.wqkv[256:], whole["wqkv"][(9 + 3 + 2) * 64 :])  # v head 2
    assert torch.equal(layer.wo, whole["wo"][:, 6 * 64 :])
    assert torch.equal(layer.w_gate_up[:848], whole["w_gate_up"][688:1536])  # gate units 688-1535
    assert torch.equal(layer.w_gate_up[848:], whole["w_gate_up"][1536 + 688 :])  # up units 688-1535
    assert torch.equal(layer.w_down, whole["w_down"][:, 688:])
    assert shard_model(model, 0, 2).config.intermediate_size == 688


def test_a_share_read_layer_by_layer_equals_the_share_of_the_whole_model(model):
    """`load_share` splits each layer as the checkpoint is read; it keeps exactly what
    splitting the loaded model keeps."""
    read = load_share(None, "float32", 1, 2)
    cut = shard_model(model, 1, 2)
    assert read.config == cut.config and read.full_config == model.config
    assert torch.equal(read.lm_head, cut.lm_head) and torch.equal(read.embed, model.embed)
    for a, b in zip(read.layers, cut.layers):
        for name in ("input_norm", "wqkv", "wo", "post_norm", "w_gate_up", "w_down"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_more_ranks_than_key_value_heads_is_refused(model):
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: .*3 key/value heads, got 4"):
        shard_model(model, 0, 4)
    with pytest.raises(InvalidRequestError, match="at least 2 ranks"):
        TensorParallelModel.start(None, "float32", 1, model=model)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: .*got 4"):
        load_share(None, "float32", 0, 4)  # refused at the first layer read


def _mapped(tmp_path, world_size):
    path = tmp_path / "allreduce"
    path.write_bytes(bytes(shm_file_bytes(world_size)))
    return str(path)


def test_the_shared_memory_all_reduce_sums_in_rank_order_call_after_call(tmp_path):
    """Three ranks in threads, 60 calls of varied shapes (transposed views among them):
    every rank ends each call with ((t0 + t1) + t2), bit for bit; a tensor over the slot
    size goes to the fallback, on every rank alike."""
    world, calls = 3, 60
    path = _mapped(tmp_path, world)
    fell_back = []
    ranks = [SharedMemoryAllReduce(path, r, world, fell_back.append, alive=lambda: True) for r in range(world)]
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(1 + i % 7, 576, generator=gen) for i in range(calls)] for _ in range(world)]
    inputs[1][5] = torch.randn(576, 4, generator=gen).t()  # non-contiguous, like MKL's W @ x^T
    inputs[0][5], inputs[2][5] = inputs[0][5][:4], inputs[2][5][:4]
    big = SHM_SLOT_BYTES // 4 // 576 + 1  # rows: one past the slot
    outputs = [[t.clone() for t in ts] for ts in inputs]
    for ts in outputs:
        ts.append(torch.zeros(big, 576))

    def run(r):
        for t in outputs[r]:
            ranks[r](t)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(calls):
        expected = inputs[0][i].clone()
        expected.add_(inputs[1][i])
        expected.add_(inputs[2][i])
        for r in range(world):
            assert torch.equal(outputs[r][i], expected), (i, r)
    assert [t.shape[0] for t in fell_back] == [big] * world
    for r in ranks:
        r.close()


def test_the_shared_memory_gather_puts_every_ranks_columns_side_by_side_on_rank_0(tmp_path):
    """Three ranks in threads: rows of 100,000 floats fit a 2 MiB slot 5 at a time, so 12
    rows pass in three chunks; then 1 row of small widths, then an all-reduce, to check
    that the calls stay in step after gathers."""
    world = 3
    path = _mapped(tmp_path, world)
    ranks = [SharedMemoryAllReduce(path, r, world, None, alive=lambda: True) for r in range(world)]
    gen = torch.Generator().manual_seed(1)
    cases = [(12, [100_000, 99_999, 100_000]), (1, [7, 5, 6])]
    parts = [[torch.randn(R, w[r], generator=gen) for r in range(world)] for R, w in cases]
    got: dict[int, list] = {r: [] for r in range(world)}
    summed = [torch.full((2, 3), float(r + 1)) for r in range(world)]

    def run(r):
        for (R, widths), p in zip(cases, parts):
            got[r].append(ranks[r].gather(p[r], widths))
        ranks[r](summed[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(parts):
        assert torch.equal(got[0][i], torch.cat(p, dim=-1))
        assert got[1][i] is None and got[2][i] is None
    assert all(torch.equal(t, torch.full((2, 3), 6.0)) for t in summed)
    for r in ranks:
        r.close()


def test_the_shared_memory_all_reduce_gives_up_on_a_rank_that_is_gone(tmp_path):
    lone = SharedMemoryAllReduce(_mapped(tmp_path, 2), 0, 2, None, alive=lambda: False)
    with pytest.raises(RuntimeError, match="rank 1 did not reach all-reduce 1: it is gone"):
        lone(torch.ones(2, 3))
    lone.close()


def _pass(m, cache, slots, token_ids, num_tokens, trees=None):
    return m.forward(token_ids, slots, num_tokens, cache, trees=trees)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shares_summed_in_threads_give_the_whole_models_logits(model, world_size):
    """The split's arithmetic alone, without processes: each share runs in a thread, the
    all-reduce adds the shares' partial sums through a barrier, and each share's logits
    cover its own vocabulary ids."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (30,))
    shards = [shard_model(model, r, world_size) for r in range(world_size)]
    barrier, parts = threading.Barrier(world_size), {}

    def reducer(rank):
        def all_reduce(t):
            parts[rank] = t.clone()
            barrier.wait()
            total = sum(parts[r] for r in range(world_size))
            barrier.wait()
            t.copy_(total)
        return all_reduce

    out = {}
    for r, s in enumerate(shards):
        s.all_reduce = reducer(r)

    def run(r):
        cache = shards[r].new_cache(3, 64)
        out[r] = _pass(shards[r], cache, [cache.allocate() for _ in range(3)], ids, [10, 12, 8])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache = model.new_cache(3, 64)
    whole = _pass(model, cache, [cache.allocate() for _ in range(3)], ids, [10, 12, 8])
    logits = torch.cat([out[r] for r in range(world_size)], dim=-1)  # each share's vocabulary, in order
    assert (logits - whole).abs().max().item() < LOGITS_ATOL
    assert torch.equal(logits.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("variant", ["qwen2", "llama3"])
def test_a_tiny_checkpoint_split_over_processes_matches_hf(variant, tmp_path):
    """A seeded random Qwen2 (attention biases: their rows are split with the weights) and
    Llama 3 (RoPE scaling) saved by transformers, split over this process and a worker
    that loads the directory itself: two sequences' logits equal HF's own forward."""
    from tests.verifier.test_model import TINY_VARIANTS, build_tiny

    hf = build_tiny(*TINY_VARIANTS[variant])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    m = TensorParallelModel.start(str(tmp_path), "float32", 2, threads=1)
    try:
        assert (m.config.num_kv_heads, m.full_config.num_kv_heads) == (1, 2)
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (12, 7)]
        cache = m.new_cache(2, 32)
        got = _pass(m, cache, [cache.allocate(), cache.allocate()], torch.cat(prompts), [12, 7])
        with torch.inference_mode():
            want = torch.cat([hf(p.unsqueeze(0)).logits[0] for p in prompts])
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max().item()
    finally:
        m.close()


@pytest.fixture(scope="module")
def split(model):
    """The bundled model over two processes (this one and a worker)."""
    m = TensorParallelModel.start(None, "float32", 2, threads=1, model=model)
    procs = list(m._procs)
    yield m
    m.close()
    assert [p.returncode for p in procs] == [0]  # the worker left on its own once rank 0 closed


def test_a_split_pass_matches_the_whole_model_through_prefill_rounds_and_trees(model, split):
    """Prefills of three sequences, a round of verification widths 1, 5 and 3, a token tree
    on one of them whose accepted path is moved into place (`keep`: the worker's share of
    the cache moves too), then a decode step reading it all."""
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    caches = [m.new_cache(4, 128) for m in (model, split)]
    assert isinstance(caches[1], ShardedKVCache)
    slots = [[c.allocate() for _ in range(3)] for c in caches]

    def both(token_ids, num_tokens, trees=None, after=None):
        out = []
        for m, c, s in zip((model, split), caches, slots):
            out.append(_pass(m, c, s, token_ids, num_tokens, trees))
            if after is not None:
                after(c, s)
        assert (out[0] - out[1]).abs().max().item() < LOGITS_ATOL
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))

    both(torch.randint(0, vocab, (30,)), [10, 12, 8])
    both(torch.randint(0, vocab, (9,)), [1, 5, 3], after=lambda c, s: c.rollback(s[1], 14))
    # Sequence 2: root and 5 nodes, parents as in test_engine's oracle tree; path 0 -> 2 -> 5
    # (tree indices 2, 5 after the root at index 11) is kept and moved to indices 12, 13.
    parents = [-1, 0, 0, 0, 2, 2]
    trees = [None, None, (11, parents)]

    def keep_path(c, s):
        c.keep(s[2], 12, [13, 16])
    both(torch.randint(0, vocab, (8,)), [1, 1, 6], trees, after=keep_path)
    assert caches[1].lens == caches[0].lens
    both(torch.randint(0, vocab, (3,)), [1, 1, 1])


def test_greedy_decoding_split_equals_the_whole_and_speculation_on_it_is_exact(model, split, tokenizer):
    prompts = [p for w in ("code_edit", "summarize", "chat") for p in load_prompts(w, tokenizer)[:2]]
    config = EngineConfig(max_num_seqs=6, max_model_len=512)
    whole = Engine(model, tokenizer, config, None, Controller.off()).generate_sync(prompts, GREEDY)
    plain = Engine(split, tokenizer, config, None, Controller.off()).generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in plain] == [r.token_ids for r in whole]
    engine = Engine(split, tokenizer, config, NgramProposer(), Controller.static(4, ("ngram",)))
    spec = engine.generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.stats.num_accepted > 0
    # Token trees: the accepted path leaves the first-child chain, so the worker's cache
    # share must move its K/V like rank 0's.
    outputs = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    engine = Engine(split, tokenizer, config, {"oracle": _OracleTreeProposer(outputs, model.config.vocab_size)},
                    Controller.static(3, ("oracle",)))
    trees = engine.generate_sync(prompts, GREEDY)
    assert [r.token_ids for r in trees] == [r.token_ids for r in plain]
    assert all(r.stats.accepted == 3 * r.stats.rounds_with_drafts > 0 for r in trees)


@pytest.mark.parametrize("reducer", ["shm", "gloo"])
def test_a_lost_worker_fails_the_pass_with_a_clear_error_and_every_later_one(model, reducer, monkeypatch):
    monkeypatch.setenv("SPLITSPEC_TP_ALLREDUCE", reducer)
    m = TensorParallelModel.start(None, "float32", 2, threads=1, model=model)
    assert isinstance(m.all_reduce, SharedMemoryAllReduce) == (reducer == "shm")
    try:
        cache = m.new_cache(1, 32)
        slot = cache.allocate()
        _pass(m, cache, [slot], torch.tensor([1, 2, 3]), [3])
        worker = m._procs[0]
        worker.kill()
        worker.wait()
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            _pass(m, cache, [slot], torch.tensor([4]), [1])
        with pytest.raises(RuntimeError, match="failed earlier"):
            _pass(m, cache, [slot], torch.tensor([4]), [1])
    finally:
        m.close()
    with pytest.raises(RuntimeError, match="failed earlier"):
        m.new_cache(1, 32)
