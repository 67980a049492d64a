"""Keep Python's full garbage collections short while generating.

Importing PyTorch and loading a model leave ~300,000 long-lived Python objects (functions, tuples,
dicts of the tokenizer and the module tree). A generation-2 collection walks every tracked object,
and decoding allocates enough small objects to trigger one every few hundred steps: 150-320 ms
measured mid-generation on the 1.5B pair (a plain step is ~35 ms). Besides stalling the request, a
pause that lands inside a timed draft or forward teaches the draft-length controller a cost ten times
too high. Freezing the objects alive once loading is done (as vLLM does after start-up) moves them
to the permanent generation, which collections skip; objects made later are collected as before.
``TOKENLEAP_GC_FREEZE=0`` turns it off.
"""
from __future__ import annotations

import gc
import os


def enabled() -> bool:
    return os.environ.get("TOKENLEAP_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")


def freeze_long_lived() -> int:
    """Collect garbage, then move every object still alive into the permanent generation (a no-op
    when disabled); returns how many objects are frozen now."""
    if enabled():
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
