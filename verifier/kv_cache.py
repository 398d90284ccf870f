"""Preallocated KV cache with per-sequence slots, lengths and copy-free rollback.

Layout: `k`, `v`: [num_layers, num_slots, num_kv_heads, max_len, head_dim], allocated once.
A sequence owns one slot; `lens[slot]` counts its valid positions. Verification writes
k+1 positions past `lens[slot]`; rollback after a rejection only lowers `lens[slot]`
(the stale entries past it are never read — attention reads `[:lens]` — and are
overwritten by the next round). No tensor grows or is copied per step.
"""

from __future__ import annotations

import torch

from verifier.errors import OverloadedError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots
        self.lens = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_total(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def allocate(self) -> int:
        """Take a free slot (length 0); raises `OverloadedError` when none is free."""
        if not self._free:
            raise OverloadedError(f"all {self.num_slots} KV cache slots are in use")
        slot = self._free.pop()
        self.lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of {slot=}"
        self.lens[slot] = 0
        self._free.append(slot)

    def keep(self, slot: int, start: int, indices: list[int]) -> bool:
        """Keep, after the first `start` positions, only the entries at `indices` (ascending,
        each >= start), moved to start, start + 1, ...: the accepted path of a verified
        token tree. Copies len(indices) entries per layer, none when they are in place;
        returns whether any moved."""
        assert all(a < b for a, b in zip([start - 1] + indices, indices)), f"{start=} {indices=}"
        assert not indices or indices[-1] < self.lens[slot], f"{indices=} {self.lens[slot]=}"
        moved = [(start + j, i) for j, i in enumerate(indices) if i != start + j]
        if moved:
            dst = torch.tensor([d for d, _ in moved], device=self.k.device)
            src = torch.tensor([s for _, s in moved], device=self.k.device)
            for buf in (self.k, self.v):
                buf[:, slot, :, dst] = buf[:, slot, :, src]
        self.lens[slot] = start + len(indices)
        return bool(moved)

    def rollback(self, slot: int, new_len: int) -> None:
        """Keep only the first `new_len` positions of `slot` (rejected drafts are dropped)."""
        assert 0 <= new_len <= self.lens[slot], f"{new_len=} {self.lens[slot]=}"
        self.lens[slot] = new_len
