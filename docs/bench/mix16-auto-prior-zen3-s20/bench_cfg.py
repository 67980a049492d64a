"""tokenleap bench with auto:old=1 at commit 3b64c41 (the per-sequence prior, a trial reverted in
06a0182; at other commits BanditConfig has no ``prior_sequences``): auto:old=1 is auto whose new
sequences take the arm's acceptance over its recent drafts as their prior (``prior_sequences`` = 0),
which is auto as it is before and after that commit; auto runs the trial. run2/ was made at
3b64c41; run1/ with an uncommitted first form of the trial that weighed every finished sequence
alike (the plain mean instead of the mean weighed by observations up to ``prior_cap``).
Usage: python bench_cfg.py <tokenleap bench args>"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: auto_variant.py
from auto_variant import run  # noqa: E402

run("old", lambda cfg, old: replace(cfg, prior_sequences=0) if old == 1 else cfg)
