"""A bench run interrupted once its directory exists says how to go on (even before its first request), and
a report without a draft model says so; a resumed run reports the first run's start."""
from __future__ import annotations

import datetime
import types

import pytest

import tokenleap.bench.runner as runner
from tokenleap.bench.runner import run_bench

from test_bench import FAKE_IDS, FAKE_PROMPTS, Fake, settings


def test_a_ctrl_c_before_the_first_request_names_resume_and_resume_finishes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "_warn_if_busy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    err = capsys.readouterr().err
    assert "[bench] interrupted: 0 finished requests are kept" in err and "--resume" in err
    monkeypatch.undo()
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    assert results["summary"]["overall"]["plain"]["requests"] == 3
    assert "no draft model" in (out / "report.md").read_text()


def test_a_resumed_run_reports_the_first_run_s_start(tmp_path, monkeypatch):
    """The start is kept in the out dir's run.json: results.json and report.md name the interrupted first
    run's start as the run's, and the resumed part's start beside it."""
    out, clock = tmp_path / "o", {"now": datetime.datetime(2030, 1, 2, 3, 4, 5)}

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return clock["now"]
    monkeypatch.setattr(runner, "_dt", types.SimpleNamespace(datetime=Clock))

    class Interrupted(Fake):
        def generate(self, prompt_ids, params):
            if self.calls == 2:  # (the warm-up, then the first prompt: interrupted at the second)
                raise KeyboardInterrupt
            return super().generate(prompt_ids, params)
    with pytest.raises(KeyboardInterrupt):
        run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Interrupted("plain")])
    clock["now"] = datetime.datetime(2030, 1, 9, 10, 11, 12)
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    assert results["summary"]["overall"]["plain"]["requests"] == 3
    assert results["started"] == "2030-01-02T03:04:05" and results.get("resumed") == "2030-01-09T10:11:12"
    assert "- run: 2030-01-02T03:04:05 → 2030-01-09T10:11:12 (resumed 2030-01-09T10:11:12)" in \
        (out / "report.md").read_text()
    fresh = run_bench(settings(tmp_path / "fresh"), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    assert fresh["started"] == "2030-01-09T10:11:12" and "resumed" not in fresh
