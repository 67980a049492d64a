"""tokenleap bench with auto:old=1: auto without the probe of an arm gone stale across sequences
(``BanditConfig.stale_sequences`` = 0, auto as it was before that rule); auto runs as configured.
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: auto_variant.py
from auto_variant import run  # noqa: E402

run("old", lambda cfg, old: replace(cfg, stale_sequences=0) if old == 1 else cfg)
