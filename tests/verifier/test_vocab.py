"""Vocabulary fingerprints and the compatibility check (rules as llama.cpp's).

The fingerprint of the bundled tokenizer is checked against the GGUF's own metadata read
with the `gguf` package (not through our tokenizer); incompatible vocabularies are built in
the test: a changed field, and a real tokenizer directory with two token ids swapped, which
a proposer serves over gRPC and the verifier's router refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import gguf
import pytest

from proposers.draft_model import DraftModelConfig, DraftModelProposer, with_layers
from proposers.server import ProposerServicer, start_server
from verifier.models.bundled import bundled_model_path
from verifier.models.tokenizer import Tokenizer
from verifier.models.vocab import VocabFingerprint, incompatibility
from verifier.routing import RoutedProposalSource


@pytest.fixture(scope="module")
def target(tokenizer):
    return VocabFingerprint.of(tokenizer)


@pytest.fixture(scope="module")
def swapped_dir(tokenizer, tmp_path_factory):
    """The bundled vocabulary as a tokenizer directory, with the ids of 'Ġthe' and 'Ġand' swapped."""
    spec = json.loads(tokenizer.backend.to_str())
    vocab = spec["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    path = tmp_path_factory.mktemp("swapped")
    (path / "tokenizer.json").write_text(json.dumps(spec))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return path, min(vocab["Ġthe"], vocab["Ġand"])


def test_fingerprint_matches_the_gguf_metadata(target):
    reader = gguf.GGUFReader(str(bundled_model_path()))
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert reader.fields["tokenizer.ggml.model"].contents() == target.vocab_type == "gpt2"
    assert target.vocab_size == len(tokens) == 49152
    assert target.bos_token_id == reader.fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert target.eos_token_ids == (2,)  # <|im_end|>, which the chat template writes
    expected = hashlib.sha256(b"".join(t.encode() + b"\0" for t in tokens[5:])).hexdigest()
    assert target.token_texts_sha256 == expected
    assert VocabFingerprint.from_proto(target.to_proto()) == target


@pytest.mark.parametrize("change, message", [
    ({"vocab_type": "llama"}, "vocabulary type differs: target 'gpt2', proposer 'llama'"),
    ({"bos_token_id": 0}, "BOS id differs: target 1, proposer 0"),
    ({"eos_token_ids": (0, 2)}, "EOS ids differ: target [2], proposer [0, 2]"),
    ({"vocab_size": 49152 + 129}, "vocabulary sizes differ by more than 128: target 49152, proposer 49281"),
])
def test_each_rule_is_named(target, change, message):
    assert incompatibility(target, dataclasses.replace(target, **change)) == message


def test_sizes_within_128_compare_the_common_ids(target):
    # 128 padding ids more (their texts do not matter) or 100 fewer: compatible.
    bigger = dataclasses.replace(target, vocab_size=target.vocab_size + 128,
                                 token_texts=target.token_texts + tuple(f"<pad{i}>" for i in range(128)))
    smaller = dataclasses.replace(target, vocab_size=target.vocab_size - 100, token_texts=target.token_texts[:-100])
    assert incompatibility(target, bigger) is None and incompatibility(target, smaller) is None
    # Ids 0-4 are not compared; id 5 is.
    texts = list(target.token_texts)
    texts[0] = "<renamed>"
    assert incompatibility(target, dataclasses.replace(target, token_texts=tuple(texts))) == (
        f"token 5 differs: target {target.token_texts[0]!r}, proposer '<renamed>'")


def test_a_real_tokenizer_with_two_ids_swapped_is_refused(target, swapped_dir):
    path, first = swapped_dir
    swapped = VocabFingerprint.of(Tokenizer.from_dir(path))
    assert (swapped.vocab_type, swapped.vocab_size, swapped.bos_token_id) == ("gpt2", 49152, 1)
    assert incompatibility(target, swapped) == (
        f"token {first} differs: target {target.token_texts[first - 5]!r}, proposer {swapped.token_texts[first - 5]!r}")
    assert {target.token_texts[first - 5], swapped.token_texts[first - 5]} == {"Ġthe", "Ġand"}


def test_router_refuses_an_incompatible_proposer_and_takes_a_compatible_one(model, target, swapped_dir):
    path, first = swapped_dir
    tiny = with_layers(model, [0])
    config = DraftModelConfig(max_num_seqs=1, max_model_len=64)
    good = DraftModelProposer(tiny, target, config)
    bad = DraftModelProposer(tiny, VocabFingerprint.of(Tokenizer.from_dir(path)), config)

    async def run():
        servers = [await start_server(ProposerServicer(s, max_k=8)) for s in (good, bad)]
        good_address, bad_address = (f"127.0.0.1:{port}" for _, port in servers)
        router = RoutedProposalSource("draft", deadline_s=2.0, target_vocab=target)
        try:
            await router.set_replicas([good_address, bad_address])
            assert router.addresses == [good_address]
            assert router.refused[bad_address] == (
                f"its vocabulary cannot draft for the target: token {first} differs: "
                f"target {target.token_texts[first - 5]!r}, proposer {swapped_text!r}")
        finally:
            await router.close()
            for server, _ in servers:
                await server.stop(0)

    swapped_text = bad.vocab.token_texts[first - 5]
    asyncio.run(run())
