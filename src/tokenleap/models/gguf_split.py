"""Split GGUF files, as llama.cpp's ``gguf-split`` writes them and model repositories publish large
ones: ``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``, each shard a GGUF file of its own
(``split.no``, ``split.count``, ``split.tensors.count`` in its metadata), the first holding the model's
metadata, the tensors spread over all of them. Given the first shard, the others are found beside it
by that naming, as llama.cpp finds them."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from tokenleap.errors import ModelFormatError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_count(metadata: dict[str, Any]) -> int:
    """How many files the model is split over (1: not split)."""
    count = metadata.get(SPLIT_COUNT, 1)
    return count if isinstance(count, int) and count > 1 else 1


def named_shards(path: Path) -> list[Path]:
    """``path`` and its sibling shards by name alone (``path`` itself when its name is not a first
    shard's, or a sibling is missing): the files a cache key over a split model covers."""
    m = _SHARD_NAME.match(path.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) < 2:
        return [path]
    paths = _siblings(path, m["prefix"], int(m["count"]))
    return paths if all(p.is_file() for p in paths) else [path]


def shard_paths(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """Every shard of the split model whose shard ``path`` is (its header's ``metadata``), in order;
    a ``ModelFormatError`` that says what to do when ``path`` is not the first or a shard is missing."""
    count, no = shard_count(metadata), metadata.get(SPLIT_NO, 0)
    m = _SHARD_NAME.match(path.name)
    if m is None:
        raise ModelFormatError(f"{path} is one shard of a GGUF split into {count} files, but its name does not "
                               f"end in -0000K-of-{count:05d}.gguf, so the others cannot be found: keep the names "
                               "gguf-split gave them, or merge them (llama-gguf-split --merge FIRST OUT.gguf)")
    first = path.with_name(f"{m['prefix']}-00001-of-{count:05d}.gguf")
    if no != 0:
        raise ModelFormatError(f"{path} is shard {no + 1} of {count} of a split GGUF: give the first one, {first}")
    paths = _siblings(path, m["prefix"], count)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelFormatError(f"{path} is the first of {count} shards of a split GGUF, but {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} not beside it: download every shard into "
                               "one directory")
    return paths


def merged_tables(paths: list[Path], metadata: dict[str, Any], first: dict[str, Any],
                  read_header: Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The tensor tables of every shard as one (each entry's ``file``: its shard's index), checked
    against the shards' own split metadata; ``first``: the first shard's table."""
    tables = dict(first)
    for i, path in enumerate(paths[1:], 1):
        meta, table = read_header(path)
        if meta.get(SPLIT_NO) != i or shard_count(meta) != len(paths):
            raise ModelFormatError(f"{path} does not say it is shard {i + 1} of {len(paths)} (split.no "
                                   f"{meta.get(SPLIT_NO)!r}, split.count {meta.get(SPLIT_COUNT)!r}): the shards "
                                   "are of different splits")
        for name, info in table.items():
            if name in tables:
                raise ModelFormatError(f"tensor {name!r} is in more than one shard of {paths[0].name}")
            tables[name] = replace(info, file=i)
    expected = metadata.get(SPLIT_TENSORS)
    if isinstance(expected, int) and expected != len(tables):
        raise ModelFormatError(f"the {len(paths)} shards of {paths[0].name} hold {len(tables)} tensors where "
                               f"its split.tensors.count says {expected}: a shard is of another model or damaged")
    return tables


def _siblings(path: Path, prefix: str, count: int) -> list[Path]:
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
