"""tokenleap bench with auto:old=1 -- auto as it was before commit 8cfef2e: a shadow arm (n-gram
lookup) with no proposal for the step never keeps the draft model from catching up
(Bandit._long_run_rate answers 0, so no such arm is predicted to beat the draft).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("old",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    if spec.get("old", None) == 1:
        p.bandit._long_run_rate = lambda *a, **k: 0.0
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
