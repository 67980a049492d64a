"""tokenleap bench with auto:share=P: auto whose bandit's explore_share is P percent (default 5).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: auto_variant.py
from auto_variant import run  # noqa: E402

run("share", lambda cfg, p: replace(cfg, explore_share=float(p) / 100))
