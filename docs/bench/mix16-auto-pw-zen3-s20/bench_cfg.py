"""tokenleap bench with auto:pw=W: auto whose sequences weigh the arm's prior acceptance as W
observations (``BanditConfig.prior_weight``; auto as configured: 1).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("pw",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    weight = spec.get("pw", None)
    if weight is not None:
        p.bandit.cfg = replace(p.bandit.cfg, prior_weight=float(weight))
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
