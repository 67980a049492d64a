"""Preallocated KV cache indexed by position, several sequences ("slots") at once.

Storage per layer: keys and values ``# [slots, kv_heads, max_len, head_dim]``. A sequence's
entries live at their token positions, so rolling back rejected draft tokens is just
``truncate(slot, length)`` -- O(1): entries past ``length`` are overwritten by later writes.
"""
from __future__ import annotations

import torch

from tokenleap.config import ConfigError, ModelConfig
from tokenleap.meminfo import meminfo


class CacheFullError(RuntimeError):
    """No free slot is left, or a write goes past the cache's maximum length."""


def layer_tensors(config: ModelConfig, shape: tuple[int, ...], dtype: torch.dtype, device, what: str
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed keys and values of ``shape`` for every layer; a ConfigError saying how much ``what``
    (the sizes that set it, e.g. "8 slots of 4096 tokens") asked for when memory cannot hold it --
    checked against the memory available (with free swap) first, because zeroing a cache the
    allocator grants but memory cannot hold gets the process killed, not an error."""
    size = 2 * config.num_hidden_layers * torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"the KV cache for {what} needs {size / 2**30:.1f} GiB, {why}: lower what sets its "
                           "size (sequences decoded at once, the context window, serve's --kv-cache-gb)")
    available = meminfo("MemAvailable") if torch.device(device).type == "cpu" else None
    swap = meminfo("SwapFree") or 0
    if available is not None and size > available + swap:
        free = f"{available / 2**30:.1f} GiB of memory" + (f" and {swap / 2**30:.1f} GiB of swap are" if swap
                                                            else " is")
        raise refuse(f"and {free} available")
    try:
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
    except (RuntimeError, MemoryError) as e:  # torch's allocator: "can't allocate memory"
        if "allocate" not in str(e) and not isinstance(e, MemoryError):
            raise
        raise refuse("more than this machine can allocate") from None
    return k, v


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (num_slots, config.num_key_value_heads, max_len, config.head_dim)
        self.k, self.v = layer_tensors(config, shape, dtype, device, f"{num_slots} slots of {max_len} tokens")
        self.max_len = max_len
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    # -- slot lifecycle ---------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            return
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def truncate(self, slot: int, length: int) -> None:
        """Forget every entry at position >= ``length`` (O(1): nothing is copied)."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length

    # -- data -------------------------------------------------------------------------------
    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``# [kv_heads, T, head_dim]`` at positions start .. start+T-1."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise CacheFullError(f"sequence of {end} tokens exceeds the KV cache's {self.max_len}")
        self.k[layer][slot, :, start:end] = k
        self.v[layer][slot, :, start:end] = v

    def slot_stores(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value stores of one slot, each ``# [kv_heads, max_len, head_dim]``, for a
        kernel that writes positions up to ``end`` itself."""
        if end > self.max_len:
            raise CacheFullError(f"sequence of {end} tokens exceeds the KV cache's {self.max_len}")
        return self.k[layer][slot], self.v[layer][slot]

    def prepare_rows(self, spans: list[tuple[int, int]]) -> list[int]:
        """Before a compiled layer writes positions up to ``end`` of each (slot, end): the capacity
        check ``write`` makes (CacheFullError); a contiguous cache needs no block tables."""
        for slot, end in spans:
            self.slot_stores(0, slot, end)
        return []

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. length-1, each ``# [kv_heads, length, head_dim]``."""
        return self.k[layer][slot, :, :length], self.v[layer][slot, :, :length]

    def read_at(self, layer: int, slot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given positions (``# [n]`` long), each ``# [kv_heads, n, head_dim]``."""
        return self.k[layer][slot].index_select(1, positions), self.v[layer][slot].index_select(1, positions)

    def compact(self, slot: int, start: int, sources: list[int]) -> None:
        """Move the entries at ``start + sources[j]`` to ``start + 1 + j`` in every layer (a token
        tree's accepted path into sequence order; ``sources`` ascending with ``sources[j] >= j + 1``,
        so no entry is overwritten before it is read); ``truncate`` then drops what follows."""
        for j, src in enumerate(sources):
            if src != j + 1:
                for store in self.k + self.v:
                    store[slot, :, start + 1 + j] = store[slot, :, start + src]

    def commit(self, slot: int, length: int) -> None:
        """Record that positions 0 .. length-1 of ``slot`` now hold valid entries."""
        self.lengths[slot] = length

    def attach_prompt(self, slot: int, prompt: list[int], window: int, salt: bytes = b"") -> int:
        """Prefix caching is the paged cache's (see ``PagedKVCache``): nothing is cached here."""
        return 0

    def register_prefill(self, slot: int, prompt: list[int], tokens: list[int], start: int, end: int, window: int,
                         salt: bytes) -> None:
        pass

    def register_computed(self, slot: int, tokens: list[int], end: int, window: int, salt: bytes = b"") -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
