"""Vocabulary fingerprints, and whether a proposer's vocabulary can draft for the target.

A proposer drafts token ids; the verifier checks them against its own model's ids. That is
only lossless *and* useful when both sides mean the same text by each id, so the verifier
compares fingerprints when it first sees a proposer (DESIGN.md, "Contracts: Proposer
RPC") with the rules of llama.cpp's speculative example:

- same vocabulary type (e.g. "gpt2", byte-level BPE);
- same BOS id, and the same EOS ids;
- sizes that differ by at most `MAX_SIZE_DIFFERENCE` (padding rows of an embedding);
- equal token texts from id `FIRST_COMPARED_ID` up to the smaller size (ids 0-4 are
  special tokens that families rename freely).

`incompatibility` returns None or a sentence that names the first rule broken, e.g.
``token 1234 differs: target 'Ġhello', proposer 'Ġhallo'``.

Both the verifier (routing) and the proposers (their `Info`) use this module, which is why
it lives with the shared model code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib

from protos.splitspec.v1 import proposer_pb2
from verifier.models.tokenizer import Tokenizer

FIRST_COMPARED_ID = 5
MAX_SIZE_DIFFERENCE = 128


@dataclasses.dataclass(frozen=True)
class VocabFingerprint:
    vocab_type: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # sorted
    #: Texts of ids FIRST_COMPARED_ID .. vocab_size - 1 (ids 0-4 are not compared).
    token_texts: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "VocabFingerprint":
        backend = tokenizer.backend
        texts = tuple(backend.id_to_token(i) or "" for i in range(FIRST_COMPARED_ID, tokenizer.vocab_size))
        return cls(tokenizer.vocab_type, tokenizer.vocab_size, tokenizer.bos_token_id,
                   tuple(sorted(tokenizer.eos_token_ids)), texts)

    @functools.cached_property
    def _texts_blob(self) -> bytes:
        return b"".join(t.encode("utf-8") + b"\0" for t in self.token_texts)

    @functools.cached_property
    def token_texts_sha256(self) -> str:
        return hashlib.sha256(self._texts_blob).hexdigest()

    def to_proto(self) -> proposer_pb2.TokenizerFingerprint:
        return proposer_pb2.TokenizerFingerprint(
            vocab_type=self.vocab_type, vocab_size=self.vocab_size,
            bos_token_id=-1 if self.bos_token_id is None else self.bos_token_id,
            eos_token_ids=list(self.eos_token_ids), token_texts_sha256=self.token_texts_sha256,
            token_texts_zlib=zlib.compress(self._texts_blob, 6),
        )

    @classmethod
    def from_proto(cls, fp: proposer_pb2.TokenizerFingerprint) -> "VocabFingerprint":
        """Raises `ValueError` when the texts are missing, corrupt or do not match their hash."""
        try:
            blob = zlib.decompress(fp.token_texts_zlib)
        except zlib.error as exc:
            raise ValueError(f"tokenizer.token_texts_zlib is not zlib data: {exc}") from None
        if hashlib.sha256(blob).hexdigest() != fp.token_texts_sha256:
            raise ValueError("tokenizer.token_texts_zlib does not match tokenizer.token_texts_sha256")
        texts = blob.split(b"\0")[:-1] if blob else []
        if len(texts) != max(fp.vocab_size - FIRST_COMPARED_ID, 0):
            raise ValueError(f"tokenizer.token_texts_zlib holds {len(texts)} texts for vocab_size {fp.vocab_size}")
        return cls(fp.vocab_type, fp.vocab_size, None if fp.bos_token_id < 0 else fp.bos_token_id,
                   tuple(sorted(fp.eos_token_ids)), tuple(t.decode("utf-8") for t in texts))


def incompatibility(target: VocabFingerprint, proposer: VocabFingerprint) -> str | None:
    """None when `proposer` may draft for `target`, else the first rule it breaks."""
    if target.vocab_type != proposer.vocab_type:
        return f"vocabulary type differs: target {target.vocab_type!r}, proposer {proposer.vocab_type!r}"
    if target.bos_token_id != proposer.bos_token_id:
        return f"BOS id differs: target {target.bos_token_id}, proposer {proposer.bos_token_id}"
    if target.eos_token_ids != proposer.eos_token_ids:
        return f"EOS ids differ: target {list(target.eos_token_ids)}, proposer {list(proposer.eos_token_ids)}"
    if abs(target.vocab_size - proposer.vocab_size) > MAX_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by more than {MAX_SIZE_DIFFERENCE}: "
                f"target {target.vocab_size}, proposer {proposer.vocab_size}")
    for i, (a, b) in enumerate(zip(target.token_texts, proposer.token_texts)):
        if a != b:
            return f"token {i + FIRST_COMPARED_ID} differs: target {a!r}, proposer {b!r}"
    return None
