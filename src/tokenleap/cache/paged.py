"""Paged KV cache: fixed-size blocks shared by all sequences, handed out as sequences grow.

Storage per layer: keys and values ``# [kv_heads, num_blocks, block_size, head_dim]``. Each sequence
("slot") owns a block table; position ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are taken when a write (or ``reserve``) needs them and given back when a
sequence is freed or truncated below them, so memory follows the tokens actually held, not the
context window.

Prefix caching: a window the engine computed (``register_prefix``: whole blocks) stays cached under
a key naming every token up to its end; a later sequence whose prompt starts with the same windows
takes those blocks instead of computing them (``attach_prefix``). A reused window must be bitwise
what prefill would write, so what a window is depends on how entries are computed
(``backend.prefix_windows``): where prompt windows are computed by a batched path, a fixed prefill
window of the prompt, computed by the same call whoever computes it (``register_window``); where
every position's entries are row-exact, single blocks of the prompt and the reply alike, whichever
calls computed them (``register_computed``), so a follow-up turn takes the whole conversation so far.
Blocks are reference-counted; a cached window no sequence holds is kept, least recently used first
out, until a block is needed -- so it counts as free.

The interface is ``KVCache``'s (``write``, ``read``, ``commit``, ``truncate``, ``allocate``,
``free``, ``lengths``, ``max_len``, ``nbytes``), so the Transformer and the proposers use either.
``read`` gathers a sequence's blocks into one contiguous ``# [kv_heads, length, head_dim]`` tensor,
so attention sees exactly the values the contiguous cache holds and the logits are bitwise equal
(tested). Heads come first in the storage so that the gather is a single ``index_select`` over the
block dimension whose result is already that contiguous layout: on CPU this is ~10x faster than
gathering ``[num_blocks, kv_heads, ...]`` blocks and transposing them.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from tokenleap.cache.contiguous import CacheFullError, layer_tensors
from tokenleap.config import ConfigError, ModelConfig


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, max_len: int, dtype: torch.dtype,
                 block_size: int = 16, num_slots: int = 64, device: torch.device | str = "cpu",
                 prefix_caching: bool = True) -> None:
        if block_size < 1 or num_blocks < 1 or num_slots < 1:
            raise ConfigError("a paged KV cache needs block_size, num_blocks and num_slots >= 1")
        shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
        self.k, self.v = layer_tensors(config, shape, dtype, device,
                                       f"{num_blocks} blocks of {block_size} tokens ({num_slots} sequences)")
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks  # block tables holding each block
        self.prefix_caching = prefix_caching
        self._windows: dict[bytes, tuple[int, ...]] = {}  # key -> blocks of a cached prompt window
        self._window_of: dict[int, bytes] = {}  # block -> key of the cached window it belongs to
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # cached windows nobody holds, LRU first
        self._idle_blocks = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (not computed)

    # -- slot lifecycle ---------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free_slots:
            raise CacheFullError(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free_slots:
            return
        self._release_blocks(slot, 0)
        self.lengths[slot] = 0
        self._free_slots.append(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def truncate(self, slot: int, length: int) -> None:
        """Forget every entry at position >= ``length`` and give back the blocks wholly past it."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length
        self._release_blocks(slot, self.blocks_for(length))

    # -- blocks -----------------------------------------------------------------------------
    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation can take: never used, or holding a cached window nobody holds."""
        return len(self._free_blocks) + self._idle_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(b) for b in self._windows.values())

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_slot_blocks(self, slot: int) -> int:
        return len(self.tables[slot])

    def blocks_needed(self, slot: int, length: int) -> int:
        """How many more blocks ``slot`` needs to hold ``length`` tokens."""
        return max(0, self.blocks_for(length) - len(self.tables[slot]))

    def can_reserve(self, slot: int, length: int) -> bool:
        """Whether ``reserve`` would succeed: cached windows nobody holds count as free (it evicts them)."""
        return self.blocks_needed(slot, length) <= self.num_free_blocks

    def reserve(self, slot: int, length: int) -> None:
        """Give ``slot`` blocks for ``length`` tokens, all or none (CacheFullError)."""
        if length > self.max_len:
            raise CacheFullError(f"sequence of {length} tokens exceeds the KV cache's {self.max_len}")
        need = self.blocks_needed(slot, length)
        if need > self.num_free_blocks:
            raise CacheFullError(f"KV cache out of blocks: need {need}, {self.num_free_blocks} free")
        self.tables[slot].extend(self._take() for _ in range(need))

    def _take(self) -> int:
        if not self._free_blocks:  # evict the least recently used cached window nobody holds
            key, _ = self._idle.popitem(last=False)
            blocks = self._windows.pop(key)
            self._idle_blocks -= len(blocks)
            for b in blocks:
                del self._window_of[b]
            self._free_blocks.extend(reversed(blocks))
        b = self._free_blocks.pop()
        self._refs[b] = 1
        return b

    def prepare_rows(self, spans: list[tuple[int, int]]) -> list[int]:
        """Before a compiled layer writes positions up to ``end`` of each (slot, end): reserve the
        blocks (CacheFullError as ``write`` would raise) and return the block tables covering them,
        one after another (see ``kernels.decoder_layer``)."""
        out: list[int] = []
        for slot, end in spans:
            if len(self.tables[slot]) * self.block_size < end:
                self.reserve(slot, end)
            out += self.tables[slot][: self.blocks_for(end)]
        return out

    def release_unused(self, slot: int) -> None:
        """Give back blocks reserved past the slot's committed length."""
        self._release_blocks(slot, self.blocks_for(self.lengths[slot]))

    def _release_blocks(self, slot: int, keep: int) -> None:
        table = self.tables[slot]
        while len(table) > keep:
            b = table.pop()
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            key = self._window_of.get(b)
            if key is None:
                self._free_blocks.append(b)
            elif all(self._refs[x] == 0 for x in self._windows[key]):  # its last holder let go
                self._idle[key] = None
                self._idle_blocks += len(self._windows[key])

    # -- prefix caching -----------------------------------------------------------------------
    def attach_prefix(self, slot: int, keys: list[bytes], window: int, queried: int | None = None) -> int:
        """Give an empty slot the cached windows ``keys[0], keys[1], ..`` (``window`` tokens each)
        up to the first one not cached; returns the tokens it now holds. ``queried``: the tokens the
        lookup counts as asked for (default: the windows'; a prompt's: all its tokens, as vLLM counts)."""
        if not self.prefix_caching or window % self.block_size or self.tables[slot]:
            return 0
        self.prefix_queries += len(keys) * window if queried is None else queried
        if not keys:
            return 0
        for n, key in enumerate(keys):
            blocks = self._windows.get(key)
            if blocks is None:
                break
            if key in self._idle:
                del self._idle[key]
                self._idle_blocks -= len(blocks)
            for b in blocks:
                self._refs[b] += 1
            self.tables[slot].extend(blocks)
        else:
            n = len(keys)
        self.lengths[slot] = n * window
        self.prefix_hits += n * window
        return n * window

    def attach_prompt(self, slot: int, prompt: list[int], window: int, salt: bytes = b"") -> int:
        """``attach_prefix`` for the windows of ``prompt`` before the one holding its last token (that
        one is always computed: its last row's logits are wanted); returns the tokens attached.
        ``salt`` starts the keys' chain: entries computed one way are never taken for another."""
        return self.attach_prefix(slot, prefix_keys(prompt, window, (len(prompt) - 1) // window, salt), window,
                                  queried=len(prompt))

    def register_window(self, slot: int, prompt: list[int], start: int, end: int, window: int) -> None:
        """``slot`` has computed positions ``start .. end - 1``: if that is a whole window of
        ``prompt``, cache it (``register_prefix``)."""
        if start % window == 0 and end - start == window and end <= len(prompt):
            w = start // window
            self.register_prefix(slot, w, prefix_keys(prompt, window, w + 1)[w], window)

    def register_prefill(self, slot: int, prompt: list[int], tokens: list[int], start: int, end: int, window: int,
                         salt: bytes) -> None:
        """``slot`` has just computed positions ``start .. end - 1`` of ``tokens`` (``prompt`` first):
        with ``salt`` (row-exact entries, ``backend.prefix_windows``) cache every whole window below
        ``end`` (``register_computed``), else the prompt window the call completed (``register_window``)."""
        if salt:
            self.register_computed(slot, tokens, end, window, salt)
        else:
            self.register_window(slot, prompt, start, end, window)

    def register_computed(self, slot: int, tokens: list[int], end: int, window: int, salt: bytes = b"") -> None:
        """Cache every whole window of ``tokens`` below position ``end`` that ``slot`` holds -- for
        entries that do not depend on how the positions were split into calls (row-exact ones), so
        windows computed across calls, or decoded, are what a prefill of them would write."""
        n = min(end, self.lengths[slot], len(tokens)) // window
        if not self.prefix_caching or window % self.block_size or n == 0:
            return
        for w, key in enumerate(prefix_keys(tokens, window, n, salt)):
            self.register_prefix(slot, w, key, window)

    def clear_prefix_cache(self) -> None:
        """Forget every cached window (blocks a sequence holds stay its own until released)."""
        for blocks in self._windows.values():
            for b in blocks:
                del self._window_of[b]
                if self._refs[b] == 0:
                    self._free_blocks.append(b)
        self._windows.clear()
        self._idle.clear()
        self._idle_blocks = 0

    def register_prefix(self, slot: int, index: int, key: bytes, window: int) -> None:
        """``slot``'s prompt window ``index`` (positions ``index * window`` onwards) has been
        computed: keep it cached under ``key`` (unless that key is cached already)."""
        if not self.prefix_caching or window % self.block_size or key in self._windows:
            return
        per = window // self.block_size
        blocks = tuple(self.tables[slot][index * per:(index + 1) * per])
        if len(blocks) < per or any(b in self._window_of for b in blocks):
            return
        self._windows[key] = blocks
        for b in blocks:
            self._window_of[b] = key

    # -- data -------------------------------------------------------------------------------
    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``# [kv_heads, T, head_dim]`` at positions start .. start+T-1."""
        end = start + k.shape[1]
        if len(self.tables[slot]) * self.block_size < end:
            self.reserve(slot, end)
        table, bs = self.tables[slot], self.block_size
        pos = start
        while pos < end:  # one copy per block touched
            block, off = table[pos // bs], pos % bs
            n = min(bs - off, end - pos)
            src = slice(pos - start, pos - start + n)
            self.k[layer][:, block, off:off + n] = k[:, src]
            self.v[layer][:, block, off:off + n] = v[:, src]
            pos += n

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length-1, each ``# [kv_heads, length, head_dim]`` (copies)."""
        nb = self.blocks_for(length)
        if nb > len(self.tables[slot]):
            raise CacheFullError(f"slot {slot} holds {len(self.tables[slot])} blocks, read needs {nb}")
        idx = torch.tensor(self.tables[slot][:nb], dtype=torch.long)  # [nb]
        return self._gather(self.k[layer], idx, length), self._gather(self.v[layer], idx, length)

    def read_at(self, layer: int, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given positions (``# [n]`` long), each ``# [kv_heads, n, head_dim]``."""
        table = torch.tensor(self.tables[slot], dtype=torch.long)  # [blocks of the slot]
        blocks, offsets = table[positions // self.block_size], positions % self.block_size  # [n], [n]
        return self.k[layer][:, blocks, offsets], self.v[layer][:, blocks, offsets]

    def compact(self, slot: int, start: int, sources: list[int]) -> None:
        """Move the entries at ``start + sources[j]`` to ``start + 1 + j`` in every layer (a token
        tree's accepted path into sequence order; see ``KVCache.compact``); ``truncate`` then drops
        what follows and gives back the blocks past it."""
        bs, table = self.block_size, self.tables[slot]
        for j, src in enumerate(sources):
            if src != j + 1:
                (db, do), (sb, so) = divmod(start + 1 + j, bs), divmod(start + src, bs)
                for store in self.k + self.v:
                    store[:, table[db], do] = store[:, table[sb], so]

    def _gather(self, store: torch.Tensor, idx: torch.Tensor, length: int) -> torch.Tensor:
        # store: [kv_heads, num_blocks, bs, hd] -> [kv_heads, nb, bs, hd] -> [kv_heads, length, hd]
        heads, _, bs, hd = store.shape
        return store.index_select(1, idx).view(heads, idx.shape[0] * bs, hd)[:, :length]

    def commit(self, slot: int, length: int) -> None:
        """Record that positions 0 .. length-1 of ``slot`` now hold valid entries."""
        self.lengths[slot] = length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks


def prefix_keys(tokens: list[int], window: int, n: int, salt: bytes = b"") -> list[bytes]:
    """Prefix-cache keys of the first ``n`` windows of ``tokens``: each names every token up to its
    window's end (a sha256 chain from ``salt``)."""
    data = array("q", tokens[:n * window]).tobytes()  # int64s, converted once (block windows are many)
    step = 8 * window
    keys, key = [], salt
    for w in range(n):
        key = hashlib.sha256(key + data[w * step:(w + 1) * step]).digest()
        keys.append(key)
    return keys


DEFAULT_KV_GB = 4.0  # a serving pool's budget unless the user sets one (see kv_budget_gb)


def kv_budget_gb(kv_cache_gb: float | None = None) -> float:
    """A serving pool's KV budget in GiB: ``kv_cache_gb`` as given; by default ``DEFAULT_KV_GB``, or half
    the memory available where that is less (the rest for a draft model and its cache, and the process),
    so a default never asks for memory the machine lacks (a pool under one sequence is raised to one)."""
    if kv_cache_gb is not None:
        return kv_cache_gb
    from tokenleap.meminfo import meminfo
    available = meminfo("MemAvailable")
    return DEFAULT_KV_GB if available is None else min(DEFAULT_KV_GB, available / 2 / 2**30)


def num_blocks_for_budget(config: ModelConfig, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes`` for this model."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    per_block = per_token * block_size * torch.empty(0, dtype=dtype).element_size()
    return max(1, budget_bytes // per_block)
