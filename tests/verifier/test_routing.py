"""`RoutedProposalSource` over real n-gram proposer servers (grpc.aio on loopback).

Contexts are built from a 4-token cycle `b+1, b+2, b+3, b+4, b+1, ...` (a different `b`
per sequence, so answers cannot be mixed up between sequences). With the proposer's
default `min_n=2, max_n=4` and k = 3 the draft is always the next 3 tokens of the
cycle, worked out by hand from the lookup rule (longest suffix first, latest earlier
occurrence that ends before the last position):

  L = 7, [1 2 3 4 1 2 3]: the 4-gram [4 1 2 3] has no earlier copy; the 3-gram [1 2 3]
         occurs at s=0, so the draft is ctx[3:6] = [4 1 2].
  L = 8, [1 2 3 4 1 2 3 4]: [1 2 3 4] at s=0 -> ctx[4:7] = [1 2 3].
  L = 9, [.. 4 1]: [2 3 4 1] at s=1 -> ctx[5:8] = [2 3 4].
  L = 10, [.. 1 2]: [3 4 1 2] at s=2 -> ctx[6:9] = [3 4 1].
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np

from protos.proposal import Proposal, ProposalRequest
from proposers.ngram import NgramProposer
from proposers.server import ProposerServicer, start_server
from verifier.routing import RoutedProposalSource, owner_of

K = 3


# ---------------------------------------------------------------------- helpers
class CountingSource:
    """A `ProposalSource` that records each `propose` call's seq ids, then defers to n-gram."""

    method = "ngram"

    def __init__(self) -> None:
        self.inner = NgramProposer()
        self.calls: list[list[str]] = []
        #: Seconds the next calls stall before answering empty, their deltas lost (a paused replica).
        self.stalls: list[float] = []

    async def propose(self, requests):
        self.calls.append([r.seq_id for r in requests])
        if self.stalls:
            await asyncio.sleep(self.stalls.pop(0))
            return [Proposal(r.seq_id, np.zeros(0, np.int32)) for r in requests]
        return await self.inner.propose(requests)

    def release(self, seq_ids):
        self.inner.release(seq_ids)


@dataclasses.dataclass
class Replica:
    address: str
    server: grpc.aio.Server
    source: CountingSource


async def _start_replicas(n: int) -> list[Replica]:
    replicas = []
    for _ in range(n):
        source = CountingSource()
        server, port = await start_server(ProposerServicer(source, max_k=8), "127.0.0.1", 0)
        replicas.append(Replica(f"127.0.0.1:{port}", server, source))
    return replicas


async def _shutdown(router: RoutedProposalSource, replicas: list[Replica]) -> None:
    await router.close()
    for r in replicas:
        await r.server.stop(0)


def _cycle(b: int, start: int, n: int) -> list[int]:
    """Tokens start .. start+n-1 of the cycle b+1, b+2, b+3, b+4, b+1, ..."""
    return [b + 1 + (i % 4) for i in range(start, start + n)]


def _base(j: int) -> int:
    return 10 * (j + 1)


def _request(seq_id: str, j: int, base_len: int, new_len: int) -> ProposalRequest:
    """Context of sequence j grows (or is cut back) to `new_len`; tokens after base_len are sent."""
    append = np.array(_cycle(_base(j), base_len, new_len - base_len), dtype=np.int32)
    return ProposalRequest(seq_id, base_len, append, k=K)


def _pick_ids(wanted) -> list[str]:
    """Seq ids for a test: for each (predicate, count) the first `count` ids matching it."""
    picked: list[str] = []
    for predicate, count in wanted:
        found = [s for s in (f"seq-{i}" for i in range(10_000)) if s not in picked and predicate(s)][:count]
        assert len(found) == count
        picked += found
    return picked


def _calls(replicas: list[Replica]) -> list[int]:
    return [len(r.source.calls) for r in replicas]


# ---------------------------------------------------------------------- owner_of
ADDRESSES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
SEQ_IDS = [f"req-{i}" for i in range(300)]


def test_owner_of_is_deterministic_and_spreads_load():
    owners = [owner_of(s, ADDRESSES) for s in SEQ_IDS]
    assert owners == [owner_of(s, ADDRESSES) for s in SEQ_IDS]
    assert owners == [owner_of(s, list(reversed(ADDRESSES))) for s in SEQ_IDS]  # order of the set is irrelevant
    for address in ADDRESSES:
        assert 50 <= owners.count(address) <= 150, (address, owners.count(address))
    assert owner_of("req-0", []) is None
    assert owner_of("req-0", ["only:1"]) == "only:1"


def test_owner_of_moves_only_what_it_must():
    before = {s: owner_of(s, ADDRESSES) for s in SEQ_IDS}
    fourth = "10.0.0.4:50051"
    after = {s: owner_of(s, ADDRESSES + [fourth]) for s in SEQ_IDS}
    moved = [s for s in SEQ_IDS if after[s] != before[s]]
    assert moved and all(after[s] == fourth for s in moved)
    assert 30 <= len(moved) <= 120  # about a quarter of 300
    # Removing an address moves exactly the sequences it owned, and nothing else.
    removed = ADDRESSES[1]
    rest = [a for a in ADDRESSES if a != removed]
    for s in SEQ_IDS:
        new = owner_of(s, rest)
        if before[s] == removed:
            assert new in rest
        else:
            assert new == before[s]


# ---------------------------------------------------------------------- real servers
def test_a_round_is_one_rpc_per_replica_and_drafts_follow_deltas():
    async def run():
        replicas = await _start_replicas(2)
        a, b = (r.address for r in replicas)
        router = RoutedProposalSource("ngram", deadline_s=2.0, cooldown_s=60.0)
        try:
            assert await router.set_replicas([a, b]) is True
            assert await router.set_replicas([b, a]) is False
            ids = _pick_ids([(lambda s: owner_of(s, [a, b]) == a, 4), (lambda s: owner_of(s, [a, b]) == b, 4)])
            owned = {r.address: {s for s in ids if owner_of(s, [a, b]) == r.address} for r in replicas}

            # Round 1: full contexts of 7 tokens.
            proposals = await router.propose([_request(s, j, 0, 7) for j, s in enumerate(ids)])
            assert _calls(replicas) == [1, 1]
            assert [len(r.source.calls[-1]) for r in replicas] == [4, 4]
            for r in replicas:
                assert set(r.source.calls[-1]) == owned[r.address]
            for j, (s, p) in enumerate(zip(ids, proposals)):
                assert p.seq_id == s and not p.resync and p.draft_probs is None
                assert p.draft_token_ids.tolist() == _cycle(_base(j), 7, K)  # e.g. [14, 11, 12] for b=10
            assert proposals[0].draft_token_ids.tolist() == [14, 11, 12]
            # The state sits on the owner only.
            for r in replicas:
                for j, s in enumerate(ids):
                    held = r.source.inner.context_token_ids(s)
                    if s in owned[r.address]:
                        assert held.tolist() == _cycle(_base(j), 0, 7)
                    else:
                        assert held is None

            # Round 2: a delta of two tokens on top of the 7 held.
            proposals = await router.propose([_request(s, j, 7, 9) for j, s in enumerate(ids)])
            assert _calls(replicas) == [2, 2]
            for j, p in enumerate(proposals):
                assert not p.resync and p.draft_token_ids.tolist() == _cycle(_base(j), 9, K)
            assert proposals[0].draft_token_ids.tolist() == [12, 13, 14]

            # Round 3: cut back to 6 (rejected drafts) and append one token: length 7 again.
            proposals = await router.propose([
                ProposalRequest(s, 6, np.array([_base(j) + 3], np.int32), k=K) for j, s in enumerate(ids)
            ])
            assert _calls(replicas) == [3, 3]
            for j, (s, p) in enumerate(zip(ids, proposals)):
                assert not p.resync and p.draft_token_ids.tolist() == _cycle(_base(j), 7, K)
                owner = next(r for r in replicas if s in owned[r.address])
                assert owner.source.inner.context_token_ids(s).tolist() == _cycle(_base(j), 0, 7)
            assert router.stats.num_rounds == 3 and router.stats.num_moved_sequences == 0
            assert router.stats.num_replica_failures == 0
        finally:
            await _shutdown(router, replicas)

    asyncio.run(run())


def test_a_dead_replica_fails_open_then_its_sequences_move():
    async def run():
        replicas = await _start_replicas(2)
        dead, live = replicas
        addrs = [dead.address, live.address]
        router = RoutedProposalSource("ngram", deadline_s=2.0, cooldown_s=60.0)
        try:
            await router.set_replicas(addrs)
            ids = _pick_ids([(lambda s: owner_of(s, addrs) == dead.address, 4),
                             (lambda s: owner_of(s, addrs) == live.address, 4)])
            on_dead, on_live = set(ids[:4]), set(ids[4:])

            proposals = await router.propose([_request(s, j, 0, 7) for j, s in enumerate(ids)])
            assert all(p.draft_token_ids.size == K for p in proposals)

            await dead.server.stop(0)
            # Round 2: no exception; the dead replica's sequences speculate 0, the others draft.
            proposals = await router.propose([_request(s, j, 7, 8) for j, s in enumerate(ids)])
            for j, (s, p) in enumerate(zip(ids, proposals)):
                assert not p.resync
                if s in on_dead:
                    assert p.draft_token_ids.size == 0
                else:
                    assert p.draft_token_ids.tolist() == _cycle(_base(j), 8, K)
            assert router.stats.num_replica_failures == 1 and router.stats.num_cooldowns == 1  # at once
            assert router.live_addresses() == [live.address]
            assert len(live.source.calls) == 2 and set(live.source.calls[-1]) == on_live

            # Round 3: the dead replica cools down; its sequences move to the live one and,
            # having base_len > 0, are answered resync locally (no RPC carries them).
            proposals = await router.propose([_request(s, j, 8, 9) for j, s in enumerate(ids)])
            for j, (s, p) in enumerate(zip(ids, proposals)):
                if s in on_dead:
                    assert p.resync and p.draft_token_ids.size == 0
                else:
                    assert not p.resync and p.draft_token_ids.tolist() == _cycle(_base(j), 9, K)
            assert len(live.source.calls) == 3 and set(live.source.calls[-1]) == on_live
            assert router.stats.num_moved_sequences == 4
            assert router.stats.num_replica_failures == 1  # not retried while cooling down

            # Round 4: full contexts for the moved sequences, deltas for the others.
            proposals = await router.propose([
                _request(s, j, 0, 9) if s in on_dead else _request(s, j, 9, 10) for j, s in enumerate(ids)
            ])
            for j, (s, p) in enumerate(zip(ids, proposals)):
                assert not p.resync
                assert p.draft_token_ids.tolist() == _cycle(_base(j), 9 if s in on_dead else 10, K)
            assert len(live.source.calls) == 4 and set(live.source.calls[-1]) == set(ids)
            for j, s in enumerate(ids[:4]):
                assert live.source.inner.context_token_ids(s).tolist() == _cycle(_base(j), 0, 9)
            assert router.stats.num_moved_sequences == 4 and router.stats.num_replica_failures == 1
        finally:
            await _shutdown(router, replicas)

    asyncio.run(run())


def test_one_late_round_costs_only_itself_and_late_rounds_in_a_row_cool_the_replica_down():
    async def run():
        (replica,) = await _start_replicas(1)
        router = RoutedProposalSource("ngram", deadline_s=0.3, cooldown_s=60.0, late_rounds=2)
        try:
            await router.set_replicas([replica.address])
            ids = ["s0", "s1"]
            # Round 1: the replica stalls past the deadline. The round fails open (failed:
            # the deltas may not have arrived), and the replica stays live.
            replica.source.stalls = [1.0]
            proposals = await router.propose([_request(s, j, 0, 7) for j, s in enumerate(ids)])
            assert all(p.failed and p.draft_token_ids.size == 0 and not p.resync for p in proposals)
            assert router.stats.num_replica_failures == 1 and router.stats.num_cooldowns == 0
            assert router.live_addresses() == [replica.address]

            # Round 2: the deltas start where round 1's did (as the engine sends them after a
            # failed answer); the replica answers in time and drafts.
            proposals = await router.propose([_request(s, j, 0, 8) for j, s in enumerate(ids)])
            for j, p in enumerate(proposals):
                assert not p.failed and not p.resync and p.draft_token_ids.tolist() == _cycle(_base(j), 8, K)

            # Rounds 3 and 4: late twice in a row (the count restarted after round 2's answer):
            # the second sets the replica aside for cooldown_s.
            replica.source.stalls = [1.0, 1.0]
            proposals = await router.propose([_request(s, j, 8, 9) for j, s in enumerate(ids)])
            assert all(p.failed for p in proposals) and router.live_addresses() == [replica.address]
            assert router.stats.num_cooldowns == 0
            proposals = await router.propose([_request(s, j, 8, 9) for j, s in enumerate(ids)])
            assert all(p.failed for p in proposals) and router.live_addresses() == []
            assert router.stats.num_replica_failures == 3 and router.stats.num_cooldowns == 1

            # Round 5: no live replica, so no call; every sequence fails open.
            proposals = await router.propose([_request(s, j, 8, 9) for j, s in enumerate(ids)])
            assert all(p.failed and p.draft_token_ids.size == 0 for p in proposals)
            assert len(replica.source.calls) == 4 and router.stats.num_replica_failures == 3
        finally:
            await _shutdown(router, [replica])

    asyncio.run(run())


def test_a_new_replica_takes_over_only_the_sequences_it_wins():
    async def run():
        replicas = await _start_replicas(3)
        a, b, c = (r.address for r in replicas)
        router = RoutedProposalSource("ngram", deadline_s=2.0, cooldown_s=60.0)
        try:
            await router.set_replicas([a, b])
            two, three = [a, b], [a, b, c]
            moves = lambda s: owner_of(s, two) != owner_of(s, three)  # noqa: E731
            ids = _pick_ids([
                (lambda s: owner_of(s, two) == a and moves(s), 2),
                (lambda s: owner_of(s, two) == b and moves(s), 2),
                (lambda s: owner_of(s, two) == a and not moves(s), 2),
                (lambda s: owner_of(s, two) == b and not moves(s), 2),
            ])
            moved = set(ids[:4])
            await router.propose([_request(s, j, 0, 7) for j, s in enumerate(ids)])
            assert _calls(replicas) == [1, 1, 0]

            assert await router.set_replicas(three) is True
            assert router.stats.num_replica_set_changes == 2
            proposals = await router.propose([_request(s, j, 7, 8) for j, s in enumerate(ids)])
            for j, (s, p) in enumerate(zip(ids, proposals)):
                if s in moved:
                    assert p.resync and p.draft_token_ids.size == 0
                else:
                    assert not p.resync and p.draft_token_ids.tolist() == _cycle(_base(j), 8, K)
            assert router.stats.num_moved_sequences == 4
            # Moved sequences were answered locally: c got nothing; a and b only their stayers,
            # and the old owners were told to forget the moved ones in the same message.
            assert _calls(replicas) == [2, 2, 0]
            assert set(replicas[0].source.calls[-1]) == set(ids[4:6])
            assert set(replicas[1].source.calls[-1]) == set(ids[6:8])
            for s in moved:
                assert all(r.source.inner.context_token_ids(s) is None for r in replicas)

            proposals = await router.propose([
                _request(s, j, 0, 8) if s in moved else _request(s, j, 8, 9) for j, s in enumerate(ids)
            ])
            for j, (s, p) in enumerate(zip(ids, proposals)):
                assert not p.resync
                assert p.draft_token_ids.tolist() == _cycle(_base(j), 8 if s in moved else 9, K)
            assert _calls(replicas) == [3, 3, 1] and set(replicas[2].source.calls[-1]) == moved
            assert replicas[2].source.inner.num_sequences == 4
            assert router.stats.num_moved_sequences == 4
        finally:
            await _shutdown(router, replicas)

    asyncio.run(run())


def test_a_replica_serving_another_method_is_refused():
    async def run():
        replicas = await _start_replicas(1)
        other = CountingSource()
        other.method = "draft"
        server, port = await start_server(ProposerServicer(other, max_k=8), "127.0.0.1", 0)
        wrong = f"127.0.0.1:{port}"
        router = RoutedProposalSource("ngram", deadline_s=1.0)
        try:
            assert await router.set_replicas([replicas[0].address, wrong])
            assert router.addresses == [replicas[0].address]
            assert "'draft'" in router.refused[wrong] and "'ngram'" in router.refused[wrong]
            assert not await router.set_replicas([replicas[0].address, wrong])  # not asked again
            requests = [_request(f"seq-{j}", j, 0, 8) for j in range(4)]
            await router.propose(requests)
            assert other.calls == [] and len(replicas[0].source.calls) == 1
            assert await router.set_replicas([replicas[0].address])  # gone: forgotten
            assert router.refused == {}
        finally:
            await server.stop(0)
            await _shutdown(router, replicas)

    asyncio.run(run())


def test_a_replica_reading_other_hidden_states_is_refused():
    """A verifier set up to send the states entering layers 2, 15 and 27 (an EAGLE-3 head)
    refuses a replica whose `Info` asks for the final states or for other layers, and takes
    one that asks for exactly those."""
    async def run():
        servers, addresses = [], {}
        for name, layers in (("same", (2, 15, 27)), ("final", None), ("other", (2, 15, 28))):
            source = CountingSource()
            source.method, source.needs_hidden_states, source.hidden_state_layers = "eagle", True, layers
            server, port = await start_server(ProposerServicer(source, max_k=4), "127.0.0.1", 0)
            servers.append(server)
            addresses[name] = f"127.0.0.1:{port}"
        router = RoutedProposalSource("eagle", deadline_s=1.0, needs_hidden_states=True,
                                      hidden_state_layers=(2, 15, 27))
        try:
            await router.set_replicas(sorted(addresses.values()))
            assert router.addresses == [addresses["same"]]
            assert router.refused == {
                addresses["final"]: "it reads the final hidden states, this verifier sends the states entering "
                                    "layers [2, 15, 27]",
                addresses["other"]: "it reads the states entering layers [2, 15, 28], this verifier sends the "
                                    "states entering layers [2, 15, 27]",
            }
        finally:
            await router.set_replicas([])
            for server in servers:
                await server.stop(0)

    asyncio.run(run())


def test_release_reaches_the_owner():
    async def run():
        replicas = await _start_replicas(2)
        a, b = (r.address for r in replicas)
        router = RoutedProposalSource("ngram", deadline_s=2.0, cooldown_s=60.0)
        try:
            await router.set_replicas([a, b])
            ids = _pick_ids([(lambda s: owner_of(s, [a, b]) == a, 4), (lambda s: owner_of(s, [a, b]) == b, 4)])
            await router.propose([_request(s, j, 0, 7) for j, s in enumerate(ids)])
            ra, rb = replicas
            assert ra.source.inner.num_sequences == 4 and rb.source.inner.num_sequences == 4

            # Released, then delivered by flush() (an idle engine): one message to a only.
            router.release([ids[0]])
            assert ra.source.inner.num_sequences == 4  # not sent yet
            await router.flush()
            assert ra.source.inner.num_sequences == 3 and ra.source.inner.context_token_ids(ids[0]) is None
            assert rb.source.inner.num_sequences == 4
            assert _calls(replicas) == [2, 1] and ra.source.calls[-1] == []
            await router.flush()  # nothing pending: no message
            assert _calls(replicas) == [2, 1]

            # Released, then delivered by the next round, even though that round has no
            # sequence for a (a gets an empty message carrying the release).
            router.release([ids[1]])
            proposals = await router.propose([_request(s, j, 7, 8) for j, s in enumerate(ids) if j >= 4])
            assert [p.draft_token_ids.tolist() for p in proposals] == [_cycle(_base(j), 8, K) for j in range(4, 8)]
            assert ra.source.inner.num_sequences == 2 and ra.source.inner.context_token_ids(ids[1]) is None
            assert _calls(replicas) == [3, 2] and ra.source.calls[-1] == []

            # A sequence on b, released and delivered with b's next round.
            router.release([ids[4]])
            await router.propose([_request(s, j, 8, 9) for j, s in enumerate(ids) if j >= 5])
            assert rb.source.inner.num_sequences == 3 and rb.source.inner.context_token_ids(ids[4]) is None
            assert _calls(replicas) == [3, 3]
            router.release([ids[4]])  # unknown by now: nothing to send
            await router.flush()
            assert _calls(replicas) == [3, 3]
        finally:
            await _shutdown(router, replicas)

    asyncio.run(run())
