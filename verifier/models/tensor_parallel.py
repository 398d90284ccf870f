"""Tensor parallelism for the verifier's target: one model split across processes.

Each layer is split the Megatron way. Rank r holds a contiguous share of the key/value
heads, with the query heads that attend through them (their rows of `wqkv`, their
columns of `wo`), and a contiguous share of the MLP's intermediate units (their rows of
the gate and up projections, their columns of `w_down`). Every rank computes its share's
partial output of the attention and of the MLP, and one all-reduce (a sum) per sub-layer
gives every rank the full residual stream. The LM head is split by vocabulary ids: each
rank computes its ids' logits and rank 0 gathers them. Embeddings and norms are
replicated. Shares need not be equal: SmolLM2-135M's 3 key/value heads split 2 + 1 over
two ranks (`shard_bounds`), and the MLP's units go 688 + 848 so that both ranks' linears
hold about as many weights (`mlp_bounds`). A rank holds its own share of the KV cache
(its heads).

Rank 0 is the engine's own model (`TensorParallelModel`, a `LlamaModel` the engine uses
like any other). Ranks 1.. are worker processes (`python -m verifier.models.tensor_parallel`)
that load the same checkpoint, keep their share and run every pass rank 0 runs: before a
pass rank 0 sends them its inputs (token ids, slots, token counts, trees) and the cache
lengths of its slots, the rows whose logits are wanted, and any `KVCache.keep` that moved entries since the last pass, over
a `multiprocessing.connection` socket (a random key). The all-reduces go through a file
every rank maps (`SharedMemoryAllReduce`, x86), else through a torch.distributed gloo
process group of the split's own (not the default group, so a process can hold several
splits). A worker exits when rank 0 closes the connection, or dies.

Only rank 0 returns logits and hidden states. The partial sums add in a fixed order
(rank 0's, then rank 1's, ...), so a given pass gives the same numbers every time; they
differ from the unsplit model's by rounding (summed in another order), so greedy output
under tensor parallelism is exact against plain decoding under tensor parallelism.

A failure in a pass (a worker gone, a collective timed out, an error on rank 0 after
the inputs went out) leaves the ranks out of step: the model then refuses every later
pass with the first error rather than pair up the wrong collectives.

Ranks run on CPU, as the verifier's model does everywhere today; on GPUs a split would
also need each rank's share placed on its device and NCCL for the all-reduces.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import logging
import multiprocessing.connection as mpc
import os
import secrets
import subprocess
import sys
import threading
import weakref
from typing import Any, Sequence

import torch

from verifier.errors import InvalidRequestError
from verifier.kv_cache import KVCache
from verifier.models.llama import LayerWeights, LlamaModel, dense

logger = logging.getLogger(__name__)

#: How long one all-reduce may wait for the other ranks (a pass's slowest layer on one
#: rank against another's), and a worker for rank 0's connection at start.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
#: Seconds rank 0 waits for every worker to load its share and report ready.
START_TIMEOUT_S = 600.0
_AUTHKEY_ENV = "SPLITSPEC_TP_AUTHKEY"


def shard_bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of `total` units, the first `total %
    world_size` ranks taking one more.

    >>> [shard_bounds(3, 2, r) for r in range(2)], [shard_bounds(1536, 3, r) for r in range(3)]
    ([(0, 2), (2, 3)], [(0, 512), (512, 1024), (1024, 1536)])
    """
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def check_world_size(num_kv_heads: int, world_size: int) -> None:
    """Every rank needs at least one key/value head (heads are not replicated)."""
    if world_size < 1 or world_size > num_kv_heads:
        raise InvalidRequestError("tensor_parallel_size", f"must be between 1 and the model's {num_kv_heads} "
                                  f"key/value heads, got {world_size}")


def mlp_bounds(num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, world_size: int,
               rank: int, align: int = 16) -> tuple[int, int]:
    """Rank's [start, end) of the MLP's units, sized so that every rank's linears hold
    about the same weights: a layer's attention takes (2 q + 2 kv) * head_dim rows of
    `hidden` from a rank with q query and kv key/value heads (q, k, v and o's columns),
    its MLP 3 per unit (gate, up and down). A rank with fewer heads takes more units;
    boundaries fall on multiples of `align`.

    SmolLM2-135M over two ranks: 16 * 64 rows of attention on rank 0 (heads 0-5 over 0-1)
    and 8 * 64 on rank 1, 1536 units: each should hold (1536 + 3 * 1536) / 2 = 3072 rows,
    so rank 0 takes (3072 - 1024) / 3 = 682.7 units, 688 on a multiple of 16.

    >>> [mlp_bounds(9, 3, 64, 1536, 2, r) for r in range(2)], mlp_bounds(8, 2, 64, 1536, 2, 1)
    ([(0, 688), (688, 1536)], (768, 1536))
    """
    group = num_heads // num_kv_heads
    attention = []
    for r in range(world_size):
        kv0, kv1 = shard_bounds(num_kv_heads, world_size, r)
        attention.append((2 * group + 2) * (kv1 - kv0) * head_dim)
    share = (sum(attention) + 3 * intermediate) / world_size
    ends, total = [0], 0.0
    for a in attention:
        total += max(share - a, 0.0) / 3
        ends.append(min(intermediate, int(round(total / align)) * align))
    ends[-1] = intermediate
    return ends[rank], max(ends[rank + 1], ends[rank])


def _share(c, rank: int, world_size: int) -> tuple[int, int, int, int, int, int]:
    """(kv0, kv1, q0, q1, i0, i1): rank's key/value heads, query heads and MLP units of a
    model with config `c`, each [start, end)."""
    check_world_size(c.num_kv_heads, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}")
    group = c.num_heads // c.num_kv_heads
    kv0, kv1 = shard_bounds(c.num_kv_heads, world_size, rank)
    i0, i1 = mlp_bounds(c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, world_size, rank)
    return kv0, kv1, kv0 * group, kv1 * group, i0, i1


def shard_layer(c, layer: LayerWeights, rank: int, world_size: int) -> LayerWeights:
    """Rank's share of one layer of a model with config `c` (see the module docstring)."""
    if layer.hidden_norm is not None:
        raise ValueError("tensor parallelism splits target models, not EAGLE-3 heads")
    kv0, kv1, q0, q1, i0, i1 = _share(c, rank, world_size)
    H, Hkv, D, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    qkv_rows = torch.cat([torch.arange(q0 * D, q1 * D),
                          torch.arange((H + kv0) * D, (H + kv1) * D),
                          torch.arange((H + Hkv + kv0) * D, (H + Hkv + kv1) * D)])
    gate_up_rows = torch.cat([torch.arange(i0, i1), torch.arange(inter + i0, inter + i1)])
    return LayerWeights(
        input_norm=layer.input_norm,
        wqkv=dense(layer.wqkv).index_select(0, qkv_rows).contiguous(),
        bqkv=None if layer.bqkv is None else layer.bqkv.index_select(0, qkv_rows).contiguous(),
        wo=dense(layer.wo)[:, q0 * D : q1 * D].contiguous(),
        post_norm=layer.post_norm,
        w_gate_up=dense(layer.w_gate_up).index_select(0, gate_up_rows).contiguous(),
        w_down=dense(layer.w_down)[:, i0:i1].contiguous(),
    )


def shard_model(model: LlamaModel, rank: int, world_size: int, layers_split: bool = False) -> LlamaModel:
    """Rank's share of `model` (see the module docstring); `layers_split`: its layers are
    already this rank's (`load_share`). The result's config counts its own heads and
    intermediate units, and its LM head holds rows `vocab_bounds` of the vocabulary;
    embeddings, norms and RoPE tables are the same tensors as `model`'s."""
    c = model.config
    kv0, kv1, q0, q1, i0, i1 = _share(c, rank, world_size)
    v0, v1 = shard_bounds(model.lm_head.shape[0], world_size, rank)
    layers = model.layers if layers_split else [shard_layer(c, layer, rank, world_size) for layer in model.layers]
    config = dataclasses.replace(c, num_heads=q1 - q0, num_kv_heads=kv1 - kv0, intermediate_size=i1 - i0)
    shard = LlamaModel(config, model.embed, layers, model.final_norm, model.lm_head[v0:v1].contiguous(), model.dtype)
    shard._cos, shard._sin = model._cos, model._sin  # RoPE tables (the rope scaling's factors included)
    shard.vocab_bounds, shard.vocab_rows = (v0, v1), model.lm_head.shape[0]
    shard.full_config = c  # the whole model's
    return shard


def load_share(path: str | None, dtype: str, rank: int, world_size: int) -> LlamaModel:
    """Rank's share of the checkpoint at `path` (None: the bundled model), each layer split
    as it is read: one whole layer at a time is in memory, beside the embeddings and the
    LM head (an untied head is freed once sliced)."""
    from verifier.models.loader import load_model

    model = load_model(path, dtype, layer_share=lambda c, layer: shard_layer(c, layer, rank, world_size))
    return shard_model(model, rank, world_size, layers_split=True)


def vocab_widths(vocab_size: int, world_size: int) -> list[int]:
    """The LM-head rows (vocabulary ids) of each rank, in rank order."""
    return [e - b for b, e in (shard_bounds(vocab_size, world_size, r) for r in range(world_size))]


def _store(host: str, port: int, rank: int, world_size: int):
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def _gloo_group(store, rank: int, world_size: int, host: str):
    """A gloo process group of its own (not torch.distributed's default one) over `store`."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _accept(listener: mpc.Listener, procs: list[subprocess.Popen]) -> list:
    """Every worker's connection, in rank order; fails if a worker exits first or none
    connects within `START_TIMEOUT_S`."""
    import socket
    import time

    listener._listener._socket.settimeout(1.0)  # wake up to look at the workers
    deadline = time.monotonic() + START_TIMEOUT_S
    by_rank: dict[int, Any] = {}
    while len(by_rank) < len(procs):
        try:
            conn = listener.accept()
        except (socket.timeout, TimeoutError):
            for rank, p in enumerate(procs, 1):
                if rank not in by_rank and p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.returncode} before it "
                                       "connected") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not connect in {START_TIMEOUT_S:.0f} s") from None
            continue
        by_rank[conn.recv()] = conn
    return [by_rank[r] for r in range(1, len(procs) + 1)]


def _expect(conn, rank: int, status: str, proc: subprocess.Popen) -> None:
    """Wait for a worker's `status` message; a worker's error or exit is raised here."""
    if not conn.poll(START_TIMEOUT_S):
        raise RuntimeError(f"tensor-parallel rank {rank} sent no {status!r} in {START_TIMEOUT_S:.0f} s")
    try:
        got, detail = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.wait()}) before {status!r}") from None
    if got != status:
        raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")


class SharedMemoryAllReduce:
    """An all-reduce (a sum, in place) through a file mapped by every rank of one machine.

    Rank r copies its tensor into its slot, publishes the call's number in its flag (its own
    64-byte line) and spins until every other rank's flag shows the same call, then sums
    the slots in rank order, so every rank holds the same bits. Slots alternate between
    two sets by the call's parity: a rank writes call n's set only after every rank
    published call n - 1, by which time each has finished reading call n - 2 from that set.
    x86 only (its stores are seen in the order they were made; elsewhere gloo). A tensor
    over `SHM_SLOT_BYTES` (a long prefill) goes to `fallback`. On two cores a decode pass of
    one sequence split over two ranks took 63 ms this way against 139 ms through gloo
    (60 all-reduces; `README.md`, "A target split over processes").

    The spin yields the CPU after `SPINS` checks, and every `CHECK_EVERY` checks asks
    `alive` whether the other ranks still run, and gives up after `COLLECTIVE_TIMEOUT`.
    """

    SPINS = 200
    CHECK_EVERY = 2000

    def __init__(self, path: str, rank: int, world_size: int, fallback, alive) -> None:
        import mmap

        import numpy as np

        self.rank, self.world_size, self._fallback, self._alive = rank, world_size, fallback, alive
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), shm_file_bytes(world_size))
        self._flags = np.frombuffer(self._mm, dtype=np.int64, count=8 * world_size)
        self._calls = 0
        self._slots: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def _slot(self, parity: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        key = (parity, rank, dtype)
        slot = self._slots.get(key)
        if slot is None:
            offset = 64 * self.world_size + (parity * self.world_size + rank) * SHM_SLOT_BYTES
            item = torch.empty(0, dtype=dtype).element_size()
            slot = self._slots[key] = torch.frombuffer(self._mm, dtype=dtype, count=SHM_SLOT_BYTES // item,
                                                       offset=offset)
        return slot

    def __call__(self, t: torch.Tensor) -> None:
        numel = t.numel()
        if numel * t.element_size() > SHM_SLOT_BYTES:
            self._fallback(t)
            return
        self._calls += 1
        n, parity = self._calls, self._calls & 1
        self._slot(parity, self.rank, t.dtype)[:numel].view(t.shape).copy_(t)
        self._flags[8 * self.rank] = n
        for r in range(self.world_size):
            if r != self.rank:
                self._wait(r, n)
        t.copy_(self._slot(parity, 0, t.dtype)[:numel].view(t.shape))
        for r in range(1, self.world_size):
            t.add_(self._slot(parity, r, t.dtype)[:numel].view(t.shape))

    def gather(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor | None:
        """Rank 0: [R, sum(widths)] float32, every rank's [R, widths[r]] `t` side by side in
        rank order; the other ranks: None. Passed in chunks of rows that fit a slot. Rank
        0 publishes a chunk's call once it has read it, and the others wait for that
        before going on, so a slot is never written before rank 0 has read it."""
        R = t.shape[0]
        rows = SHM_SLOT_BYTES // (4 * max(widths))
        if rows < 1:
            return _gather_by_sum(self._fallback, t, widths, self.rank)
        out = torch.empty(R, sum(widths), dtype=torch.float32) if self.rank == 0 else None
        starts = [sum(widths[:r]) for r in range(self.world_size)]
        for lo in range(0, R, rows):
            hi = min(lo + rows, R)
            self._calls += 1
            n, parity = self._calls, self._calls & 1
            if self.rank == 0:
                out[lo:hi, : widths[0]] = t[lo:hi]
                for r in range(1, self.world_size):
                    self._wait(r, n)
                    part = self._slot(parity, r, torch.float32)[: (hi - lo) * widths[r]].view(hi - lo, widths[r])
                    out[lo:hi, starts[r] : starts[r] + widths[r]] = part
                self._flags[0] = n
            else:
                self._slot(parity, self.rank, torch.float32)[: (hi - lo) * widths[self.rank]].view(
                    hi - lo, widths[self.rank]).copy_(t[lo:hi])
                self._flags[8 * self.rank] = n
                self._wait(0, n)
        return out

    def _wait(self, rank: int, n: int) -> None:
        import time

        flags, i, spins, deadline = self._flags, 8 * rank, 0, None
        while flags[i] < n:
            spins += 1
            if spins > self.SPINS:
                os.sched_yield()
            if spins % self.CHECK_EVERY == 0:
                now = time.monotonic()
                deadline = deadline or now + COLLECTIVE_TIMEOUT.total_seconds()
                if not self._alive() or now > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not reach all-reduce {n}"
                                       + ("" if now > deadline else ": it is gone"))

    def close(self) -> None:
        self._slots.clear()
        self._flags = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last one
            pass


#: Bytes of one rank's slot in one of the two sets of `SharedMemoryAllReduce` (2 MiB: a
#: pass of 900 tokens of SmolLM2's 576 dims in float32, 128 of a 4096-dim model's).
SHM_SLOT_BYTES = 2 << 20


def shm_file_bytes(world_size: int) -> int:
    """The mapped file: a 64-byte flag line per rank, then two sets of a slot per rank."""
    return 64 * world_size + 2 * world_size * SHM_SLOT_BYTES


def _shm_file(world_size: int) -> str:
    """A new zeroed file for `SharedMemoryAllReduce`, in /dev/shm where there is one."""
    import tempfile

    where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="splitspec-tp-", dir=where)
    try:
        os.ftruncate(fd, shm_file_bytes(world_size))
    finally:
        os.close(fd)
    return path


def shared_memory_usable() -> bool:
    """Whether `SharedMemoryAllReduce` may run here: x86, and not turned off by
    `SPLITSPEC_TP_ALLREDUCE=gloo`."""
    import platform

    return (platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("SPLITSPEC_TP_ALLREDUCE", "shm").lower() != "gloo")


def _gather_by_sum(all_reduce, t: torch.Tensor, widths: Sequence[int], rank: int) -> torch.Tensor | None:
    """`SharedMemoryAllReduce.gather` through an all-reduce: each rank's columns, zeros
    elsewhere, summed."""
    start = sum(widths[:rank])
    full = torch.zeros(t.shape[0], sum(widths), dtype=torch.float32)
    full[:, start : start + widths[rank]] = t
    all_reduce(full)
    return full if rank == 0 else None


def _logits_gatherer(all_reduce, vocab_size: int, rank: int, world_size: int):
    """The model's `gather_logits` hook for a rank: its LM head's columns to rank 0's full rows."""
    widths = vocab_widths(vocab_size, world_size)
    if isinstance(all_reduce, SharedMemoryAllReduce):
        return lambda t: all_reduce.gather(t, widths)
    return lambda t: _gather_by_sum(all_reduce, t, widths, rank)


def _reducer(group) -> Any:
    def all_reduce(t: torch.Tensor) -> None:
        if t.is_contiguous():
            group.allreduce([t]).wait()
            return
        c = t.contiguous()  # e.g. MKL's W @ x^T, a transposed view (`linear`)
        group.allreduce([c]).wait()
        t.copy_(c)
    return all_reduce


class ShardedKVCache(KVCache):
    """Rank 0's share of a KV cache; logs the `keep`s that moved entries, for the workers."""

    def __init__(self, cache_id: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.id = cache_id
        #: (slot, start, indices, the slot's length before): sent with the next pass.
        self.moves: list[tuple[int, int, list[int], int]] = []

    def keep(self, slot: int, start: int, indices: list[int]) -> bool:
        before = self.lens[slot]
        moved = super().keep(slot, start, indices)
        if moved:
            self.moves.append((slot, start, list(indices), before))
        return moved


class TensorParallelModel(LlamaModel):
    """Rank 0 of a tensor-parallel target: the engine's model. Build it with `start`."""

    def __init__(self, shard: LlamaModel, all_reduce, group, store, conns: list, procs: list) -> None:
        super().__init__(shard.config, shard.embed, shard.layers, shard.final_norm, shard.lm_head, shard.dtype)
        self._cos, self._sin = shard._cos, shard._sin
        #: The whole model's config (`config` is this rank's share: its heads, its units).
        self.full_config = shard.full_config
        self.world_size = len(conns) + 1
        self._group, self._store, self._conns, self._procs = group, store, conns, procs
        self.all_reduce = all_reduce
        self.gather_logits = _logits_gatherer(all_reduce, shard.vocab_rows, 0, self.world_size)
        self._cache_ids = itertools.count()
        #: Caches rank 0 no longer holds: the workers drop theirs with the next message.
        self._dropped: list[int] = []
        self._failed: BaseException | None = None
        self._send_lock = threading.Lock()  # a cache made on one thread while another runs a pass

    @classmethod
    def start(cls, path: str | None, dtype: str, world_size: int, threads: int | None = None,
              model: LlamaModel | None = None) -> "TensorParallelModel":
        """Split the target at `path` (None: the bundled model) over `world_size` ranks:
        this process (rank 0, keeping its share of `model` when given, else loading it) and
        `world_size - 1` worker processes started here, each loading the checkpoint itself.
        `threads`: torch threads of each worker (default: this process's). Every rank
        that loads the checkpoint keeps only its share of each layer as it reads it
        (`load_share`)."""
        if world_size < 2:
            raise InvalidRequestError("tensor_parallel_size", f"a split needs at least 2 ranks, got {world_size}")
        shard = None if model is None else shard_model(model, 0, world_size)  # refused before any worker starts
        del model
        host = "127.0.0.1"
        authkey = secrets.token_bytes(16)
        listener = mpc.Listener((host, 0), authkey=authkey)
        env = dict(os.environ, **{_AUTHKEY_ENV: authkey.hex()})
        procs: list[subprocess.Popen] = []
        conns: list = []
        shm_path = None
        try:
            for rank in range(1, world_size):
                cmd = [sys.executable, "-m", "verifier.models.tensor_parallel", "--rank", str(rank),
                       "--world-size", str(world_size), "--connect", f"{host}:{listener.address[1]}",
                       "--dtype", dtype, "--threads", str(threads or torch.get_num_threads())]
                if path is not None:
                    cmd += ["--model", str(path)]
                procs.append(subprocess.Popen(cmd, env=env))
            if shard is None:
                shard = load_share(path, dtype, 0, world_size)
            conns = _accept(listener, procs)
            for rank, conn in enumerate(conns, 1):
                _expect(conn, rank, "loaded", procs[rank - 1])
            # The store's master binds a free port; the workers learn it from their connection.
            store = _store(host, 0, 0, world_size)
            shm_path = _shm_file(world_size) if shared_memory_usable() else None
            for conn in conns:
                conn.send(("group", store.port, shm_path))
            group = _gloo_group(store, 0, world_size, host)
            all_reduce = _reducer(group)
            if shm_path is not None:
                all_reduce = SharedMemoryAllReduce(shm_path, 0, world_size, all_reduce,
                                                   alive=lambda: all(p.poll() is None for p in procs))
            for rank, conn in enumerate(conns, 1):
                _expect(conn, rank, "ready", procs[rank - 1])
        except BaseException:
            for conn in conns:
                conn.close()
            for p in procs:
                p.kill()
                p.wait()
            raise
        finally:
            listener.close()
            if shm_path is not None:
                os.unlink(shm_path)  # every rank has mapped it (or failed): nothing left behind
        logger.info("target split over %d ranks (all-reduce through %s), worker pids %s", world_size,
                    "shared memory" if shm_path is not None else "gloo", [p.pid for p in procs])
        return cls(shard, all_reduce, group, store, conns, procs)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def problem(self) -> str | None:
        """Why this split cannot run a pass (a failed pass, a worker that exited), or None."""
        for rank, p in enumerate(self._procs, 1):
            if p.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None if self._failed is None else f"the tensor-parallel group failed: {self._failed!r}"

    def new_cache(self, num_slots: int, max_len: int) -> ShardedKVCache:
        c = self.config
        cache = ShardedKVCache(next(self._cache_ids), c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim,
                               self.dtype, self.device)
        self._send(("cache", cache.id, num_slots, max_len))
        weakref.finalize(cache, self._dropped.append, cache.id)  # on any thread: only a list append
        return cache

    def _send(self, message: tuple) -> None:
        if self._failed is not None:
            raise RuntimeError(f"the tensor-parallel group failed earlier: {self._failed!r}") from self._failed
        try:
            with self._send_lock:
                dropped = self._dropped[:]
                del self._dropped[: len(dropped)]  # the finalizers hold this list: keep it
                for conn in self._conns:
                    conn.send(message + (dropped,))
        except BaseException as exc:
            self._fail(exc)
            raise RuntimeError(f"a tensor-parallel worker is gone: {exc!r}") from exc

    def _fail(self, exc: BaseException) -> None:
        """Out of step: stop the workers now (one may wait in a collective)."""
        self._failed = exc
        for p in self._procs:
            p.kill()
        self.close()

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, slots: list[int], num_tokens: list[int], cache: KVCache,
                logits_index: torch.Tensor | None = None, hidden_index: torch.Tensor | None = None,
                input_embeds: torch.Tensor | None = None,
                trees: Sequence[tuple[int, Sequence[int]] | None] | None = None,
                hidden_layers: Sequence[int] | None = None):
        if input_embeds is not None:
            raise ValueError("a tensor-parallel target reads token ids, not input_embeds")
        if not isinstance(cache, ShardedKVCache):
            raise ValueError("a tensor-parallel target needs a cache of its own (new_cache)")
        self.check_hidden_layers(hidden_layers)  # before the workers start the pass
        moves, cache.moves = cache.moves, []
        plain_trees = None if trees is None else [None if t is None else (int(t[0]), [int(p) for p in t[1]])
                                                  for t in trees]
        index = None if logits_index is None else logits_index.numpy(force=True)
        self._send(("forward", cache.id, [cache.lens[s] for s in slots], moves,
                    token_ids.numpy(force=True), list(slots), list(num_tokens), plain_trees, index))
        try:
            return super().forward(token_ids, slots, num_tokens, cache, logits_index, hidden_index, None,
                                   trees, hidden_layers)
        except Exception as exc:
            self._fail(exc)
            raise RuntimeError(f"a tensor-parallel pass failed, the group is stopped: {exc}") from exc
        except BaseException as exc:
            self._fail(exc)
            raise

    def close(self) -> None:
        """Stop the workers (they exit once their connection closes); idempotent."""
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._conns = []
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        if isinstance(self.all_reduce, SharedMemoryAllReduce):
            self.all_reduce.close()
        if self._failed is None:
            self._failed = RuntimeError("the tensor-parallel model was closed")


def _worker(args: argparse.Namespace) -> int:
    import signal

    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(args.threads)
    host, port = args.connect.rsplit(":", 1)
    conn = mpc.Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
    conn.send(args.rank)
    try:
        shard = load_share(args.model, args.dtype, args.rank, args.world_size)
        shard.pack_weights()
        conn.send(("loaded", None))
        _, store_port, shm_path = conn.recv()
        store = _store(host, store_port, args.rank, args.world_size)
        shard.all_reduce = _reducer(_gloo_group(store, args.rank, args.world_size, host))
        if shm_path is not None:
            parent = os.getppid()
            shard.all_reduce = SharedMemoryAllReduce(shm_path, args.rank, args.world_size, shard.all_reduce,
                                                     alive=lambda: os.getppid() == parent)
        shard.gather_logits = _logits_gatherer(shard.all_reduce, shard.vocab_rows, args.rank, args.world_size)
    except (EOFError, OSError):
        return 1  # rank 0 gave up
    except Exception as exc:
        conn.send(("error", repr(exc)))
        raise
    conn.send(("ready", None))
    caches: dict[int, KVCache] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0  # rank 0 closed the connection or is gone
        for cache_id in message[-1]:
            caches.pop(cache_id, None)
        if message[0] == "cache":
            _, cache_id, num_slots, max_len, _ = message
            caches[cache_id] = shard.new_cache(num_slots, max_len)
        elif message[0] == "forward":
            _, cache_id, lens, moves, token_ids, slots, num_tokens, trees, index, _ = message
            cache = caches[cache_id]
            for slot, start, indices, before in moves:
                cache.lens[slot] = before
                cache.keep(slot, start, indices)
            for slot, n in zip(slots, lens):
                cache.lens[slot] = n
            shard.forward(torch.from_numpy(token_ids), slots, num_tokens, cache,
                          None if index is None else torch.from_numpy(index), trees=trees)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A tensor-parallel worker (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--connect", required=True, help="rank 0's host:port")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    return _worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
