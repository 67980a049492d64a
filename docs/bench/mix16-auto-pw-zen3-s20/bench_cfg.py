"""tokenleap bench with auto:pw=W: auto whose sequences weigh the arm's prior acceptance as W
observations (``BanditConfig.prior_weight``; auto as configured: 1).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: auto_variant.py
from auto_variant import run  # noqa: E402

run("pw", lambda cfg, w: replace(cfg, prior_weight=float(w)))
