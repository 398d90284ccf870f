"""Draft-model proposer: a small Llama-family model that shares the target's vocabulary.

Each sequence owns a slot of the draft's own preallocated KV cache (`verifier.kv_cache`).
Under the delta contract (`protos.proposal`) a round truncates the sequence to `base_len`
and appends the committed tokens; the cache keeps every position whose token is still
right, including the drafts of the last round that the verifier accepted, so a round
feeds the draft only what it has not seen (usually 1-2 tokens) and then drafts k tokens
autoregressively, all sequences of the round batched into each pass:

    pass 0:        each sequence's unseen context tokens      -> logits of draft 1
    pass 1..k-1:   draft j of every sequence still drafting   -> logits of draft j + 1

Greedy requests (temperature 0) get the argmax. Sampled requests get tokens sampled from
the draft's distribution at the request's temperature, restricted to its `sample_top_k`
most likely tokens, together with that distribution (`Proposal.draft_probs`), so the
verifier's rejection sampling accepts with min(1, p/q) and stays exact.

Example (one sequence, k = 2): context [5, 6, 7] is new, so pass 0 feeds [5, 6, 7] and
picks d1 = 8 from the logits after 7; pass 1 feeds 8 and picks d2 = 9. The cache now
holds [5, 6, 7, 8]. The verifier accepts 8, rejects 9 and emits 4: the next request is
base_len 3, append [8, 4]. 8 matches the cached draft, so only 4 is fed.

Token trees (`DraftModelConfig.tree` or `dynamic_tree`, greedy and sampled requests alike:
the nodes are the top candidates, without probabilities, and the verifier samples over
them with `verifier.token_tree.sample_accept_tree`): pass j feeds
every node of depth j instead of one draft, each attending the context and its own
ancestors (`LlamaModel.forward` trees), and each node's children are its top candidates
(all of them for fixed widths; for a dynamic tree, those on the depth's most likely
paths, as EAGLE-2 expands its trees). The nodes are not a continuation
of the context, so the round ends with the cache rolled back to the context; the next
round feeds the accepted drafts again with the new tokens, in the same pass 0.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import hashlib
import json
import pathlib
import threading
from typing import Sequence

import numpy as np
import torch

from protos.proposal import Proposal, ProposalRequest
from verifier.errors import ModelLoadError
from verifier.models.config import ModelConfig
from verifier.models.llama import LayerWeights, LlamaModel
from verifier.models.threads import cpu_worker, release_openmp_threads, run_on_cpu_worker
from verifier.models.vocab import VocabFingerprint


def with_layers(model: LlamaModel, layers: Sequence[int]) -> LlamaModel:
    """`model` running only the given layers, in the given order (same embeddings, final
    norm and LM head): a draft in seconds for tests, as in self-speculative decoding. Its
    acceptance is low: the first 8 of SmolLM2-135M's 30 layers accept ~0%, every layer but
    the middle 12 a few tokens in ten."""
    layers = list(layers)
    if not layers or any(not 0 <= i < len(model.layers) for i in layers):
        raise ValueError(f"layers must be indices in [0, {len(model.layers)}), got {layers}")
    out = copy.copy(model)
    out.layers = [model.layers[i] for i in layers]
    out.config = dataclasses.replace(model.config, num_layers=len(layers))
    return out


#: Characters of standard-library source `ranked_vocabulary` reads besides the prompt set
#: (about 1M tokens, 3 s with a byte-level BPE of 152k tokens).
RANKING_CORPUS_CHARS = 4_000_000


def ranked_vocabulary(tokenizer, size: int) -> np.ndarray:
    """The `size` ids of `tokenizer` most frequent in a local corpus (the prompt set that
    `splitspec train` answers, in the chat template when there is one, then the standard
    library's own source: English and code, never the benchmark's workloads; ties to the
    lower id), always with the EOS ids; sorted by id. The frequency-ranked subset over which
    a plain draft model runs its LM head (`with_vocab_subset`), as FR-Spec and EAGLE-3 do."""
    from proposers.train import load_prompt_set, most_counted, stdlib_files

    counts = np.zeros(tokenizer.vocab_size, np.int64)

    def count(text: str) -> None:
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int64)
        np.add.at(counts, ids[(ids >= 0) & (ids < counts.size)], 1)

    for conversation in load_prompt_set():
        count(tokenizer.apply_chat_template(conversation) if tokenizer.chat_template
              else "\n".join(m["content"] for m in conversation))
    left = RANKING_CORPUS_CHARS
    for path in stdlib_files():
        if left <= 0:
            break
        text = path.read_text(encoding="utf-8", errors="ignore")[:left]
        count(text)
        left -= len(text)
    return most_counted(counts, size, tokenizer.eos_token_ids)


def with_vocab_subset(model: LlamaModel, vocab_ids: np.ndarray) -> LlamaModel:
    """`model` with its LM head cut to the rows `vocab_ids` (same layers and embeddings):
    logits column c is token `vocab_ids[c]`, which the proposer maps back (`token_map`), so
    drafts are the same ids as before wherever the model's choice lies in the subset. Each
    draft step then spends len(vocab_ids) / vocab_size of the LM head's time."""
    ids = torch.from_numpy(np.asarray(vocab_ids, np.int64))
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= model.lm_head.shape[0]:
        raise ValueError(f"vocab_ids must be ids in [0, {model.lm_head.shape[0]})")
    out = copy.copy(model)
    out.lm_head = model.lm_head[ids].contiguous()
    out.lm_head_packed = None
    if model.packed:
        out.pack_weights()
    return out


def is_trained_draft(path: str | pathlib.Path) -> bool:
    """Whether `path` is a directory written by `splitspec train draft`."""
    cfg = pathlib.Path(path) / "config.json"
    return cfg.is_file() and "splitspec" in json.loads(cfg.read_text())


def load_trained_draft(path: str | pathlib.Path, target: LlamaModel, target_vocab: VocabFingerprint,
                       dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, np.ndarray]:
    """A draft written by `splitspec train draft` (`proposers/train.py`), built on `target`'s
    embeddings; returns the model and its `token_map` (LM-head column -> target id).

    Raises `ModelLoadError` when the weights do not match their recorded sha256 or the draft
    was trained for another vocabulary than `target_vocab`.
    """
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    meta = json.loads((path / "config.json").read_text())
    info = meta.get("splitspec", {})
    if info.get("kind") != "draft" or info.get("embeddings") != "target":
        raise ModelLoadError(f"{path}: config.json is not a splitspec draft (splitspec.kind {info.get('kind')!r})")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"{path}: no model.safetensors (see `splitspec train draft`)")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != info.get("weights_sha256"):
        raise ModelLoadError(f"{weights}: sha256 {digest} does not match config.json's weights_sha256 "
                             f"{info.get('weights_sha256')}; the file is corrupt or was replaced")
    fp = info.get("tokenizer_fingerprint", {})
    if fp.get("token_texts_sha256") != target_vocab.token_texts_sha256 or fp.get("vocab_size") != target_vocab.vocab_size:
        raise ModelLoadError(f"{path}: trained for another vocabulary ({fp.get('vocab_size')} tokens, texts sha256 "
                             f"{str(fp.get('token_texts_sha256'))[:12]}...) than the target's "
                             f"({target_vocab.vocab_size} tokens, {target_vocab.token_texts_sha256[:12]}...)")
    config = ModelConfig.from_hf(meta)
    tc = target.config
    if (config.hidden_size, config.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ModelLoadError(f"{path}: hidden size {config.hidden_size} and vocabulary {config.vocab_size} do not "
                             f"match the target's {tc.hidden_size} and {tc.vocab_size}")
    tensors = load_file(str(weights))
    vocab_ids = tensors.pop("splitspec.vocab_ids").numpy().astype(np.int64)
    if vocab_ids.min() < 0 or vocab_ids.max() >= tc.vocab_size:
        raise ModelLoadError(f"{weights}: splitspec.vocab_ids outside [0, {tc.vocab_size})")

    layers = hf_layers(tensors, "model.layers.", config.num_layers, dtype, str(weights))
    norm = tensors.get("model.norm.weight")
    if norm is None:
        raise ModelLoadError(f"{weights}: missing tensor 'model.norm.weight'")
    embed = target.embed.to(dtype)
    head = target.lm_head.to(dtype)[torch.from_numpy(vocab_ids)].contiguous()
    model = LlamaModel(config, embed, layers, norm.to(dtype), head, dtype)
    return model, vocab_ids


def hf_layers(tensors: dict[str, torch.Tensor], prefix: str, num_layers: int, dtype: torch.dtype, source: str,
              first_input_norm: bool = True) -> list[LayerWeights]:
    """Decoder layers `{prefix}{i}.*` under HF Llama names; `first_input_norm=False` leaves
    layer 0 without its input norm (EAGLE-1 heads)."""
    def need(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {name!r}")
        return tensors[name].to(dtype)

    layers = []
    for i in range(num_layers):
        p = f"{prefix}{i}."
        bias = [tensors.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
        layers.append(LayerWeights(
            input_norm=need(p + "input_layernorm.weight") if i or first_input_norm else None,
            wqkv=torch.cat([need(p + f"self_attn.{x}_proj.weight") for x in "qkv"]).contiguous(),
            bqkv=torch.cat(bias).to(dtype) if all(b is not None for b in bias) else None,
            wo=need(p + "self_attn.o_proj.weight"),
            post_norm=need(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")]).contiguous(),
            w_down=need(p + "mlp.down_proj.weight"),
        ))
    return layers


def rerank(tokens: list[int], parents: list[int], score: list[float], budget: int) -> tuple[list[int], list[int]]:
    """The `budget` nodes of a token tree with the highest path scores (log-probabilities,
    so never higher than the parent's), ties to the earlier node, in their tree order, with
    parents renumbered (-1: the root). A parent scores at least as high as its child and
    comes first, so the nodes kept form a subtree.

    >>> rerank([10, 11, 12, 13], [-1, -1, 0, 1], [-0.1, -2.0, -0.5, -2.1], 3)
    ([10, 11, 12], [-1, -1, 0])
    >>> rerank([10, 11, 12, 13], [-1, -1, 0, 2], [-0.1, -2.0, -0.5, -0.5], 3)
    ([10, 12, 13], [-1, 0, 1])
    """
    best = sorted(range(len(tokens)), key=lambda i: (-score[i], i))[:budget]
    keep = sorted(best)
    index = {old: new for new, old in enumerate(keep)}
    assert all(parents[i] < 0 or parents[i] in index for i in keep), "a kept node's parent was cut"
    return [tokens[i] for i in keep], [-1 if parents[i] < 0 else index[parents[i]] for i in keep]


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
    #: KV slots. A new sequence beyond them evicts the least recently used one, which
    #: answers `resync` when it comes back.
    max_num_seqs: int = 16
    #: Positions per slot (context plus drafts); a longer sequence gets no drafts.
    max_model_len: int = 2048
    #: Largest k drafted in one round; larger requests are capped.
    max_k: int = 8
    #: Sampled drafts come from the draft's `sample_top_k` most likely tokens (renormalised).
    sample_top_k: int = 64
    #: Seed of the sampling generator.
    seed: int = 0
    #: Token trees (greedy and sampled requests): the children each node gets at each depth,
    #: e.g. (3, 2, 1): the root's top 3, each of those their top 2, and one each after
    #: (depths past the list get 1). A tree of depth k has sum over j <= k of prod(tree[:j])
    #: drafts: (3, 2, 1) at k = 3 is 3 + 6 + 6 = 15. None: chains.
    tree: tuple[int, ...] | None = None
    #: Dynamic token trees (any request; EAGLE-2's expansion), instead of `tree`'s
    #: fixed widths: each node of a depth offers its best `dynamic_tree` children, and the
    #: `dynamic_tree` of them whose paths the proposer finds most likely (the product of its
    #: probabilities along the path) are the next depth. So a tree of depth k has
    #: `dynamic_tree` * k drafts, branching where the proposer is unsure and running as a
    #: chain where it is sure. None: `tree`, else chains.
    dynamic_tree: int | None = None
    #: With `dynamic_tree`: the most drafts a tree keeps (EAGLE-2's rerank). Once the tree
    #: is expanded to depth k, its `tree_budget` nodes of the most likely paths stay, from
    #: any depth: a subtree, since a path is never more likely than its parent's. So a
    #: tree spends a fixed number of drafts (e.g. 15: 16 rows with the root, one GEMM row
    #: class on CPU) where they are likeliest to be accepted. None: every node.
    tree_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_k", "sample_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tree is not None:
            object.__setattr__(self, "tree", tuple(int(w) for w in self.tree))
            if not self.tree or min(self.tree) < 1:
                raise ValueError(f"tree must list at least one width, each >= 1, got {list(self.tree)}")
        if self.dynamic_tree is not None:
            if self.tree is not None:
                raise ValueError("tree and dynamic_tree exclude each other: fixed widths or a dynamic tree")
            if self.dynamic_tree < 1:
                raise ValueError(f"dynamic_tree must be >= 1, got {self.dynamic_tree}")
        if self.tree_budget is not None:
            if self.dynamic_tree is None:
                raise ValueError("tree_budget needs dynamic_tree: it reranks a dynamic tree's nodes")
            if self.tree_budget < 1:
                raise ValueError(f"tree_budget must be >= 1, got {self.tree_budget}")

    def widths(self, k: int) -> list[int] | None:
        """Children each node offers at depths 1..k of a request's tree (a dynamic
        tree keeps `dynamic_tree` of all a depth's offers); None: a chain."""
        if self.dynamic_tree is not None:
            return [self.dynamic_tree] * k
        if self.tree is None:
            return None
        return [self.tree[j] if j < len(self.tree) else 1 for j in range(k)]

    def tree_nodes(self, k: int) -> int:
        """Drafts of a depth-k tree (k for a chain)."""
        w = self.widths(k)
        if w is None:
            return k
        return sum(self.dynamic_tree or int(np.prod(w[: j + 1])) for j in range(k))


@dataclasses.dataclass
class _Seq:
    slot: int
    #: int32 buffer: the context (ctx_len tokens), then the drafts fed to the cache last round.
    ids: np.ndarray
    ctx_len: int = 0


class DraftModelProposer:
    """`ProposalSource` drafting with `model`; see the module docstring."""

    needs_hidden_states = False

    def __init__(self, model: LlamaModel, vocab: VocabFingerprint | None = None,
                 config: DraftModelConfig | None = None, method: str = "draft",
                 token_map: np.ndarray | None = None) -> None:
        self.method = method
        self.model = model
        # Drafts run on the process's one model thread (`verifier.models.threads`), the
        # verifier's too when it shares the process; the loading thread frees its OpenMP
        # team once the cache is allocated.
        run_on_cpu_worker(model.pack_weights)  # oneDNN on CPU in float32 (a no-op elsewhere)
        #: Target id of each LM-head column when the draft's head covers a subset of the
        #: vocabulary (`load_trained_draft`); None when column c is id c.
        self.token_map = None if token_map is None else torch.from_numpy(np.asarray(token_map, np.int64))
        if self.token_map is not None and self.token_map.shape[0] != model.lm_head.shape[0]:
            raise ValueError(f"token_map has {self.token_map.shape[0]} ids for {model.lm_head.shape[0]} LM-head rows")
        #: The draft's vocabulary, sent in `Info` for the verifier's compatibility check.
        self.vocab = vocab
        self.config = config or DraftModelConfig()
        self.max_k = self.config.max_k
        self.cache = model.new_cache(self.config.max_num_seqs, self.config.max_model_len)
        self._seqs: collections.OrderedDict[str, _Seq] = collections.OrderedDict()  # LRU order
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._lock = threading.Lock()  # one round at a time on the cache (several streams may call)
        release_openmp_threads()

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_ids: Sequence[str]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                seq = self._seqs.pop(seq_id, None)
                if seq is not None:
                    self.cache.free(seq.slot)

    async def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        # The passes release the GIL: off the event loop, so streams and health checks go on.
        release_openmp_threads()
        return await asyncio.get_running_loop().run_in_executor(cpu_worker(), self.propose_sync, requests)

    def propose_sync(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        with self._lock:
            out: list[Proposal] = []
            drafting: list[tuple[int, _Seq, int, float]] = []  # (request index, state, k, temperature)
            for i, r in enumerate(requests):
                seq = self._update(r)
                if seq is None:
                    out.append(Proposal(r.seq_id, np.zeros(0, np.int32), resync=True))
                    continue
                out.append(Proposal(r.seq_id, np.zeros(0, np.int32)))
                room = self.config.max_model_len - seq.ctx_len + 1  # the last draft is never fed
                k = min(r.k, self.max_k, room) if seq.ctx_len >= self._min_context else 0
                if k > 0:
                    drafting.append((i, seq, k, float(r.temperature)))
            if drafting:
                for (i, _, _, _), (tokens, probs, parents) in zip(drafting, self._draft(drafting)):
                    out[i] = Proposal(requests[i].seq_id, tokens, probs, draft_parents=parents)
            return out

    # ------------------------------------------------------------------ state
    def _lookup(self, r: ProposalRequest) -> tuple[_Seq | None, np.ndarray] | None:
        """The sequence's state (None: new) and the validated appended ids; None when the
        state lacks `base_len` tokens (resync; the stale state is dropped)."""
        seq = self._seqs.get(r.seq_id)
        if r.base_len > 0 and (seq is None or seq.ctx_len < r.base_len):
            if seq is not None:
                self._drop(r.seq_id)
            return None
        append = np.asarray(r.append_token_ids, dtype=np.int32)
        if append.size and (append.min() < 0 or append.max() >= self.model.config.vocab_size):
            raise ValueError(f"{r.seq_id}: append_token_ids outside [0, {self.model.config.vocab_size})")
        if seq is not None:
            self._seqs.move_to_end(r.seq_id)
        return seq, append

    def _reserve(self, seq: _Seq, new_len: int) -> None:
        """Room in `seq.ids` for the context and this round's drafts."""
        if seq.ids.size < new_len + self.max_k:
            grown = np.zeros(max(2 * seq.ids.size, new_len + self.max_k), np.int32)
            grown[: seq.ids.size] = seq.ids
            seq.ids = grown

    def _update(self, r: ProposalRequest) -> _Seq | None:
        """Apply the delta; None when the state lacks `base_len` tokens (resync)."""
        found = self._lookup(r)
        if found is None:
            return None
        seq, append = found
        new_len = r.base_len + append.size
        if seq is None:
            seq = self._new(r.seq_id, new_len)
        if new_len == 0:
            return seq
        kv_len = self.cache.lens[seq.slot]
        # Cached positions past base_len stay valid as far as the appended tokens match them
        # (last round's accepted drafts).
        same = r.base_len
        limit = min(kv_len, new_len)
        self._reserve(seq, new_len)
        while same < limit and seq.ids[same] == append[same - r.base_len]:
            same += 1
        seq.ids[r.base_len:new_len] = append
        seq.ctx_len = new_len
        # At least the last context token is fed again: its logits give draft 1.
        self.cache.rollback(seq.slot, min(same, kv_len, new_len - 1))
        return seq

    #: `LlamaModel.forward`'s `hidden_layers` for the features a drafting pass feeds back
    #: (None: the final states; an EAGLE-3 head's are before its final norm).
    _feedback_layers: tuple[int, ...] | None = None
    #: The per-sequence state class (the EAGLE proposer adds its features).
    _state = _Seq
    #: Shortest context that can be drafted for (EAGLE needs one feature: 2 tokens).
    _min_context = 1

    def _new(self, seq_id: str, length: int) -> _Seq:
        if self.cache.num_free_slots == 0:
            oldest = next(iter(self._seqs))
            self._drop(oldest)
        seq = self._state(self.cache.allocate(), np.zeros(max(256, 2 * length), np.int32))
        self._seqs[seq_id] = seq
        return seq

    def _drop(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id)
        self.cache.free(seq.slot)

    # ------------------------------------------------------------------ drafting
    def _context_feed(self, seq: _Seq) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pass 0's rows for `seq`: its unseen context tokens (and, for EAGLE, their features)."""
        return torch.from_numpy(seq.ids[self.cache.lens[seq.slot]:seq.ctx_len].astype(np.int64)), None

    def _root(self, seq: _Seq) -> int:
        """Cache index of the row whose logits give draft 1: a tree's root."""
        return seq.ctx_len - 1

    def _embeds(self, token_ids: torch.Tensor, features: list[torch.Tensor | None]) -> torch.Tensor | None:
        """A pass's input rows when not the token embeddings (an EAGLE head fuses features)."""
        return None

    @torch.inference_mode()
    def _draft(self, drafting: list[tuple[int, _Seq, int, float]]
               ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
        """(tokens, probs, tree parents or None) per drafting sequence: chains, or token
        trees when `tree` or `dynamic_tree` is set (without probabilities: a tree's nodes
        count as one-hot q). Pass 0 feeds each sequence's unseen context; every later pass
        the drafts of the depth before (a chain has one), tree nodes attending their
        ancestors only (`LlamaModel.forward` trees)."""
        features = self.needs_hidden_states  # an EAGLE head feeds each node its parent's f^
        vocab = self.model.config.vocab_size
        dynamic = self.config.dynamic_tree is not None
        widths = []
        for _, seq, k, _ in drafting:
            w = self.config.widths(k)
            # The cache holds the root and the nodes of depths 1..k-1 (the last depth is not fed).
            if w is not None and self._root(seq) + 1 + self.config.tree_nodes(k - 1) > self.config.max_model_len:
                w = None
            widths.append(w)
        # A sampled chain's q; a tree's nodes are top candidates (one-hot q, `sample_accept_tree`).
        probs = [np.zeros((k, vocab), np.float32) if t > 0 and w is None else None
                 for (_, _, k, t), w in zip(drafting, widths)]
        tokens: list[list[int]] = [[] for _ in drafting]
        parents: list[list[int]] = [[] for _ in drafting]
        feeds = [self._context_feed(seq) for _, seq, _, _ in drafting]
        active = list(range(len(drafting)))
        fed: list[list[int]] = [[-1] for _ in drafting]  # nodes fed this pass (-1: the root row)
        feature: list[dict[int, torch.Tensor]] = [{} for _ in drafting]  # node (or -1) -> its output f^
        score: list[list[float]] = [[] for _ in drafting]  # dynamic trees: each node's path log-probability
        for j in range(max(k for _, _, k, _ in drafting)):
            trees = None
            if j > 0:
                active = [a for a in active if drafting[a][2] > j]
                for a in active:  # the nodes added since the last pass (breadth first)
                    fed[a] = list(range(fed[a][-1] + 1, len(tokens[a])))
                feeds = [(torch.tensor([tokens[a][i] for i in fed[a]]),
                          torch.cat([feature[a][parents[a][i]] for i in fed[a]]) if features else None)
                         for a in active]
                if any(widths[a] is not None for a in active):
                    trees = [None if widths[a] is None else
                             (self._root(drafting[a][1]), [-1] + [q + 1 for q in parents[a]]) for a in active]
            flat_ids = torch.cat([ids for ids, _ in feeds])
            num_tokens = [int(ids.shape[0]) for ids, _ in feeds]
            ends = np.cumsum(num_tokens)
            # Logits (and f^) of the rows fed as nodes: the last row in pass 0, every row after.
            rows = ends - 1 if j == 0 else np.arange(int(ends[-1]))
            index = torch.from_numpy(rows.astype(np.int64))
            out = self.model.forward(flat_ids, [drafting[a][1].slot for a in active], num_tokens, self.cache, index,
                                     hidden_index=index if features else None, trees=trees,
                                     input_embeds=self._embeds(flat_ids, [f for _, f in feeds]),
                                     hidden_layers=self._feedback_layers)
            logits, out_features = out if features else (out, None)
            if j == 0:
                for a in active:
                    self._fed_context(drafting[a][1])
            row = 0
            chains = []  # (row, active position) of chain sequences, picked together below
            for a in active:
                if widths[a] is not None:  # a tree: the nodes of depth j + 1
                    nodes = torch.arange(row, row + len(fed[a]))
                    top = torch.topk(logits[nodes], min(widths[a][j], logits.shape[-1]), dim=-1)
                    keep = torch.arange(top.indices.numel())  # fixed widths: every node's best
                    if dynamic:  # the best paths among every node's best
                        base = torch.tensor([score[a][i] if i >= 0 else 0.0 for i in fed[a]])
                        path = (torch.log_softmax(logits[nodes], dim=-1).gather(1, top.indices)
                                + base.unsqueeze(1)).flatten()
                        keep = torch.topk(path, min(self.config.dynamic_tree, path.numel())).indices.sort().values
                        score[a] += path[keep].tolist()
                    ids = top.indices.flatten()[keep]
                    tokens[a] += (ids if self.token_map is None else self.token_map[ids]).tolist()
                    parents[a] += [fed[a][int(f) // top.indices.shape[1]] for f in keep]
                for i in fed[a]:
                    if features:
                        feature[a][i] = out_features[row : row + 1]
                    if widths[a] is None:
                        chains.append((row, a))
                    row += 1
            if chains:
                picked = self._pick(logits[torch.tensor([r for r, _ in chains])], [drafting[a][3] for _, a in chains],
                                    [probs[a] for _, a in chains], j)
                for (_, a), token in zip(chains, picked):
                    parents[a].append(len(tokens[a]) - 1)
                    tokens[a].append(token)
        budget = self.config.tree_budget
        for a, (_, seq, _, _) in enumerate(drafting):
            if budget is not None and widths[a] is not None and len(tokens[a]) > budget:
                tokens[a], parents[a] = rerank(tokens[a], parents[a], score[a], budget)
            if widths[a] is None:  # the cache holds context + drafts 1..k-1: kept for the next round's match
                seq.ids[seq.ctx_len : seq.ctx_len + len(tokens[a])] = tokens[a]
            else:  # tree nodes are not a continuation: back to the context
                self.cache.rollback(seq.slot, self._root(seq) + 1)
        return [(np.asarray(tokens[a], np.int32), probs[a],
                 None if widths[a] is None else np.asarray(parents[a], np.int32)) for a in range(len(drafting))]

    def _fed_context(self, seq: _Seq) -> None:
        """Called once pass 0 has fed `seq`'s context (the EAGLE head marks its real rows)."""

    def _pick(self, logits: torch.Tensor, temperatures: list[float], probs: list[np.ndarray | None],
              j: int) -> list[int]:
        """Draft j of each row: the argmax (temperature 0), else a sample from the row's
        top `sample_top_k` tokens at its temperature, whose distribution goes to probs[row][j]."""
        best = logits.argmax(dim=-1)
        out = (best if self.token_map is None else self.token_map[best]).tolist()
        sampled = [row for row, t in enumerate(temperatures) if t > 0]
        if sampled:
            rows = torch.tensor(sampled)
            top = torch.topk(logits[rows], min(self.config.sample_top_k, logits.shape[-1]), dim=-1)
            scale = torch.tensor([temperatures[row] for row in sampled], dtype=torch.float32).unsqueeze(1)
            q = torch.softmax(top.values / scale, dim=-1)
            choice = torch.multinomial(q, 1, generator=self._generator).squeeze(1)
            top_ids = top.indices if self.token_map is None else self.token_map[top.indices]
            tokens = top_ids.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()
            ids, values = top_ids.numpy(), q.numpy()
            for i, row in enumerate(sampled):
                out[row] = tokens[i]
                probs[row][j, ids[i]] = values[i]
        return out
