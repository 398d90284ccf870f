"""`ProposalSource` over a changing set of proposer replicas: sticky routing, fail open.

One `GrpcProposalSource` (one bidirectional stream) per live replica. Each round the batch
is split by owner and every replica gets one message, all in parallel under the same
per-round deadline, so a round costs one RPC per replica, never one per sequence.

Routing is rendezvous hashing (highest random weight) of `seq_id` over the live replicas:
sticky, and when a replica joins or leaves only the sequences it wins or held move. A
sequence whose owner changed is answered `resync` locally (no RPC) so the engine sends its
full context to the new owner next round; the old owner is told to release it.

Failure is per replica and never fails a request: a replica that errs or misses the
deadline yields empty drafts (k = 0 this round) for its sequences. One that errs (stream
broken, server gone), or misses `late_rounds` deadlines in a row, sits out `cooldown_s`,
during which its sequences hash to the remaining replicas; one late round alone (a pause
of the replica or of the machine) costs only that round. The replica set itself comes from
outside (`set_replicas`), e.g. a discovery loop in `cluster`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Sequence

import numpy as np

from protos.proposal import Proposal, ProposalRequest
from protos.splitspec.v1 import proposer_pb2
from verifier.aio import await_all
from verifier.models.vocab import VocabFingerprint, incompatibility
from verifier.proposer_client import GrpcProposalSource, ProposerLateError, ProposerUnavailableError

logger = logging.getLogger(__name__)


def _weight(seq_id: str, address: str) -> int:
    digest = hashlib.blake2b(f"{address}\x00{seq_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def owner_of(seq_id: str, addresses: Sequence[str]) -> str | None:
    """The replica `seq_id` routes to: the address with the highest hash weight."""
    return max(addresses, key=lambda a: _weight(seq_id, a), default=None)


@dataclasses.dataclass
class RouterStats:
    """Counters since start (exported with the verifier's stats)."""

    num_rounds: int = 0
    num_replica_failures: int = 0  # calls that failed or were late
    num_cooldowns: int = 0  # times a replica was set aside for `cooldown_s`
    num_moved_sequences: int = 0
    num_replica_set_changes: int = 0


def vocab_incompatibility(target: VocabFingerprint, fingerprint: proposer_pb2.TokenizerFingerprint) -> str | None:
    """Why a proposer with `fingerprint` (from its `Info`) cannot draft for `target`, or None."""
    if (fingerprint.token_texts_sha256 == target.token_texts_sha256 and fingerprint.vocab_size == target.vocab_size
            and fingerprint.vocab_type == target.vocab_type):  # the common case: the same tokenizer
        texts = target.token_texts
    else:
        try:
            texts = VocabFingerprint.from_proto(fingerprint).token_texts
        except ValueError as exc:
            return f"its tokenizer fingerprint is unreadable: {exc}"
    theirs = VocabFingerprint(fingerprint.vocab_type, fingerprint.vocab_size,
                              None if fingerprint.bos_token_id < 0 else fingerprint.bos_token_id,
                              tuple(sorted(fingerprint.eos_token_ids)), texts)
    why = incompatibility(target, theirs)
    return None if why is None else f"its vocabulary cannot draft for the target: {why}"


class RoutedProposalSource:
    """Route each sequence to one proposer replica; see the module docstring."""

    def __init__(self, method: str, deadline_s: float = 0.1, cooldown_s: float = 2.0, late_rounds: int = 2,
                 info_timeout_s: float = 2.0, target_vocab: VocabFingerprint | None = None,
                 needs_hidden_states: bool = False, hidden_state_layers: Sequence[int] | None = None) -> None:
        self.method = method
        #: Whether the engine sends this method the target's hidden states (EAGLE).
        self.needs_hidden_states = needs_hidden_states
        #: Which: None for the final states, else the target layers an EAGLE-3 head reads.
        self.hidden_state_layers = tuple(hidden_state_layers) if hidden_state_layers else None
        #: The target's vocabulary: a replica whose `Info` names an incompatible one is refused.
        #: (Not `vocab`: a proposer's `vocab` is its own, which `cluster.local` checks.)
        self.target_vocab = target_vocab
        self.deadline_s = deadline_s
        self.cooldown_s = cooldown_s
        if late_rounds < 1:
            raise ValueError(f"late_rounds must be >= 1, got {late_rounds}")
        self.late_rounds = late_rounds
        self.info_timeout_s = info_timeout_s
        #: address -> why it was refused (e.g. another method behind it)
        self.refused: dict[str, str] = {}
        self.stats = RouterStats()
        self._sources: dict[str, GrpcProposalSource] = {}
        self._down_until: dict[str, float] = {}
        self._late: dict[str, int] = {}  # address -> deadlines missed in a row
        self._owner: dict[str, str] = {}  # seq_id -> address that holds its state

    # ------------------------------------------------------------------ replica set
    @property
    def addresses(self) -> list[str]:
        return sorted(self._sources)

    def live_addresses(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return sorted(a for a in self._sources if self._down_until.get(a, 0.0) <= now)

    @property
    def available(self) -> bool:
        """Whether any replica may take sequences now (the controller plans k = 0 otherwise)."""
        return bool(self.live_addresses())

    async def set_replicas(self, addresses: Sequence[str]) -> bool:
        """Make `addresses` the replica set; return True when it changed.

        A new replica is asked for its `Info` first; one that serves another method, or
        drafts in a vocabulary incompatible with the target's (`verifier.models.vocab`), is
        refused (logged once, listed in `refused`) and never gets traffic. One that does
        not answer `Info` yet is taken anyway: its rounds fail open until it does.
        """
        new = set(addresses)
        old = set(self._sources) | set(self.refused)
        if new == old:
            return False
        for address in old - new:
            self.refused.pop(address, None)
            source = self._sources.pop(address, None)
            self._down_until.pop(address, None)
            self._late.pop(address, None)
            if source is not None:
                await source.close()
        for address in new - old:
            source = GrpcProposalSource(address, self.method, self.deadline_s)
            reason = await self._incompatibility(source)
            if reason is not None:
                logger.error("refusing proposer replica at %s: %s", address, reason)
                self.refused[address] = reason
                await source.close()
                continue
            self._sources[address] = source
        self.stats.num_replica_set_changes += 1
        logger.info("proposer %s replicas: %s", self.method, sorted(self._sources))
        return True

    async def _incompatibility(self, source: GrpcProposalSource) -> str | None:
        try:
            info = await source.info(timeout_s=self.info_timeout_s)
        except Exception:  # not answering yet: fail open, rounds will tell
            return None
        if info.method != self.method:
            return f"it serves method {info.method!r}, this deployment expects {self.method!r}"
        if info.needs_hidden_states and not self.needs_hidden_states:
            return "it needs the target's hidden states, which this deployment does not send for its method"
        theirs = tuple(info.hidden_state_layers) or None
        if info.needs_hidden_states and theirs != self.hidden_state_layers:
            def kind(layers):
                return "the final hidden states" if layers is None else f"the states entering layers {list(layers)}"
            return f"it reads {kind(theirs)}, this verifier sends {kind(self.hidden_state_layers)}"
        if self.target_vocab is not None and info.HasField("tokenizer") and info.tokenizer.vocab_size:
            return vocab_incompatibility(self.target_vocab, info.tokenizer)
        return None

    # ------------------------------------------------------------------ rounds
    async def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        if requests:
            self.stats.num_rounds += 1
        now = time.monotonic()
        live = self.live_addresses(now)
        results: list[Proposal | None] = [None] * len(requests)
        batches: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            address = owner_of(r.seq_id, live)
            if address is None:  # no replica at all: nothing to verify this round
                results[i] = Proposal(r.seq_id, np.zeros(0, np.int32), failed=True)
                continue
            previous = self._owner.get(r.seq_id)
            if previous != address:
                self._owner[r.seq_id] = address
                if previous is not None or r.base_len > 0:
                    # Moved (replica set changed): the new owner lacks the state.
                    self.stats.num_moved_sequences += 1
                    if previous in self._sources:
                        self._sources[previous].release([r.seq_id])
                    if r.base_len > 0:
                        results[i] = Proposal(r.seq_id, np.zeros(0, np.int32), resync=True)
                        continue
            batches.setdefault(address, []).append(i)
        # Replicas with nothing to draft but releases to deliver get an empty message.
        for address, source in self._sources.items():
            if address not in batches and source.has_pending_releases and address in live:
                batches[address] = []
        answers = await await_all([self._sources[a].propose([requests[i] for i in idx]) for a, idx in batches.items()],
                                  return_exceptions=True)
        for (address, idx), answer in zip(batches.items(), answers):
            if isinstance(answer, BaseException):
                self._failed(address, answer)
                answer = [Proposal(requests[i].seq_id, np.zeros(0, np.int32), failed=True) for i in idx]
            else:
                self._late.pop(address, None)
            for i, proposal in zip(idx, answer):
                results[i] = proposal
        return results  # type: ignore[return-value]

    async def flush(self) -> None:
        """Deliver pending releases to replicas that had no round lately (idle engine)."""
        if any(s.has_pending_releases for s in self._sources.values()):
            await self.propose([])

    def release(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            address = self._owner.pop(seq_id, None)
            if address is not None and address in self._sources:
                self._sources[address].release([seq_id])

    def _failed(self, address: str, exc: BaseException) -> None:
        """A call to `address` failed: cool the replica down, unless it was only late and has
        not been late `late_rounds` times in a row."""
        self.stats.num_replica_failures += 1
        if isinstance(exc, ProposerLateError):
            late = self._late[address] = self._late.get(address, 0) + 1
            if late < self.late_rounds:
                logger.warning("%s (%d in a row); its sequences speculate 0 this round", exc, late)
                return
        if not isinstance(exc, ProposerUnavailableError):
            logger.warning("proposer %s at %s failed unexpectedly: %r", self.method, address, exc)
        else:
            logger.warning("%s; its sequences speculate 0 and move for %.1f s", exc, self.cooldown_s)
        self._late.pop(address, None)
        self.stats.num_cooldowns += 1
        self._down_until[address] = time.monotonic() + self.cooldown_s

    async def close(self) -> None:
        for source in self._sources.values():
            await source.close()
        self._sources.clear()
