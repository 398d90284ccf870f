"""The draft trained for the bundled model and committed under proposers/assets/.

Its drafts are checked against HF transformers running the same weights (an independent
Llama implementation), the engine's greedy output with it against plain decoding, and the
vocabulary check must accept it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cluster.local import check_vocabularies
from cluster.workloads import load_prompts
from protos.proposal import ProposalRequest
from proposers.registry import build_proposer
from proposers.train import BUNDLED_DRAFT_DIR, CONFIG_FILE, WEIGHTS_FILE
from verifier.controller import Controller
from verifier.engine import Engine, EngineConfig
from verifier.models.vocab import VocabFingerprint, incompatibility
from verifier.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def draft():
    return build_proposer("draft", {"max_num_seqs": 8, "max_k": 4})


def test_committed_draft_is_small_and_its_vocabulary_is_accepted(draft, tokenizer):
    assert (BUNDLED_DRAFT_DIR / WEIGHTS_FILE).stat().st_size <= 30 * 2**20
    assert incompatibility(VocabFingerprint.of(tokenizer), draft.vocab) is None
    check_vocabularies(tokenizer, {"draft": draft})  # raises on a mismatch


def _hf_draft(hf_model):
    """The committed draft as an HF `LlamaForCausalLM` with the target's embeddings (as
    HF dequantised them from the GGUF), and its LM-head subset."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    meta = json.loads((BUNDLED_DRAFT_DIR / CONFIG_FILE).read_text())
    meta.pop("splitspec")
    meta.pop("torch_dtype", None)
    hf = LlamaForCausalLM(LlamaConfig(**meta)).eval()
    state = {k: v.float() for k, v in load_file(str(BUNDLED_DRAFT_DIR / WEIGHTS_FILE)).items()}
    vocab_ids = state.pop("splitspec.vocab_ids").long()
    state["model.embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach().float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf, vocab_ids


def test_drafts_equal_hf_transformers_on_the_same_weights(draft, hf_model, tokenizer):
    hf, vocab_ids = _hf_draft(hf_model)
    for i, prompt in enumerate(load_prompts("chat", tokenizer)[:3]):
        want: list[int] = []
        with torch.no_grad():
            for _ in range(4):  # greedy over the head's subset, whole context each time
                logits = hf(torch.tensor([prompt + want])).logits[0, -1]
                want.append(int(vocab_ids[int(logits[vocab_ids].argmax())]))
        (p,) = draft.propose_sync([ProposalRequest(f"hf{i}", 0, np.asarray(prompt, np.int32), 4, 0.0)])
        assert p.draft_token_ids.tolist() == want
        draft.release([f"hf{i}"])


def test_engine_with_the_trained_draft_is_exact_and_accepts(model, tokenizer, draft, exactness_prompts):
    prompts = exactness_prompts[::3]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    off = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=1024), None, Controller.off())
    want = [r.token_ids for r in off.generate_sync(prompts, params)]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=1024), {"draft": draft},
                    Controller.static(4, ("draft",)))
    results = engine.generate_sync(prompts, params)
    assert [r.token_ids for r in results] == want
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    # The untrained start (target layers 0, 1, 29) agrees with the target on 0.02% of
    # held-out tokens (train_info.json, step 0); the trained draft accepts ~10% of drafts.
    assert drafted > 0 and accepted / drafted > 0.03, (accepted, drafted)
