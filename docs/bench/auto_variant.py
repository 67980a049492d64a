"""What the ``bench_cfg.py`` wrappers beside kept runs share: ``tokenleap bench`` with one more
option of the ``auto`` method, ``auto:NAME=V``, whose value changes the bandit's config
(``apply(config, V)`` -> the new config) for that method only; auto without the option runs as
configured. A wrapper says which option it adds and what it changes, and at which commit it runs."""
from __future__ import annotations

import sys
from typing import Any, Callable

from tokenleap.bench import common, methods
from tokenleap.cli.main import main


def install(option: str, apply: Callable[[Any, Any], Any]) -> None:
    """Register ``auto:<option>=V`` and patch the bench's auto method to apply it."""
    common.FAMILIES["auto"] = common.FAMILIES["auto"] + (option,)
    build = methods._auto

    def _auto(spec, pool):
        p = build(spec, pool)
        value = spec.get(option, None)
        if value is not None:
            p.bandit.cfg = apply(p.bandit.cfg, value)
        return p

    methods._auto = _auto


def run(option: str, apply: Callable[[Any, Any], Any]) -> None:
    """``install`` the option, then run ``tokenleap bench`` with this script's arguments."""
    install(option, apply)
    sys.exit(main(["bench"] + sys.argv[1:]))
