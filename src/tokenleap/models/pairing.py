"""The draft model ``--spec auto`` picks by itself (``--draft-model auto``, the CLI's default with
``--spec auto``): an installed catalog model of the target's tokenizer family, smaller than the
target, quantized to int4 (the fastest draft on every machine measured: BENCHMARKS §0, §1) -- and
only if the memory it needs is available now, so a user is never surprised by a load their
machine cannot hold. Nothing is installed or downloaded: on a fresh machine auto simply drafts
without a draft model (n-gram lookup and whatever needs no second model).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenleap.meminfo import meminfo

# catalog name -> tokenizer family (models of one family share the vocabulary, token for token)
TOKENIZER_FAMILY: dict[str, str] = {
    "qwen2.5-coder-1.5b-instruct": "qwen2.5",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5",
    "smollm2-135m-instruct": "smollm2",
    "gemma-3-270m": "gemma3",
}
AUTO_DRAFT_QUANT = "int4"
# resident bytes a loaded draft is assumed to need per byte of its GGUF file (float embeddings
# beside int4 weights, its KV cache): a conservative estimate
_MEMORY_PER_FILE_BYTE = 2.0
_HEADROOM = 1 << 30  # left free after the draft is loaded


@dataclass(frozen=True)
class DraftPick:
    """The draft chosen (None: none) and why, for ``--stats``."""

    name: str | None
    quant: str
    reason: str


def available_memory() -> int | None:
    """MemAvailable in bytes (None where it cannot be read)."""
    return meminfo("MemAvailable")


def _installed(name: str, cache_dir: str | Path | None) -> bool:
    from tokenleap.models.catalog import get_entry, joined_path, missing_packages
    return not missing_packages(get_entry(name)) or joined_path(name, Path(cache_dir) if cache_dir else None) is not None


def pick_draft(target: str, cache_dir: str | Path | None = None, quant: str | None = None,
               available: int | None = None) -> DraftPick:
    """The draft for ``target`` (a catalog name; anything else gets none). ``quant``: the user's
    ``--draft-quant`` when given (else int4); ``available``: free bytes (default: MemAvailable now)."""
    from tokenleap.models.catalog import CATALOG
    quant = quant or AUTO_DRAFT_QUANT
    family = TOKENIZER_FAMILY.get(target)
    if target not in CATALOG or family is None:
        return DraftPick(None, quant, f"no draft: {target} is not a catalog model whose tokenizer family is known "
                                      f"(pass --draft-model to use one)")
    size = CATALOG[target].size or 0
    same = sorted((e for n, e in CATALOG.items() if n != target and TOKENIZER_FAMILY.get(n) == family
                   and (e.size or 0) < size), key=lambda e: e.size or 0)
    if not same:
        return DraftPick(None, quant, f"no draft: the catalog has no smaller model with {target}'s tokenizer")
    installed = [e for e in same if _installed(e.name, cache_dir)]
    if not installed:
        return DraftPick(None, quant, f"no draft: none installed with {target}'s tokenizer "
                                      f"(tokenleap models install {same[-1].name} adds one)")
    entry = installed[-1]  # the largest installed: the best acceptance of those that are smaller
    need = int((entry.size or 0) * _MEMORY_PER_FILE_BYTE)
    free = available_memory() if available is None else available
    if free is not None and need + _HEADROOM > free:
        return DraftPick(None, quant, f"no draft: {entry.name} would need ~{need / 2**30:.1f} GiB and "
                                      f"{free / 2**30:.1f} GiB is available")
    room = f", ~{need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB available" if free is not None else ""
    return DraftPick(entry.name, quant, f"draft {entry.name} ({quant}): installed, the target's tokenizer{room}")
