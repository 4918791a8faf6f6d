"""The KV pool: every sequence's keys and values in memory the engine owns, written in place.

Layout (gpt-fast's one-slot-per-sequence, made to share one preallocated pool):

    pool.k, pool.v: [layers, kv_heads, max_tokens, head_dim]   (allocated once, at start)
    a sequence owns one contiguous range of token slots [start, start + capacity)
    its valid slots are [start, start + length); a step writes its new tokens at
    [start + length, start + length + q) and commits what it keeps by moving `length`

Why contiguous ranges rather than vLLM-style pages: without a paged attention kernel (none runs on
CPU here without a toolchain), pages must be gathered into one tensor before torch SDPA can read
them, which is a copy of the whole context per layer per step, the very cost this pool removes.
A contiguous range is read in place as a strided view `k[layer, :, start:start+L]`, for a chain, a
tree and a batch of sequences of different lengths alike (attention runs per sequence, so nothing
is padded to the longest). The price is fragmentation: a sequence reserves its range up front
(prompt + max_new_tokens + one round's draft slots, as the coordinator says at Prefill), and a
range that must grow extends into free neighbouring slots, or moves once to a free range large
enough (counted in `relocations`). When no range fits, admission answers UNAVAILABLE (KV cache
full); nothing ever allocates past the pool.

A `private` pool backs one standalone sequence (tests, benches, the draft worker's per-sequence
caches): it grows by reallocating itself.
"""

from __future__ import annotations

import bisect
import threading

import torch

from specmesh.errors import Unavailable


class KVPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", private: bool = False):
        if max_tokens < 1:
            raise ValueError("a KV pool needs at least one token slot")
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.device, self.private = torch.device(device), private
        shape = (num_layers, kv_heads, max_tokens, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=self.device)  # [layers, kv_heads, max_tokens, D]
        self.v = torch.empty(shape, dtype=dtype, device=self.device)
        self._free: list[tuple[int, int]] = [(0, max_tokens)]  # sorted (start, length) of free ranges
        self._lock = threading.Lock()
        self.relocations = 0

    @property
    def max_tokens(self) -> int:
        return self.k.shape[2]

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.k.element_size()

    def nbytes(self) -> int:
        return self.bytes_per_token() * self.max_tokens

    def free_tokens(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def largest_free(self) -> int:
        with self._lock:
            return max((n for _, n in self._free), default=0)

    # ------------------------------------------------------------------ ranges
    def _take(self, n: int) -> int:
        """First-fit: the start of a free range of n slots, now taken (lock held)."""
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._free[i : i + 1] = [(start + n, length - n)] if length > n else []
                return start
        raise Unavailable(f"KV cache full: no free range of {n} token slots "
                          f"({sum(x for _, x in self._free)} of {self.max_tokens} free)")

    def _give(self, start: int, n: int) -> None:
        """Return [start, start + n) to the free list, merged with its neighbours (lock held)."""
        i = bisect.bisect(self._free, (start, 0))
        if i < len(self._free) and start + n == self._free[i][0]:
            n += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start, n = self._free[i - 1][0], self._free[i - 1][1] + n
            self._free.pop(i - 1)
            i -= 1
        self._free.insert(i, (start, n))

    def allocate(self, capacity: int) -> SequenceKV:
        """A sequence owning `capacity` slots; raises Unavailable when no free range fits."""
        with self._lock:
            return SequenceKV(self, self._take(max(1, capacity)), max(1, capacity))

    def release(self, kv: SequenceKV) -> None:
        if kv.capacity == 0:
            return  # already released
        with self._lock:
            self._give(kv.start, kv.capacity)
        kv.capacity = kv.length = 0

    def grow(self, kv: SequenceKV, needed: int) -> None:
        """Make kv hold at least `needed` slots: extend into the free slots after it, else move it
        once to a free range (at least double, so moves stay rare), else raise Unavailable."""
        with self._lock:
            end = kv.start + kv.capacity
            i = bisect.bisect(self._free, (end, -1))
            if i < len(self._free) and self._free[i][0] == end and kv.capacity + self._free[i][1] >= needed:
                extra = needed - kv.capacity
                start, length = self._free[i]
                self._free[i : i + 1] = [(start + extra, length - extra)] if length > extra else []
                kv.capacity = needed
                return
            if self.private:
                self._reallocate(max(needed, 2 * self.max_tokens))
                self._free, kv.capacity = [], self.max_tokens  # its one sequence owns it all
                return
            new_cap = max(needed, min(2 * kv.capacity, needed + kv.capacity))
            try:
                start = self._take(new_cap)
            except Unavailable:
                start, new_cap = self._take(needed), needed
            self.k[:, :, start : start + kv.length] = self.k[:, :, kv.start : kv.start + kv.length]
            self.v[:, :, start : start + kv.length] = self.v[:, :, kv.start : kv.start + kv.length]
            self._give(kv.start, kv.capacity)
            kv.start, kv.capacity = start, new_cap
            self.relocations += 1

    def _reallocate(self, max_tokens: int) -> None:
        """Private pools only: a larger pool holding the old slots (the one sequence starts at 0)."""
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((*old.shape[:2], max_tokens, old.shape[3]), dtype=old.dtype, device=old.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)


class SequenceKV:
    """One sequence's range of a KVPool: slots [start, start + capacity), valid [.., + length)."""

    def __init__(self, pool: KVPool, start: int, capacity: int):
        self.pool, self.start, self.capacity, self.length = pool, start, capacity, 0

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def keys(self, layer: int, upto: int) -> torch.Tensor:
        """[kv_heads, upto, D] view of slots [0, upto) in place (no copy)."""
        return self.pool.k[layer, :, self.start : self.start + upto]

    def values(self, layer: int, upto: int) -> torch.Tensor:
        return self.pool.v[layer, :, self.start : self.start + upto]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write q new slots [length, length + q) of one layer in place. k, v: [kv_heads, q, D]."""
        q = k.shape[1]
        a = self.start + self.length
        self.pool.k[layer, :, a : a + q] = k
        self.pool.v[layer, :, a : a + q] = v

    def ensure(self, needed: int) -> None:
        if needed > self.capacity:
            self.pool.grow(self, needed)

    def commit(self, n: int, keep: torch.Tensor | None = None) -> None:
        """Keep new slots written by the last step: the first n in order, or (a tree) the slots
        keep[0..n) of that step moved down to [length, length + n) (at most n slots move)."""
        if keep is not None:
            keep = [int(x) for x in keep]
            n = len(keep)
            moved = [(i, j) for i, j in enumerate(keep) if i != j]
            if moved:
                a = self.start + self.length
                dst = torch.tensor([a + i for i, _ in moved], device=self.device)
                src = torch.tensor([a + j for _, j in moved], device=self.device)
                for t in (self.pool.k, self.pool.v):
                    t.index_copy_(2, dst, t.index_select(2, src))
        if self.length + n > self.capacity:
            raise ValueError(f"cannot commit {n} slots past a capacity of {self.capacity}")
        self.length += n

    def truncate(self, length: int) -> None:
        """Drop slots >= length (drafts that were rejected)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def nbytes(self) -> int:
        """Bytes of the valid part (what the cache holds for this sequence)."""
        return self.pool.bytes_per_token() * self.length

    def release(self) -> None:
        self.pool.release(self)


def model_kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of an HF causal LM."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def new_pool(model: torch.nn.Module, max_tokens: int, private: bool = False) -> KVPool:
    param = next(model.parameters())
    return KVPool(*model_kv_shape(model), max_tokens, param.dtype, param.device, private=private)


def new_sequence_kv(model: torch.nn.Module, capacity: int = 256) -> SequenceKV:
    """A standalone sequence in a private pool (grows by reallocating)."""
    return new_pool(model, capacity, private=True).allocate(capacity)
