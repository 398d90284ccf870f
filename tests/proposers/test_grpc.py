"""The n-gram proposer behind real gRPC on loopback, driving the real engine."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest

from cluster.workloads import load_prompts
from protos.proposal import Proposal, ProposalRequest
from proposers.ngram import NgramProposer
from proposers.server import ProposerServicer, start_server
from verifier.engine import Engine, EngineConfig
from verifier.controller import Controller
from verifier.proposer_client import GrpcProposalSource, ProposerUnavailableError
from verifier.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return load_prompts("code_edit", tokenizer)[:3]


@pytest.fixture(scope="module")
def expected(model, tokenizer, prompts):
    plain = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512))
    return [r.token_ids for r in plain.generate_sync(prompts, GREEDY)]


def test_info_and_a_round_trip():
    async def run():
        server, port = await start_server(ProposerServicer(NgramProposer(), max_k=8))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="ngram")
        try:
            info = await client.info()
            assert info.method == "ngram" and info.max_k == 8 and not info.needs_hidden_states
            ctx = np.array([5, 6, 7, 8, 5, 6], dtype=np.int32)
            (p,) = await client.propose([ProposalRequest("s", 0, ctx, k=2)])
            assert p.draft_token_ids.tolist() == [7, 8] and p.draft_probs is None and not p.resync
            (p,) = await client.propose([ProposalRequest("unknown", 3, ctx[:1], k=2)])
            assert p.resync
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(run())


class _TreeSource:
    """Answers every request with the same small tree (and a chain for seq_id "chain")."""

    method = "eagle"

    async def propose(self, requests):
        from protos.proposal import Proposal

        return [Proposal(r.seq_id, np.array([7, 8, 9], np.int32),
                         draft_parents=None if r.seq_id == "chain" else np.array([-1, -1, 1], np.int32))
                for r in requests]

    def release(self, seq_ids):
        pass


def test_a_token_tree_crosses_the_wire():
    async def run():
        server, port = await start_server(ProposerServicer(_TreeSource(), max_k=8))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="eagle")
        try:
            tree, chain = await client.propose([ProposalRequest("tree", 0, np.array([5, 6], np.int32), k=2),
                                                ProposalRequest("chain", 0, np.array([5, 6], np.int32), k=2)])
            assert tree.draft_token_ids.tolist() == [7, 8, 9] and tree.draft_parents.tolist() == [-1, -1, 1]
            assert chain.draft_token_ids.tolist() == [7, 8, 9] and chain.draft_parents is None
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(run())


class _RefusesSeq:
    """An n-gram proposer that rejects one seq_id's deltas as malformed (ValueError)."""

    method = "ngram"

    def __init__(self, bad: str) -> None:
        self.inner, self.bad = NgramProposer(), bad

    async def propose(self, requests):
        if any(r.seq_id == self.bad for r in requests):
            raise ValueError(f"malformed delta for {self.bad}")
        return await self.inner.propose(requests)

    def release(self, seq_ids):
        self.inner.release(seq_ids)


def test_idle_sequences_are_dropped_and_bad_deltas_resync():
    """A sequence no round mentions for idle_ttl_s is forgotten (its verifier died); a
    malformed delta is answered with resync and the stream stays open."""
    async def run():
        source = _RefusesSeq("bad")
        proposer = source.inner
        server, port = await start_server(ProposerServicer(source, max_k=8, idle_ttl_s=0.2))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="ngram", deadline_s=1.0)
        ctx = np.array([5, 6, 7, 8, 5, 6], dtype=np.int32)
        try:
            await client.propose([ProposalRequest("a", 0, ctx, k=2), ProposalRequest("b", 0, ctx, k=2)])
            assert proposer.num_sequences == 2
            await asyncio.sleep(0.1)
            await client.propose([ProposalRequest("b", 6, ctx[:0], k=2)])
            await asyncio.sleep(0.15)  # "a" idle 0.25 s > 0.2 s, "b" idle 0.15 s
            await client.propose([ProposalRequest("c", 0, ctx, k=2)])
            assert proposer.context_token_ids("a") is None
            assert proposer.context_token_ids("b") is not None and proposer.num_sequences == 2
            p = await client.propose([ProposalRequest("bad", 0, ctx, k=2), ProposalRequest("c", 6, ctx[:0], k=2)])
            assert all(x.resync and x.draft_token_ids.size == 0 for x in p)
            (p,) = await client.propose([ProposalRequest("c", 0, ctx, k=2)])  # same stream still works
            assert p.draft_token_ids.tolist() == [7, 8]
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(run())


async def _generate_through(source, server, model, tokenizer, prompts):
    """Greedy generation of `prompts` with static k = 4 drafts from `source`; closes both."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), source, Controller.static(4))
    try:
        return engine, await engine.generate_all(prompts, GREEDY)
    finally:
        await source.close()
        await server.stop(0)


def test_engine_over_grpc_is_exact(model, tokenizer, prompts, expected):
    async def run():
        server, port = await start_server(ProposerServicer(NgramProposer(), max_k=8))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="ngram", deadline_s=1.0)
        return await _generate_through(client, server, model, tokenizer, prompts)

    engine, results = asyncio.run(run())
    assert [r.token_ids for r in results] == expected
    assert engine.stats.num_accepted > 0 and engine.stats.num_proposer_failures == 0


def test_proposer_killed_and_restarted_mid_generation(model, tokenizer, prompts, expected):
    """Fail open while the server is gone; after a restart (state lost) resync, speculate again."""

    async def run():
        proposer = NgramProposer()
        server, port = await start_server(ProposerServicer(proposer, max_k=8))
        client = GrpcProposalSource(f"127.0.0.1:{port}", method="ngram", deadline_s=0.5)
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=3, max_model_len=512), client, Controller.static(4))
        task = asyncio.ensure_future(engine.generate_all(prompts, GREEDY))
        while engine.stats.num_steps < 4:
            await asyncio.sleep(0.01)
        await server.stop(0)  # the replica dies
        failures_before = engine.stats.num_proposer_failures
        while engine.stats.num_proposer_failures < failures_before + 2:
            await asyncio.sleep(0.01)
        accepted_while_down = engine.stats.num_accepted
        server, _ = await start_server(ProposerServicer(NgramProposer(), max_k=8), port=port)  # restarted, empty
        results = await task
        await client.close()
        await server.stop(0)
        return engine, results, accepted_while_down

    engine, results, accepted_while_down = asyncio.run(run())
    assert [r.token_ids for r in results] == expected
    s = engine.stats
    assert s.num_proposer_failures >= 2 and s.num_resyncs >= 1
    assert s.num_accepted > accepted_while_down  # speculation resumed after the restart


class _StallingNgram(NgramProposer):
    """An n-gram proposer whose call number `stall_at` (1-based) stalls 1 s and then answers
    empty without taking its deltas (a replica paused while the message was in flight)."""

    def __init__(self, stall_at: int) -> None:
        super().__init__()
        self.stall_at, self.num_calls = stall_at, 0

    async def propose(self, requests):
        self.num_calls += 1
        if self.num_calls == self.stall_at:
            await asyncio.sleep(1.0)
            return [Proposal(r.seq_id, np.zeros(0, np.int32)) for r in requests]
        return await super().propose(requests)


def test_a_late_round_through_the_router_costs_that_round_only(model, tokenizer, prompts, expected):
    """The replica misses one round's deadline mid-generation: that round speculates 0, and
    the next round's deltas start where the lost one's did, so the replica drafts again at
    once (no resync, no cooldown) and the output is the target's own."""
    from verifier.routing import RoutedProposalSource

    async def run():
        proposer = _StallingNgram(stall_at=5)
        server, port = await start_server(ProposerServicer(proposer, max_k=8))
        router = RoutedProposalSource("ngram", deadline_s=0.5, cooldown_s=60.0)
        await router.set_replicas([f"127.0.0.1:{port}"])
        return *await _generate_through(router, server, model, tokenizer, prompts), router, proposer

    engine, results, router, proposer = asyncio.run(run())
    assert [r.token_ids for r in results] == expected
    assert proposer.num_calls > 6 and router.stats.num_replica_failures == 1 and router.stats.num_cooldowns == 0
    assert engine.stats.num_resyncs == 0
    assert engine.stats.num_accepted > 0


_FIRST_MESSAGE = """
import asyncio, json, sys
import cluster.deployments  # what a proposer replica imports before its first message
from proposers.registry import build_proposer
from proposers.server import ProposerServicer
from protos.splitspec.v1 import proposer_pb2

async def main():
    servicer = ProposerServicer(build_proposer("ngram", {}), max_k=8)
    message = proposer_pb2.ProposeRequest(round_id=1, sequences=[proposer_pb2.SequenceDelta(
        seq_id="a", base_len=0, append_token_ids=[1, 2, 3, 1, 2], k=2,
        trace_context={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})])

    async def one():
        yield message

    before = set(sys.modules)
    answers = [a async for a in servicer.Propose(one(), None)]
    print(json.dumps({"drafts": list(answers[0].sequences[0].draft_token_ids),
                      "imported": sorted(set(sys.modules) - before)}))

asyncio.run(main())
"""


def test_a_fresh_n_gram_replicas_first_message_imports_nothing():
    """A fresh replica answers its first round as fast as the others: handling it imports no
    module (torch, imported there once, took 2 s, past the round deadline). Counted in a
    process of its own, from what a proposer replica has imported when it starts."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_MESSAGE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    # [1 2 3 1 2]: the 2-gram [1 2] occurs at 0, so the draft is what followed it: [3 1].
    assert answer == {"drafts": [3, 1], "imported": []}


def test_unreachable_proposer_raises_within_the_deadline():
    async def run():
        client = GrpcProposalSource("127.0.0.1:1", method="ngram", deadline_s=0.2)
        start = time.monotonic()
        with pytest.raises(ProposerUnavailableError):
            await client.propose([ProposalRequest("s", 0, np.array([1, 2], np.int32), k=2)])
        await client.close()
        return time.monotonic() - start

    assert asyncio.run(run()) < 2.0


def _serve_ngram_forever(port_queue) -> None:
    """Child process: an n-gram proposer server, as a proposer replica runs it."""
    async def main():
        server, port = await start_server(ProposerServicer(NgramProposer(), max_k=8))
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def test_round_trip_latency_is_reported():
    """Not a timed assertion: prints p50/p99 of one batched round (8 sequences, 300-token
    contexts, 2 new tokens each per round, k = 4) on loopback, with the server in its own
    process as in a deployment, through the plain stream client and through the router."""
    import multiprocessing

    from verifier.routing import RoutedProposalSource

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_serve_ngram_forever, args=(ports,), daemon=True)
    child.start()

    async def run(client, tag):
        rng = np.random.default_rng(0)
        contexts = {f"{tag}{i}": rng.integers(0, 500, 300).astype(np.int32) for i in range(8)}
        synced = {s: 0 for s in contexts}
        times = []
        for step in range(400):
            reqs = []
            for s, c in contexts.items():
                contexts[s] = c = np.append(c, rng.integers(0, 500, 2).astype(np.int32))
                reqs.append(ProposalRequest(s, synced[s], c[synced[s]:], k=4))
                synced[s] = len(c)
            t = time.perf_counter()
            proposals = await client.propose(reqs)
            times.append(time.perf_counter() - t)
            assert not any(p.resync for p in proposals)
        await client.close()
        return sorted(times[20:])

    async def routed(address):
        router = RoutedProposalSource("ngram", deadline_s=1.0)
        await router.set_replicas([address])
        return await run(router, "r")

    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        for label, times in (
            ("stream client", asyncio.run(run(GrpcProposalSource(address, method="ngram", deadline_s=1.0), "s"))),
            ("router", asyncio.run(routed(address))),
        ):
            p50, p99 = statistics.median(times), times[int(0.99 * len(times)) - 1]
            print(f"proposer round trip ({label}), 8 sequences, server in another process, loopback: "
                  f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
            assert p50 > 0
    finally:
        child.kill()  # the process this test started
        child.join(10)
