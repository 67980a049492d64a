"""KV caches: contiguous per-slot and paged."""
