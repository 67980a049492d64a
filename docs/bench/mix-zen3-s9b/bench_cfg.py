"""tokenleap bench with auto:old=1 -- auto as it was before shadow arms' proposals were known
to the plan (Bandit.plan called without ``present``). Usage: python bench_cfg.py <tokenleap bench args>"""
import sys

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("old",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    if spec.get("old", None) == 1:
        plan = p.bandit.plan
        p.bandit.plan = lambda seq, batch, target, backlogs, remaining, max_k, present=None: plan(
            seq, batch, target, backlogs, remaining, max_k, None)
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
