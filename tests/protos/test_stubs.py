"""The wire contract: generated stubs match the .proto files, and messages carry what
DESIGN.md's proposer contract needs."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np

from protos.generate_stubs import PROTO_SUBDIR, REPO_ROOT, committed_stubs, drifted, generate
from protos.splitspec.v1 import generate_pb2, proposer_pb2, proposer_pb2_grpc


def test_committed_stubs_match_the_protos():
    assert drifted() == [], "run: python -m protos.generate_stubs"
    assert {"proposer_pb2.py", "proposer_pb2_grpc.py", "generate_pb2.py", "generate_pb2_grpc.py"} <= committed_stubs().keys()


def test_a_changed_proto_is_detected_as_drift(tmp_path):
    # Copy the protos, add a field, and regenerate: the output must differ from the stubs.
    (tmp_path / PROTO_SUBDIR).mkdir(parents=True)
    for proto in (REPO_ROOT / PROTO_SUBDIR).glob("*.proto"):
        shutil.copy(proto, tmp_path / PROTO_SUBDIR / proto.name)
    path = tmp_path / PROTO_SUBDIR / "proposer.proto"
    path.write_text(path.read_text().replace("  bool resync = 5;\n", "  bool resync = 5;\n  bool extra = 99;\n"))
    out = tmp_path / "out"
    out.mkdir()
    fresh = generate(out, tmp_path)
    assert fresh["proposer_pb2.py"] != committed_stubs()["proposer_pb2.py"]
    assert fresh["generate_pb2.py"] == committed_stubs()["generate_pb2.py"]


def test_every_field_has_a_doc_comment():
    for proto in (REPO_ROOT / PROTO_SUBDIR).glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "package", "//"))
            if is_field:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} {stripped!r} has no doc comment"


def test_propose_messages_round_trip_token_ids_and_probabilities():
    probs = np.random.default_rng(0).dirichlet(np.ones(7), size=2).astype("<f4")  # [2 drafts, vocab 7]
    request = proposer_pb2.ProposeRequest(round_id=3, sequences=[proposer_pb2.SequenceDelta(
        seq_id="a", base_len=5, append_token_ids=[2**31 - 1, 0, 7], k=4, temperature=0.7)])
    response = proposer_pb2.ProposeResponse(round_id=3, sequences=[proposer_pb2.SequenceDraft(
        seq_id="a", draft_token_ids=[1, 2], draft_probs=probs.tobytes(), vocab_size=7)])
    req2 = proposer_pb2.ProposeRequest.FromString(request.SerializeToString())
    res2 = proposer_pb2.ProposeResponse.FromString(response.SerializeToString())
    assert list(req2.sequences[0].append_token_ids) == [2**31 - 1, 0, 7] and req2.sequences[0].k == 4
    draft = res2.sequences[0]
    back = np.frombuffer(draft.draft_probs, dtype="<f4").reshape(len(draft.draft_token_ids), draft.vocab_size)
    assert np.array_equal(back, probs) and not draft.resync


def test_services_expose_the_contract_methods():
    proposer = proposer_pb2.DESCRIPTOR.services_by_name["Proposer"]
    propose = proposer.methods_by_name["Propose"]
    assert propose.client_streaming and propose.server_streaming
    assert not proposer.methods_by_name["Info"].server_streaming
    gen = generate_pb2.DESCRIPTOR.services_by_name["Generate"].methods_by_name["Generate"]
    assert gen.server_streaming and not gen.client_streaming
    assert hasattr(proposer_pb2_grpc, "ProposerServicer") and hasattr(proposer_pb2_grpc, "add_ProposerServicer_to_server")
    request = generate_pb2.GenerateRequest(prompt="hi", max_tokens=3)
    assert request.WhichOneof("input") == "prompt" and request.HasField("max_tokens") and not request.HasField("seed")
