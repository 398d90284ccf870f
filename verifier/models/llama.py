"""A compact Llama-family decoder (Llama 2/3, Qwen2, SmolLM2) over a ragged token batch.

One forward pass takes the new tokens of many sequences flattened into one row
(`token_ids: [T]`), each sequence `i` contributing `num_tokens[i]` consecutive tokens that
continue its KV-cache slot: prefill passes the whole prompt, a decode step 1 token, a
verification round `[last, d1..dk]` (k + 1 tokens, k may differ per sequence and be 0).
Linear layers run once over all T tokens: on CPU in float32 through oneDNN with weights
packed once at start (`LlamaModel.pack_weights`, `linear`), else through MKL padded to
`gemm_rows(T)` rows, the row counts MKL is fast at. Attention runs against each sequence's own cache slot: the
short spans of a pass (decode steps and verification rounds, 4 or more of them) as one
batched product over their slot range, each query masked to its own causal prefix
(`_SpanGroup.of`); the short spans left out of it (2 or more: rounds too wide for it, or
all of them when the slots are too sparse for one) as batched products over copies of
their own slots' caches, split by width so that one wide round does not pad every decode
(`_SpanGroup.gathered`); prefills and any other span one sequence at a time.

Token trees (`trees`): a sequence's new tokens may be nodes of a draft tree instead of a
chain. Each node sits at its own cache index (the next free ones, in the order given) but
takes the RoPE position of its depth, and attends the context before the tree and its own
ancestors only, so every root-to-leaf path computes exactly what that path alone would as
a chain (`verifier.token_tree`). The verifier checks several candidates per
position in one pass this way; `KVCache.keep` then moves the accepted path's K/V into place.

Weights are kept in HF layout (q/k rows ordered for `rotate_half` RoPE), fused as
`wqkv` [(H + 2 Hkv) D, hidden] and `w_gate_up` [2 I, hidden] to halve the number of
matmuls per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from verifier.kv_cache import KVCache
from verifier.models.config import ModelConfig, rope_attention_scaling, rope_inv_freq
from verifier.token_tree import tree_ancestors, tree_depths


#: The `LayerWeights` fields that are linear-layer weights (packed by `LlamaModel.pack_weights`).
LINEAR_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [hidden]; None: no norm (an EAGLE head's first layer)
    wqkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) * D] (Qwen2) or None
    wo: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]
    #: EAGLE-3's layer: [hidden]; the attention then reads [input_norm(token embeddings);
    #: hidden_norm(residual stream)] (wqkv is [(H + 2 Hkv) * D, 2 hidden]). None: a plain layer.
    hidden_norm: torch.Tensor | None = None


@dataclasses.dataclass
class _SeqSpan:
    """Where one sequence's new tokens sit in the flat batch and in its cache slot."""

    slot: int
    token_start: int  # first index in the flat batch
    num_tokens: int  # S
    kv_len: int  # cache length after this pass = start position + S
    blocked: torch.Tensor | None  # bool [S, kv_len], True = may not attend; set only for a span that
    # attends on its own, S > 1 and not causal (None otherwise)
    causal: bool
    grouped: bool = False  # its attention runs in the pass's `_SpanGroup`
    tree: bool = False  # its tokens are tree nodes: attends on its own with `blocked` (never grouped)


@dataclasses.dataclass
class _SpanGroup:
    """Short spans of a pass (decode steps and verification rounds, at most
    `GROUP_MAX_WIDTH` tokens each) whose attention runs as one batched product, instead of
    one product each, over a set of cache slots: the slot range [lo, hi) (a view, no copy;
    `slots` None) or the member slots gathered into a copy (`slots`).

    Each slot of the set gets `width` query rows (the longest member span); member j's
    query sits in row j of its slot, the other rows are dead (they attend key 0 only and
    their outputs are dropped).
    """

    lo: int
    hi: int
    width: int  # W: query rows per slot
    kv_len: int  # the longest cache among the members
    slot_index: torch.Tensor  # int64 [m]: the slot's place in the set of each member token
    row_index: torch.Tensor  # int64 [m]: its query row in the slot, 0 .. W - 1
    token_index: torch.Tensor  # int64 [m]: its row in the flat batch
    blocked: torch.Tensor  # bool [n, 1, 1, W, kv_len] (n slots in the set): True = may not attend
    slots: torch.Tensor | None = None  # int64 [n]: the gathered slots; None: the range [lo, hi)

    @property
    def num_slots(self) -> int:
        return self.hi - self.lo if self.slots is None else int(self.slots.shape[0])

    @classmethod
    def of(cls, spans: list[_SeqSpan], device: torch.device | str = "cpu") -> "_SpanGroup | None":
        """Group the spans of at most W tokens over their slot range, W the widest width
        (up to `GROUP_MAX_WIDTH`) at which there are at least `GROUP_MIN` of them and their
        tokens fill at least `GROUP_MIN_FILL` of the range's W query rows per slot (every
        slot of the range, idle or not, costs W rows of attention). None when no width
        qualifies."""
        spans = [s for s in spans if not s.tree]
        widths = sorted({s.num_tokens for s in spans if s.num_tokens <= GROUP_MAX_WIDTH}, reverse=True)
        for width in widths:
            members = [s for s in spans if s.num_tokens <= width]
            lo = min(s.slot for s in members)
            hi = max(s.slot for s in members) + 1
            if len(members) >= GROUP_MIN and sum(s.num_tokens for s in members) >= GROUP_MIN_FILL * (hi - lo) * width:
                break
        else:
            return None
        return cls._build(members, {slot: slot - lo for slot in range(lo, hi)}, width, lo, hi, None, device)

    @classmethod
    def gathered(cls, spans: list[_SeqSpan], device: torch.device | str = "cpu") -> list["_SpanGroup"]:
        """Group the short spans that `of` left out (the verification rounds wider than the
        range group's width, or every short span when there is no range group) over their
        own slots, gathered: none when there are fewer than `GATHER_MIN` of them. Each group
        pads its members to its widest, so they are split by width where that saves more
        query rows than a group costs (`GATHER_GROUP_ROWS`): one round of k = 8 among
        decodes would otherwise give every decode 9 rows."""
        members = [s for s in spans if not s.grouped and not s.tree and s.num_tokens <= GROUP_MAX_WIDTH]
        if len(members) < GATHER_MIN:
            return []
        order = sorted(range(len(members)), key=lambda i: members[i].num_tokens)
        groups = []
        for first, last in _width_classes([members[i].num_tokens for i in order], GATHER_GROUP_ROWS):
            part = [members[i] for i in sorted(order[first:last])]  # in pass order
            slots = [s.slot for s in part]
            groups.append(cls._build(part, {slot: i for i, slot in enumerate(slots)},
                                     max(s.num_tokens for s in part), 0, 0,
                                     torch.tensor(slots, dtype=torch.int64, device=device), device))
        return groups

    @classmethod
    def _build(cls, members: list[_SeqSpan], place: dict[int, int], width: int, lo: int, hi: int,
               slots: torch.Tensor | None, device: torch.device | str) -> "_SpanGroup":
        kv_len = max(s.kv_len for s in members)
        # last[i, j]: the last key position query row j of the set's slot i may attend;
        # 0 for dead rows and idle slots.
        last = torch.zeros(len(place), width, dtype=torch.int64)
        slot_index, row_index, token_index = [], [], []
        for s in members:
            s.grouped = True
            start = s.kv_len - s.num_tokens
            last[place[s.slot], : s.num_tokens] = torch.arange(start, s.kv_len)
            slot_index += [place[s.slot]] * s.num_tokens
            row_index += range(s.num_tokens)
            token_index += range(s.token_start, s.token_start + s.num_tokens)
        blocked = torch.arange(kv_len).view(1, 1, kv_len) > last.unsqueeze(-1)

        def index(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(lo, hi, width, kv_len, index(slot_index), index(row_index), index(token_index),
                   blocked.view(len(place), 1, 1, width, kv_len).to(device), slots)


# Spans in a pass from which their attention is batched. Measured here (contexts of
# 100-500 positions, whole passes): 4 decode steps 95 ms against 104 ms one by one, 8: 130
# against 167, 32: 251 against 341 (fastest of 4). Verification spans too (median ratio of
# 16 interleaved pairs, grouped / one by one): 8 rounds of 3 or 5 tokens 0.93, 32 of 3:
# 0.83, 32 of 5: 0.90, 16 decodes + 16 rounds of 5: 0.91. The loop's small kernels per
# sequence and layer cost more than the padding to the longest context and the widest
# span, unless the group's rows are mostly padding: 6 decodes + 2 rounds of 5 grouped at
# width 5 (16 of 40 rows) 1.03; 32 decodes + 3 rounds of 8 (29 + 24 of 256 rows) 390 ms
# against 339 ms with the rounds left out. Hence `GROUP_MIN_FILL`.
GROUP_MIN = 4
# The share of a group's query rows (slots x width) its members must fill.
GROUP_MIN_FILL = 0.5
# Spans left out of the range group (verification rounds wider than its width) from which
# they are gathered into a group of their own. Measured here, one layer's attention, median
# of 30, rounds on every 32 // m-th slot of 32, caches of L positions, one by one against
# gathered (K/V copied): L = 300: 2 rounds of 5 0.31 ms against 0.19, 4 of 9 0.66 / 0.43,
# 10 of 9 1.82 / 1.34, 16 of 5 1.97 / 1.30; L = 700: 2 of 5 0.39 / 0.27, 10 of 9
# 2.90 / 2.45, 16 of 5 4.48 / 4.06. The range group over all 32 slots would cost 2-7 ms.
GATHER_MIN = 2
# What one more gathered group costs, in padded query rows (its own kernels in each layer).
GATHER_GROUP_ROWS = 8
# The widest span that joins a group: a verification round of k = 8 (every slot of the
# range pays W query rows, so a prefill chunk must not widen it).
GROUP_MAX_WIDTH = 9


def _width_classes(widths: Sequence[int], group_rows: float) -> list[tuple[int, int]]:
    """Split widths sorted ascending into runs [first, last) minimising the query rows,
    each run padded to its widest (its last), plus `group_rows` a run.

    >>> _width_classes([1] * 7 + [9], 8)  # 7 x 1 + 9 + 16 = 32 rows, against 8 x 9 + 8 = 80
    [(0, 7), (7, 8)]
    >>> _width_classes([1, 1, 2, 3], 8)  # 4 x 3 + 8 = 20 rows, against 2 + 2 x 3 + 16 = 24
    [(0, 4)]
    """
    n = len(widths)
    best = [0.0] + [math.inf] * n  # best[j]: rows of the first j widths
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            rows = best[i] + (j - i) * widths[j - 1] + group_rows
            if rows < best[j]:
                best[j], cut[j] = rows, i
    runs, j = [], n
    while j:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]


# MKL's fp32 GEMM (W @ x^T) on this class of CPU (2 AVX2 cores) is fast only at some row
# counts. Measured, fastest of 9, on SmolLM2-135M's shapes (30 layers' four linears | the
# 49,152 x 576 LM head), ms:
#   rows  1: 44 | 11.5    2: 45 | 6.8    3: 63 | 11.4    4: 46 | 7.4    8: 69 | 10.4
#   rows 15: 113 | 32     16: 57 | 20     23: 126 | 34     24: 74-86 | 26
#   rows 31: 135 | 36     32: 78 | 23     63: 181 | 56     64: 126 | 35
# Odd counts and 9-15 rows are the slow cases; multiples of 8 (and 4) the fast ones.
MIN_GEMM_ROWS = 16


def gemm_rows(n: int) -> int:
    """The row count a pass of n tokens runs its linear layers at on CPU: 1 stays 1, 2-4
    rows pad to 4, 5-8 to 8, 9-16 to 16, more to the next multiple of 8. The padding rows
    are dead (zero inputs, outputs dropped), so results are unchanged.

    >>> [gemm_rows(n) for n in (1, 2, 5, 9, 16, 17, 113)]
    [1, 4, 8, 16, 16, 24, 120]
    """
    if n <= 1:
        return n
    if n <= 4:
        return 4
    if n <= 8:
        return 8
    if n <= MIN_GEMM_ROWS:
        return MIN_GEMM_ROWS
    return -(-n // 8) * 8


def lm_head_rows(n: int) -> int:
    """Rows the LM head runs at for n wanted logits: as `gemm_rows`, but one row pads to
    two (the single-row product takes MKL's GEMV path, 1.7x slower here)."""
    return 2 if n == 1 else gemm_rows(n)


# oneDNN's fp32 inner product with weights packed once (`pack_weight`), measured here on
# SmolLM2-135M's shapes (30 layers' four linears, median of 7, ms) against MKL's W @ x^T:
#   rows  1: 25 | 38    2: 21 | 21    4: 19 | 32    5: 19 | 42    8: 29 | 67
#   rows 13: 37 | 87   16: 35 | 52   25: 46 | 88   32: 53 | 71   64: 89 | 117   256: 306 | 399
# Flat to 8 rows and no slow row counts, so nothing is padded but one row to two: a
# single row takes a GEMV kernel whose sums over K >= 1536 (SmolLM2's down projection)
# are ordered differently, while from two rows up each row's result is bit-identical
# whatever the row count (checked for M = 2..300 on the bundled and Qwen2.5 shapes): the
# linears of a k + 1-token verification pass compute the very numbers those of k + 1
# decode steps would (attention still rounds differently between the two).


def onednn_available() -> bool:
    """Whether this torch has oneDNN's packed fp32 linear (CPU builds on x86 and ARM).
    `SPLITSPEC_CPU_GEMM=mkl` turns it off (every linear then runs through MKL)."""
    import os

    if os.environ.get("SPLITSPEC_CPU_GEMM", "onednn").lower() == "mkl":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (CPU, float32) in oneDNN's blocked layout for `linear` (an opaque
    tensor: `dense` gives the original back, bit for bit)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain strided tensor, unpacking a `pack_weight` one."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N].

    A packed weight (`pack_weight`) runs oneDNN's inner product. A plain one is computed
    as weight @ x^T (a transposed view): with the weight as the left operand MKL streams
    it once instead of packing it, 1.5-3x faster than `F.linear` for small M here (LM
    head, 5 rows: 14 ms vs 42 ms).
    """
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> x / sqrt(mean(x^2) + eps) * weight.

    float32: torch's fused kernel (one op instead of seven; per-op dispatch costs
    ~5-40 us here, and a step runs 61 norms); bit-identical to HF's formula in fp32.
    Other dtypes normalise in float32 as HF Llama does.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, ...] with zero rows appended up to `rows`."""
    n = x.shape[0]
    return torch.cat([x, x.new_zeros(rows - n, *x.shape[1:])]) if rows > n else x


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in float32 (as HF does), cast back to the model's dtype."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return probs if probs.dtype == dtype else probs.to(dtype)


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None
) -> torch.Tensor:
    """Attention of a few new queries against one sequence's cache, GQA without copies.

    q: [S, H, D]; k, v: [Hkv, L, D]; blocked: bool [S, L] (True = may not attend) or None.
    Returns [S, H, D]. Query head h reads kv head h // G (G = H / Hkv), as HF's
    `repeat_kv` does; grouping the G heads' queries into one matrix per kv head makes
    the whole thing two batched matmuls instead of SDPA's GQA path, which expands K/V
    (measured: 8 one-token sequences, 30 layers, ~190 us of copies per call).
    """
    S, H, D = q.shape
    Hkv, L, _ = k.shape
    G = H // Hkv
    qg = q.reshape(S, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * S, D)
    scores = torch.baddbmm(qg.new_empty(()), qg, k.transpose(1, 2), beta=0.0, alpha=D**-0.5)  # [Hkv, G*S, L]
    if blocked is not None:
        scores = scores.view(Hkv, G, S, L).masked_fill(blocked, float("-inf")).view(Hkv, G * S, L)
    probs = _softmax(scores, q.dtype)
    o = torch.bmm(probs, v)  # [Hkv, G*S, D]
    return o.view(Hkv, G, S, D).permute(2, 0, 1, 3).reshape(S, H, D)


def _group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _SpanGroup) -> torch.Tensor:
    """The members' queries against their own caches, all in two batched matmuls.

    q: [T, H, D] (the pass's queries); k, v: one layer's cache [num_slots, Hkv, max_len, D].
    Returns [m, H, D] for the member tokens in `group.token_index` order; query head h
    reads kv head h // G as in `_grouped_attention`.
    """
    _, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    n, W, m = group.num_slots, group.width, group.token_index.shape[0]
    if group.slots is None:
        k_r = k[group.lo : group.hi, :, : group.kv_len]  # [n, Hkv, L, D], a view
        v_r = v[group.lo : group.hi, :, : group.kv_len]
    else:  # a copy of the members' caches only
        k_r = k[:, :, : group.kv_len].index_select(0, group.slots)
        v_r = v[:, :, : group.kv_len].index_select(0, group.slots)
    qg = q.new_zeros(n, Hkv, G, W, D)
    # Advanced indices on dims 0 and 3 -> the indexed view is [m, Hkv, G, D].
    qg[group.slot_index, :, :, group.row_index] = q.index_select(0, group.token_index).view(m, Hkv, G, D)
    scores = torch.matmul(qg.view(n, Hkv, G * W, D), k_r.transpose(-1, -2)).mul_(D**-0.5)
    scores = scores.view(n, Hkv, G, W, -1).masked_fill_(group.blocked, float("-inf"))
    probs = _softmax(scores, q.dtype)
    o = torch.matmul(probs.view(n, Hkv, G * W, -1), v_r).view(n, Hkv, G, W, D)
    return o[group.slot_index, :, :, group.row_index].reshape(m, H, D)


class LlamaModel:
    """Inference-only decoder. Build with `verifier.models.loader.load_model`."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        dtype: torch.dtype,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.embed = embed  # [V, hidden]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [V, hidden]; the same tensor as embed when tied
        #: `lm_head` packed for oneDNN (`pack_weights`); None: the linears run through MKL.
        self.lm_head_packed: torch.Tensor | None = None
        inv_freq = rope_inv_freq(config, rope_freq_factors)
        positions = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, D/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rope_attention_scaling(config)
        self._cos = (emb.cos() * scale).to(dtype)  # [max_position, D]
        self._sin = (emb.sin() * scale).to(dtype)
        #: Sums a tensor over the ranks of a tensor-parallel split, in place, after each
        #: attention and MLP (`verifier.models.tensor_parallel`); None: the whole model.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        #: Gathers a share's logits [R, its vocabulary] into rank 0's [R, vocabulary] (None
        #: on the other ranks); None: the whole vocabulary is here.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def packed(self) -> bool:
        """Whether the linears run through oneDNN with packed weights (`pack_weights`)."""
        return self.lm_head_packed is not None

    def pack_weights(self) -> bool:
        """Pack the linear layers' weights for oneDNN (`pack_weight`), in place, once; the
        LM head is packed into a copy (`lm_head_packed`), since the embedding lookup and the
        proposers built on this model read `lm_head` as it is. Only CPU float32 models whose
        weights need no gradient; returns whether the model is packed. A layer's weights are
        then opaque tensors: read them through `dense`.

        Call it where a model starts serving (the engine, the model proposers); training
        code reads the layers as plain tensors. Layers shared with another model (e.g.
        `proposers.draft_model.with_layers`) are packed for both.
        """
        if self.packed:
            return True
        linears = [(layer, name) for layer in self.layers for name in LINEAR_WEIGHTS]
        if (self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_available()
                or self.lm_head.requires_grad or any(getattr(l, n).requires_grad for l, n in linears)):
            return False
        for layer, name in linears:
            w = getattr(layer, name)
            if not w.is_mkldnn:
                setattr(layer, name, pack_weight(w))
        self.lm_head_packed = pack_weight(self.lm_head)
        return True

    def gemm_rows(self, n: int) -> int:
        """Rows the linear layers run at for a pass of n tokens (padded on CPU only; packed
        weights pad one row to two: see the measurements above `onednn_available`)."""
        if self.device.type != "cpu":
            return n
        return max(n, 2) if self.packed else gemm_rows(n)

    def lm_head_rows(self, n: int) -> int:
        """Rows the LM head runs at for n wanted logits (padded on CPU only; packed: as the
        other linears)."""
        if self.packed:
            return self.gemm_rows(n)
        return lm_head_rows(n) if self.device.type == "cpu" else n

    def check_hidden_layers(self, hidden_layers: Sequence[int] | None) -> None:
        """Raise `ValueError` unless every index of `forward`'s `hidden_layers` names a layer
        (or, `num_layers`, the last one's output)."""
        if hidden_layers is not None and any(not 0 <= i <= len(self.layers) for i in hidden_layers):
            raise ValueError(f"hidden_layers {list(hidden_layers)}: this model has layers 0..{len(self.layers) - 1} "
                             f"(index {len(self.layers)}: the last one's output)")

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        slots: list[int],
        num_tokens: list[int],
        cache: KVCache,
        logits_index: torch.Tensor | None = None,
        hidden_index: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
        trees: Sequence[tuple[int, Sequence[int]] | None] | None = None,
        hidden_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one pass and append the new tokens' K/V to each sequence's slot.

        token_ids: int32/int64 [T], T = sum(num_tokens); sequence i owns the next
        num_tokens[i] entries and its tokens take positions cache.lens[slot_i] onwards.
        logits_index: int64 [R] flat indices of the tokens whose next-token logits are
        wanted (default: all T). Returns float32 logits [R, vocab].
        hidden_index: int64 [Q] flat indices whose final hidden states (after the final
        norm: the LM head's input, the feature EAGLE heads read) are wanted too; then the
        result is (logits, hidden [Q, hidden_size] in the model's dtype).
        hidden_layers: instead of the final hidden states, the residual stream entering each
        of these layers (index `num_layers`: the last layer's output, before the final norm),
        concatenated in this order: [Q, len(hidden_layers) * hidden_size]. EAGLE-3 heads read
        the target's at three depths, and feed back their own last layer's.
        input_embeds: [T, hidden] used instead of the token embeddings (an EAGLE head feeds
        its fused token-and-feature rows; `token_ids` then only gives T). An EAGLE-3 layer
        (`hidden_norm` set) reads both: the token embeddings and this residual stream.
        A layer whose `input_norm` is None and a model whose `final_norm` is None skip that
        norm (EAGLE-1 heads have neither).
        trees: per sequence None (a chain: causal, positions in cache order) or
        (tree_start, parents): the slot's cache entries from index tree_start up to the end
        of this pass are the nodes of a token tree, `parents[i]` the parent of the node at
        tree_start + i (-1: it continues the context before tree_start). A node takes
        position tree_start + its depth and attends keys before tree_start and its own
        ancestors; it is stored at the next free cache index as usual. Nodes before this
        pass's (cache.lens[slot] > tree_start) were stored by earlier passes.
        Example: two sequences verifying k = 2 and k = 0 → num_tokens [3, 1], T = 4.
        """
        c = self.config
        T = token_ids.shape[0]
        assert T == sum(num_tokens), f"{T=} {num_tokens=}"
        self.check_hidden_layers(hidden_layers)
        spans: list[_SeqSpan] = []
        positions = torch.empty(T, dtype=torch.int64)  # RoPE positions
        store = torch.empty(T, dtype=torch.int64)  # cache indices
        token_slots = torch.empty(T, dtype=torch.int64)
        offset = 0
        for i, (slot, n) in enumerate(zip(slots, num_tokens)):
            start = cache.lens[slot]
            end = start + n
            assert end <= cache.max_len, f"{slot=} needs {end} positions, cache holds {cache.max_len}"
            store[offset : offset + n] = torch.arange(start, end)
            token_slots[offset : offset + n] = slot
            tree = None if trees is None else trees[i]
            if tree is None:
                positions[offset : offset + n] = store[offset : offset + n]
                spans.append(_SeqSpan(slot, offset, n, end, None, n > 1 and start == 0))
            else:
                tree_start, parents = tree
                first = start - tree_start
                if first < 0 or len(parents) != end - tree_start:
                    raise ValueError(f"sequence {i}: a tree from cache index {tree_start} needs parents for "
                                     f"indices {tree_start}..{end - 1}, got {len(parents)}")
                depths = torch.tensor(tree_depths(parents)[first:], dtype=torch.int64)
                positions[offset : offset + n] = tree_start + depths
                blocked = torch.zeros(n, end, dtype=torch.bool)
                blocked[:, tree_start:] = ~tree_ancestors(parents)[first:]
                spans.append(_SeqSpan(slot, offset, n, end, blocked, False, tree=True))
            offset += n

        groups = [g for g in (_SpanGroup.of(spans, self.device), *_SpanGroup.gathered(spans, self.device))
                  if g is not None]  # `gathered` takes what `of` left
        for s in spans:  # the spans attending one by one: a continuation's causal mask
            if not s.grouped and not s.tree and s.num_tokens > 1 and not s.causal:
                # query j sits at position start + j and may attend keys 0 .. start + j
                rows = positions[s.token_start : s.token_start + s.num_tokens]
                s.blocked = torch.arange(s.kv_len).unsqueeze(0) > rows.unsqueeze(1)
        cos = self._cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self._sin[positions].unsqueeze(1)
        # [T_pad, hidden]; padding rows are dead
        rows = self.gemm_rows(T)
        embeds = None
        if input_embeds is None or any(layer.hidden_norm is not None for layer in self.layers):
            embeds = F.embedding(_pad_rows(token_ids.long(), rows), self.embed)
        h = embeds if input_embeds is None else _pad_rows(input_embeds, rows)
        captured: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if hidden_layers is not None and li in hidden_layers and hidden_index is not None:
                captured[li] = h.index_select(0, hidden_index)
            if layer.hidden_norm is not None:
                x = torch.cat([rms_norm(embeds, layer.input_norm, c.rms_norm_eps),
                               rms_norm(h, layer.hidden_norm, c.rms_norm_eps)], dim=-1)
            else:
                x = h if layer.input_norm is None else rms_norm(h, layer.input_norm, c.rms_norm_eps)
            a = self._attention(li, layer, x, spans, groups, store, token_slots, cos, sin, cache)
            if self.all_reduce is not None:  # a tensor-parallel share: its heads' part of the sum
                self.all_reduce(a[:T])  # the real rows (ranks may pad differently)
            h = h + a
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = linear(x, layer.w_gate_up).chunk(2, dim=-1)
            m = linear(F.silu(gate) * up, layer.w_down)
            if self.all_reduce is not None:
                self.all_reduce(m[:T])
            h = h + m
        for span in spans:
            cache.lens[span.slot] = span.kv_len
        if logits_index is None:
            logits_index = torch.arange(T)

        def final(index: torch.Tensor) -> torch.Tensor:
            x = h.index_select(0, index)
            return x if self.final_norm is None else rms_norm(x, self.final_norm, c.rms_norm_eps)

        R = logits_index.shape[0]
        head = self.lm_head if self.lm_head_packed is None else self.lm_head_packed
        logits = linear(_pad_rows(final(logits_index), self.lm_head_rows(R)), head)[:R].float()
        if self.gather_logits is not None:  # this share's vocabulary -> every id's, on rank 0
            logits = self.gather_logits(logits)
        if hidden_index is None:
            return logits
        if hidden_layers is None:
            return logits, final(hidden_index)
        if len(self.layers) in hidden_layers:
            captured[len(self.layers)] = h.index_select(0, hidden_index)
        return logits, torch.cat([captured[i] for i in hidden_layers], dim=-1)

    def _attention(
        self,
        li: int,
        layer: LayerWeights,
        x: torch.Tensor,
        spans: list[_SeqSpan],
        groups: list[_SpanGroup],
        store: torch.Tensor,
        token_slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        c = self.config
        T = store.shape[0]  # real tokens; x may carry padding rows after them
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = linear(x, layer.wqkv, layer.bqkv)[:T]
        # RoPE on q and k heads together: [T, H + Hkv, D]
        qk = qkv[:, : (H + Hkv) * D].reshape(T, H + Hkv, D)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * D :]
        # Advanced indices on dims 0 and 2 → the indexed view is [T, Hkv, D].
        cache.k[li][token_slots, :, store] = k
        cache.v[li][token_slots, :, store] = v.reshape(T, Hkv, D)
        out = torch.zeros(x.shape[0], H, D, dtype=x.dtype)
        for group in groups:
            out[group.token_index] = _group_attention(q, cache.k[li], cache.v[li], group)
        for s in spans:
            if s.grouped:
                continue
            rows = slice(s.token_start, s.token_start + s.num_tokens)
            k_s = cache.k[li, s.slot, :, : s.kv_len]  # [Hkv, L, D]
            v_s = cache.v[li, s.slot, :, : s.kv_len]
            if s.causal:  # prefill from position 0: the fused kernel wins on long inputs
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0), k_s.unsqueeze(0), v_s.unsqueeze(0),
                    is_causal=True, enable_gqa=True,
                )
                out[rows] = o[0].transpose(0, 1)
            else:
                out[rows] = _grouped_attention(q[rows], k_s, v_s, s.blocked)
        return linear(out.view(x.shape[0], H * D), layer.wo)
