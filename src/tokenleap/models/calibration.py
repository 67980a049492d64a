"""The calibration behind ``--quant w8a8``'s smoothing: each float ``Linear``'s largest input per
channel over a forward of a built-in text (``activation_maxima``), stored on disk per model so that
only the first load pays for that forward (about 40 s for a 1.5B model on two cores).

The store is one safetensors file per model, dtype and calibration text under the cache
directory's ``calibration/``. A file that is unreadable or does not fit the model (other layer
names or widths, values that are not finite and non-negative) is measured again and replaced.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from tokenleap.models.cache_files import written_aside

log = logging.getLogger(__name__)

STORE_VERSION = 1  # bump when the measurement changes: older files then go unread

# What the calibration forward reads: code and prose of the kinds people ask a code model about,
# written for this purpose (not drawn from any benchmark prompt set).
CALIBRATION_TEXT = '''\
You are a helpful assistant. Answer the question, then show the code.

Question: how do I read a large CSV file in Python without loading it all into memory, and why
would streaming be faster than reading it whole on a small machine?

Reading a file row by row keeps only one row in memory at a time, so the program's footprint stays
small whatever the size of the input. The csv module of the standard library does this:

```python
import csv
from collections import Counter


def count_by_column(path: str, column: str) -> Counter:
    """Count the values of one column of a CSV file, one row at a time."""
    counts: Counter = Counter()
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            value = row.get(column)
            if value is not None:
                counts[value.strip().lower()] += 1
    return counts


if __name__ == "__main__":
    for name, n in count_by_column("orders.csv", "country").most_common(10):
        print(f"{name:20s} {n:8d}")
```

A few notes. Opening the file with newline="" lets the reader handle line breaks inside quoted
fields. If the file is compressed, gzip.open(path, "rt") returns a text stream the reader accepts
unchanged. For numeric work, pandas.read_csv(path, chunksize=100_000) yields data frames of that
many rows, which you can aggregate and discard; the total memory is then one chunk, not the file.

Now a JavaScript version of a debounce helper, and a short SQL query for comparison:

function debounce(fn, wait) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), wait);
  };
}

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders
WHERE created_at >= DATE '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY revenue DESC
LIMIT 20;

In short: stream the rows, keep running totals, and let the operating system's page cache do the
rest. Measure before optimising further; the disk, not the parser, is usually the limit.
'''


@torch.inference_mode()
def activation_maxima(model: nn.Module, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| each float ``Linear`` of ``model`` (a
    ``transformer.Transformer``) sees over a forward of ``tokens``, by module name."""
    from tokenleap.cache.contiguous import KVCache
    from tokenleap.models.linear import Linear
    from tokenleap.models.transformer import Segment

    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            def record(_mod, args, name=name):
                m = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(dim=0)  # [in]
                maxima[name] = m if name not in maxima else torch.maximum(maxima[name], m)
            hooks.append(mod.register_forward_pre_hook(record))
    try:
        cache = KVCache(model.config, 1, len(tokens) + 1, model.dtype)
        model.forward(torch.tensor(tokens), [Segment(0, 0, len(tokens))], cache)  # a prefill: the Python layers
    finally:
        for h in hooks:
            h.remove()
    return maxima


def maxima_path(cache_dir: Path | str | None, model_key: str, tokens: list[int]) -> Path:
    """Where the maxima of the model ``model_key`` (``checkpoint.model_key``) over ``tokens`` live."""
    from tokenleap.models.catalog import default_cache_dir
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(f"v{STORE_VERSION}:".encode() + torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return root / "calibration" / f"{model_key}-maxima-{digest.hexdigest()[:16]}.safetensors"


def _linear_widths(model: nn.Module) -> dict[str, int]:
    from tokenleap.models.linear import Linear
    return {name: mod.in_features for name, mod in model.named_modules() if isinstance(mod, Linear)}


def load_maxima(path: Path, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The stored maxima for ``model``, or None when there are none that fit it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not path.is_file():
        return None
    try:
        maxima = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as e:
        log.warning("ignoring the unreadable calibration %s (%s); measuring again", path, e)
        return None
    widths = _linear_widths(model)
    fits = set(maxima) == set(widths) and all(
        t.dtype == torch.float32 and t.shape == (widths[n],) and bool(torch.isfinite(t).all()) and bool((t >= 0).all())
        for n, t in maxima.items())
    if not fits:
        log.warning("ignoring the calibration %s: it does not fit this model; measuring again", path)
        return None
    return maxima


def save_maxima(path: Path, maxima: dict[str, torch.Tensor]) -> None:
    """Write atomically: a concurrent reader finds the old file, the new one, or none."""
    from safetensors.torch import save_file
    with written_aside(path) as tmp:
        save_file({n: t.float().contiguous() for n, t in maxima.items()}, str(tmp))


def stored_activation_maxima(model: nn.Module, tokens: list[int], path: Path) -> dict[str, torch.Tensor]:
    """The maxima stored at ``path`` when they fit ``model``; else measured now and stored there
    (a cache directory that cannot be written only costs the next load the same forward)."""
    maxima = load_maxima(path, model)
    if maxima is not None:
        return maxima
    maxima = activation_maxima(model, tokens)
    try:
        save_maxima(path, maxima)
    except OSError as e:
        log.warning("could not store the calibration at %s (%s)", path, e)
    return maxima


__all__ = ["CALIBRATION_TEXT", "activation_maxima", "load_maxima", "maxima_path", "save_maxima",
           "stored_activation_maxima"]
