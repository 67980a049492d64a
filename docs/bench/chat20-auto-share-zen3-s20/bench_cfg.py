"""tokenleap bench with auto:share=P: auto whose bandit's explore_share is P percent (default 5).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("share",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    share = spec.get("share", None)
    if share is not None:
        p.bandit.cfg = replace(p.bandit.cfg, explore_share=float(share) / 100)
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
