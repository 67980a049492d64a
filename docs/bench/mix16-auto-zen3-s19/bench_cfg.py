"""tokenleap bench with auto:old=1 at commit 378bc73 (the first-look rule, reverted in d7bed57; at
other commits SeqArmState has no ``looked``): auto:old=1 is auto without that rule -- a draft model
that has not drafted for a sequence is probed only after probe_every idle steps, like one that has
(every new sequence's arms start as if they had looked), which is auto as it is before and after
that commit.
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys

from tokenleap.bench import common, methods
from tokenleap.cli.main import main

common.FAMILIES["auto"] = common.FAMILIES["auto"] + ("old",)
_orig = methods._auto


def _auto(spec, pool):
    p = _orig(spec, pool)
    if spec.get("old", None) == 1:
        new_sequence = p.bandit.new_sequence

        def looked_sequence():
            seq = new_sequence()
            for state in seq.arms.values():
                state.looked = True
            return seq

        p.bandit.new_sequence = looked_sequence
    return p


methods._auto = _auto
sys.exit(main(["bench"] + sys.argv[1:]))
