"""Session-wide fixtures: the real bundled model, its tokenizer, and the HF reference.

Loading costs ~2 s (ours) and ~20-35 s (HF transformers' GGUF loader), so each is loaded
once per test session.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """Tests on the session's Ray cluster (`serve_cluster`, tests/cluster/conftest.py) run
    last, each group in its own order, so the cluster starts only then: idle, its
    processes (Serve's controller, Ray's dashboard agent and GCS, the apps' replicas)
    still take about half of one of the 2 cores, which the model tests would share, and
    a pass's 2 OpenMP threads wait for whichever thread a neighbour displaces."""
    items[:] = sorted(items, key=lambda item: "serve_cluster" in item.fixturenames)


@pytest.fixture(scope="session")
def model():
    """The bundled SmolLM2-135M-Instruct in float32 (exactness tests run in fp32), its
    weights packed for oneDNN as a serving engine packs them (`LlamaModel.pack_weights`),
    so every test sees it in one state whichever builds an engine first."""
    from verifier.models.loader import load_model

    m = load_model(None, "float32")
    m.pack_weights()
    return m


@pytest.fixture(scope="session")
def tokenizer():
    from cluster.local import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' own Llama implementation on the same GGUF (independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verifier.models.bundled import bundled_model_path

    path = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def exactness_prompts(tokenizer):
    """20 varied prompts, 36-132 tokens: 7 code edits, 6 summaries, 7 chats (the first of
    each workload file; 20 keeps the exactness suite at a few minutes on 2 cores)."""
    from cluster.workloads import load_prompts

    return [p for w, n in (("code_edit", 7), ("summarize", 6), ("chat", 7)) for p in load_prompts(w, tokenizer)[:n]]
