"""tokenleap bench with auto:old=1: auto without the probe of an arm gone stale across sequences
(``BanditConfig.stale_sequences`` = 0, auto as it was before that rule); auto runs as configured.
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("old",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    if spec.get("old", None) == 1:
        p.bandit.cfg = replace(p.bandit.cfg, stale_sequences=0)
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
