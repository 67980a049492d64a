"""tokenleap bench, resuming: a group of a prompt's methods runs whole in one session (a method added on
resuming runs beside plain again), a failed peer stays failed, damaged files in --out are refused in one
line; the report keeps peers' differences apart from tokenleap's mismatches; the speedup plot draws no bar
for a method that has no speedup in a category, and the draft-length plot joins only methods alike but for k."""
from __future__ import annotations

import pytest

from tokenleap.bench import BenchError, Generation, run_bench
from tokenleap.bench.common import PEER
from tokenleap.bench.runner import RESULTS_LOG, RUN_FILE
from tokenleap.cli.main import main

from test_bench import FAKE_IDS, FAKE_PROMPTS, SMOL, Fake, settings


class Timed(Fake):
    """A fake method whose every request takes ``seconds``."""

    def __init__(self, name: str, seconds: float, kind: str = "tokenleap", fail_at: int | None = None) -> None:
        super().__init__(name, kind, fail_at)
        self.seconds = seconds

    def generate(self, prompt_ids, params) -> Generation:
        g = super().generate(prompt_ids, params)
        return Generation(g.token_ids, g.text, self.seconds, g.finish_reason)


def test_a_method_added_on_resuming_runs_beside_plain_again(tmp_path, capsys):
    out = tmp_path / "o"
    run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Timed("plain", 1.0)])
    plain, ngram = Timed("plain", 0.5), Timed("ngram", 0.5)
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [plain, ngram])
    assert (plain.calls, ngram.calls) == (4, 4)  # a warm-up each, then every prompt again, side by side
    assert results["summary"]["overall"]["ngram"]["speedup"] == pytest.approx(1.0)  # not 2.0 across sessions
    assert {r["seconds"] for r in results["requests"]} == {0.5}  # the rerun's records replace the first run's
    assert "run again beside the methods missing" in capsys.readouterr().err
    again = [Timed("plain", 0.5), Timed("ngram", 0.5)]  # all done: nothing runs
    run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, again)
    assert [m.calls for m in again] == [0, 0]


def test_a_group_cut_by_the_interruption_runs_again_whole(tmp_path):
    out = tmp_path / "o"
    run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), Fake("ngram")])
    lines = (out / RESULTS_LOG).read_text().splitlines(keepends=True)
    (out / RESULTS_LOG).write_text("".join(lines[:-1]))  # the last prompt's second method never finished
    plain, ngram = Fake("plain"), Fake("ngram")
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [plain, ngram])
    assert (plain.calls, ngram.calls) == (2, 2)  # a warm-up each, then the last prompt's group
    assert results["summary"]["overall"]["ngram"]["requests"] == 3


def test_a_peer_that_failed_stays_skipped_on_resuming(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        class Cut(Fake):
            def generate(self, prompt_ids, params):
                if self.calls == 3:  # warm-up, q0, then interrupted at q1
                    raise KeyboardInterrupt
                return super().generate(prompt_ids, params)
        run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Cut("plain"), Fake("hf-plain", PEER, fail_at=2)])
    peer = Fake("hf-plain", PEER)
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), peer])
    assert peer.calls == 0
    info = {m["name"]: m for m in results["methods"]}
    assert info["hf-plain"]["status"] == "failed" and results["failures"][0]["method"] == "hf-plain"
    assert results["summary"]["overall"]["plain"]["requests"] == 3


@pytest.mark.parametrize("content", ["", "[]", '{"identity": 3}', "{not json"])
def test_a_damaged_run_file_is_refused_in_one_line(tmp_path, capsys, content):
    out = tmp_path / "o"
    out.mkdir()
    (out / RUN_FILE).write_text(content)
    with pytest.raises(BenchError, match="is not a bench run's file"):
        run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a bench run's file" in err and "Traceback" not in err


@pytest.mark.parametrize("line", ['{"a": 1}', "1", '{"prompt_id": "q0", "method": "plain"}'])
def test_a_line_that_is_no_request_record_is_named(tmp_path, line):
    out = tmp_path / "o"
    run_bench(settings(out), FAKE_PROMPTS[:1], FAKE_IDS[:1], [Fake("plain")])
    with open(out / RESULTS_LOG, "a") as f:
        f.write(line + "\n" + (out / RESULTS_LOG).read_text().splitlines()[0] + "\n")
    with pytest.raises(BenchError, match=r"line 2 is not a bench request's record"):
        run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])


def test_an_out_dir_below_a_file_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import tokenleap.bench.suite as suite

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(suite, "ModelPool", no_loading)
    (tmp_path / "afile").write_text("x")
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--out", str(tmp_path / "afile" / "sub")])
    err = capsys.readouterr().err
    assert rc == 2 and "afile is a file, not a directory" in err and "--out" in err, err


def test_the_report_keeps_peers_differences_apart_from_mismatches(tmp_path, capsys):
    class Off(Fake):
        def generate(self, prompt_ids, params):
            g = super().generate(prompt_ids, params)
            return Generation(g.token_ids[:-1] + [0], g.text, g.seconds, g.finish_reason)
    run_bench(settings(tmp_path / "o"), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), Off("hf-plain", PEER)])
    report = (tmp_path / "o" / "report.md").read_text()
    assert "MISMATCH" not in report and "Peers: 3 request(s) differ" in report and "`hf-plain` on `q0`" in report
    assert "not a losslessness failure" in capsys.readouterr().err
    run_bench(settings(tmp_path / "p"), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), Off("ngram"), Off("hf-plain", PEER)])
    report = (tmp_path / "p" / "report.md").read_text()
    assert "MISMATCH: 3 request(s) of tokenleap methods" in report and "Peers: 3 request(s) differ" in report


def test_the_speedup_plot_draws_no_bar_where_a_method_has_no_speedup(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from tokenleap.bench.plots import speedup_plot
    drawn: list[tuple[str, list[float]]] = []
    bar = Axes.bar

    def recording(self, x, height, *a, **kw):
        drawn.append((kw.get("label"), list(height)))
        return bar(self, x, height, *a, **kw)
    monkeypatch.setattr(Axes, "bar", recording)
    table = {"plain": {"speedup": 1.0}, "ngram": {"speedup": 1.5}, "peer": {"speedup": 0.8}}
    results = {"summary": {"overall": table, "by_category": {
        "a": table, "b": {"plain": {"speedup": 1.0}, "ngram": {"speedup": 1.2}, "peer": {"speedup": None}}}}}
    assert speedup_plot(results, tmp_path / "s.png")
    assert dict(drawn) == {"ngram": [1.5, 1.5, 1.2], "peer": [0.8, 0.8]}


def test_a_failed_peers_record_leaves_with_the_plain_run_it_ran_beside(tmp_path):
    out = tmp_path / "o"
    run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Timed("plain", 1.0), Timed("hf-plain", 1.0, PEER, fail_at=3)])
    first = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Timed("plain", 1.0), Fake("hf-plain", PEER)])
    assert [r["prompt_id"] for r in first["requests"] if r["method"] == "hf-plain"] == ["q0"]  # (nothing reran)
    results = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS,
                        [Timed("plain", 0.5), Timed("ngram", 0.5), Fake("hf-plain", PEER)])
    assert not [r for r in results["requests"] if r["method"] == "hf-plain"]  # its q0 ran beside the old plain
    assert "hf-plain" not in results["summary"]["overall"]
    again = run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS,
                      [Timed("plain", 0.5), Timed("ngram", 0.5), Fake("hf-plain", PEER)])
    assert not [r for r in again["requests"] if r["method"] == "hf-plain"]  # (dropped in the file too)


def test_a_request_that_differs_is_said_once(tmp_path, capsys):
    class Off(Fake):
        def generate(self, prompt_ids, params):
            g = super().generate(prompt_ids, params)
            return Generation(g.token_ids[:-1] + [0], g.text, g.seconds, g.finish_reason)
    out = tmp_path / "o"
    run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    capsys.readouterr()
    run_bench(settings(out, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), Off("ngram")])
    said = [line for line in capsys.readouterr().err.splitlines() if "MISMATCH: ngram differs" in line]
    assert len(said) == 3, said  # one a request, though plain ran again after some of them


def test_the_draft_length_plot_joins_only_methods_that_differ_in_k():
    from tokenleap.bench.plots import _by_draft_length
    methods = [("ngram:k=2,max=2", {"k": 2, "max": 2}), ("ngram:k=3,max=4", {"k": 3, "max": 4}),
               ("ngram:k=5,max=4", {"k": 5, "max": 4}), ("draft:k=2", {"k": 2}), ("draft:k=4", {"k": 4})]
    results = {"methods": [{"name": n, "family": n.partition(":")[0], "options": o} for n, o in methods],
               "summary": {"overall": {n: {"tokens_per_second": float(i + 1)} for i, (n, _) in enumerate(methods)}}}
    assert _by_draft_length(results) == {"ngram:max=2": [(2, 1.0)], "ngram:max=4": [(3, 2.0), (5, 3.0)],
                                         "draft": [(2, 4.0), (4, 5.0)]}
