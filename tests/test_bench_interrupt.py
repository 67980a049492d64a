"""A bench run interrupted once its directory exists says how to go on (even before its first request), and
a report without a draft model says so."""
from __future__ import annotations

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
