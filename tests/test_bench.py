"""tokenleap bench: datasets, method specs, the runner (resume, equality, failures), outputs, CLI.

The end-to-end tests run the harness on the real SmolLM2-135M with tiny limits; runner logic that
needs no model (failing peers, scheduling) uses fake methods.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenleap.bench import (BenchError, BenchPrompt, BenchSettings, Generation, ModelOptions, ModelPool,
                             build_methods, encode_prompts, load_dataset, parse_methods, run_bench)
from tokenleap.bench import codeedit as codeedit_mod
from tokenleap.bench import passk, peers
from tokenleap.bench.common import PEER, TOKENLEAP
from tokenleap.bench.runner import RESULTS_LOG, schedule
from tokenleap.bench.summary import equality, first_difference
from tokenleap.cli.main import main
from tokenleap.config import SamplingParams

SMOL = "smollm2-135m-instruct"
# short, repetitive prompts: quick prefill, and the n-gram proposer finds matches
PROMPTS = [
    BenchPrompt("p-list", "lists", "def f(a, b):\n    return a + b\n\ndef g(a, b):\n    return a +"),
    BenchPrompt("p-count", "counting", "one two three one two three one two"),
]


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(smollm2_gguf) -> ModelPool:
    p = ModelPool(ModelOptions(SMOL, max_len=128, threads=1))
    p.target()  # load once for the module
    return p


@pytest.fixture(scope="module")
def methods(pool):
    built, infos = build_methods(parse_methods("plain,ngram:k=3,max=3,min=1"), pool)
    assert [i.status for i in infos] == ["ok", "ok"]
    return built


@pytest.fixture(scope="module")
def prompt_ids(pool):
    return encode_prompts(pool.target().tokenizer, PROMPTS, chat=False)


def settings(out: Path, **kw) -> BenchSettings:
    base = dict(max_new_tokens=8, progress=False, chat=False, identity={"target": SMOL})
    return BenchSettings(out, **{**base, **kw})


class Corrupt:
    """Test-only method: plain decoding with one generated token changed."""

    kind, name = TOKENLEAP, "corrupt"

    def __init__(self, inner) -> None:
        self.inner = inner

    def generate(self, prompt_ids, params) -> Generation:
        g = self.inner.generate(prompt_ids, params)
        ids = list(g.token_ids)
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % 1000
        return Generation(ids, g.text, g.seconds, g.finish_reason, g.stats)


class Counting:
    """Wraps a method and counts its requests."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.kind, self.calls = inner, inner.name, inner.kind, 0

    def generate(self, prompt_ids, params) -> Generation:
        self.calls += 1
        return self.inner.generate(prompt_ids, params)


class Fake:
    """A model-free method: echoes the prompt; fails from request ``fail_at`` on."""

    def __init__(self, name: str, kind: str = TOKENLEAP, fail_at: int | None = None) -> None:
        self.name, self.kind, self.fail_at, self.calls = name, kind, fail_at, 0

    def generate(self, prompt_ids, params) -> Generation:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("peer crashed")
        ids = (prompt_ids * params.max_tokens)[: params.max_tokens]
        return Generation(ids, "x", 0.01, "length")


# -- the harness on SmolLM2 ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def main_run(tmp_path_factory, methods, prompt_ids):
    out = tmp_path_factory.mktemp("bench") / "run"
    results = run_bench(settings(out), PROMPTS, prompt_ids, [*methods, Corrupt(methods[0])])
    return out, results


def test_results_schema(main_run):
    out, results = main_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["schema"] == "tokenleap-bench/1"
    for key in ("settings", "methods", "summary", "equality", "requests", "peak_rss_mb", "started", "finished"):
        assert key in saved, key
    assert len(saved["requests"]) == 2 * 3
    req = next(r for r in saved["requests"] if r["method"] == "ngram:k=3,max=3,min=1")
    for key in ("prompt_id", "category", "repeat", "token_ids", "text", "seconds", "tokens_per_second",
                "prompt_tokens", "peak_rss_mb"):
        assert key in req, key
    assert req["stats"]["position_proposed"] and len(req["token_ids"]) == 8
    overall = saved["summary"]["overall"]
    assert overall["plain"]["speedup"] == 1.0 and overall["plain"]["mean_accepted_tokens"] == 1.0
    ngram = overall["ngram:k=3,max=3,min=1"]
    assert ngram["mean_accepted_tokens"] > 1.0 and ngram["per_position_acceptance"]
    reqs = [r for r in saved["requests"] if r["method"] == "ngram:k=3,max=3,min=1"]
    assert ngram["total_tokens_per_second"] == pytest.approx(
        sum(len(r["token_ids"]) for r in reqs) / sum(r["seconds"] for r in reqs), rel=1e-3)
    assert "| tok/s (median) | tok/s (total) |" in (out / "report.md").read_text()
    assert set(saved["summary"]["by_category"]) == {"lists", "counting"}
    assert len((out / RESULTS_LOG).read_text().splitlines()) == 6


def test_equality_check_catches_a_corrupted_method(main_run):
    out, results = main_run
    eq = results["equality"]
    assert eq["checked"]
    assert eq["by_method"]["ngram:k=3,max=3,min=1"] == {"compared": 2, "identical": 2}
    assert {m["method"] for m in eq["mismatches"]} == {"corrupt"}
    assert all(m["first_difference"] == 4 for m in eq["mismatches"])
    report = (out / "report.md").read_text()
    assert "MISMATCH" in report and "`corrupt`" in report


def test_report_and_plots_written(main_run):
    out, results = main_run
    report = (out / "report.md").read_text()
    assert "## Overall" in report and "## Category `lists`" in report and "| `plain` |" in report
    assert {"speedup.png", "acceptance.png"} <= set(results["plots"])
    for name in results["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_runs_only_missing_requests(tmp_path, methods, prompt_ids):
    out = tmp_path / "resume"
    run_bench(settings(out, max_new_tokens=4), PROMPTS[:1], prompt_ids[:1], methods)
    with open(out / RESULTS_LOG, "a") as f:
        f.write('{"prompt_id": "p-count", "meth')  # a write cut short by an interruption
    counted = [Counting(m) for m in methods]
    results = run_bench(settings(out, max_new_tokens=4, resume=True), PROMPTS, prompt_ids, counted)
    assert [c.calls for c in counted] == [2, 2]  # warm-up + the one new prompt
    assert len(results["requests"]) == 4
    assert len((out / RESULTS_LOG).read_text().splitlines()) == 4
    again = [Counting(m) for m in methods]
    run_bench(settings(out, max_new_tokens=4, resume=True), PROMPTS, prompt_ids, again)
    assert [c.calls for c in again] == [0, 0]  # nothing left: no warm-up either
    with pytest.raises(BenchError, match="other settings.*max_new_tokens"):
        run_bench(settings(out, max_new_tokens=5, resume=True, identity={"target": SMOL, "max_new_tokens": 5}),
                  PROMPTS, prompt_ids, methods)


def test_cli_end_to_end_with_hf_peer(smollm2_gguf, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--limit", "1", "--max-new-tokens", "4",
               "--methods", "ngram:k=2,hf-plain,llamacpp-plain", "--out", str(out), "--no-progress",
               "--seed", str(2**64 + 5)])  # (a seed past torch's 64 bits is reduced, as generate's are)
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    status = {m["name"]: m["status"] for m in results["methods"]}
    assert status["plain"] == "ok"  # added automatically
    assert results["settings"]["chat"] is True
    if status["hf-plain"] == "ok":  # same weights, same prompt ids: at worst a near-tie flips a later token
        assert results["equality"]["by_method"]["hf-plain"]["compared"] == 1
        assert all(m["first_difference"] > 0 for m in results["equality"]["mismatches"])
    if not peers._installed("llama_cpp"):
        assert status["llamacpp-plain"] == "skipped"
    assert results["machine"]["cpu_flags"].keys() >= {"avx512f", "amx_bf16"}
    assert results["versions"]["torch"] and results["command"].startswith("tokenleap bench")
    # how busy the machine was, at both ends (a loaded machine slows every engine, not all alike)
    assert len(results["machine"]["load_average"]) == len(results["load_average_end"]) == 3
    assert "- load average (1 / 5 / 15 min) at the start: " in (out / "report.md").read_text()
    said = capsys.readouterr().err.splitlines()[-1]  # the files named are the files written
    assert said.startswith(f"results in {out}/") and results["plots"]
    assert all(p in said and (out / p).is_file() for p in results["plots"])  # (names in the folder)


# -- runner logic with fake methods ---------------------------------------------------------------------
FAKE_PROMPTS = [BenchPrompt(f"q{i}", "c", "t") for i in range(3)]
FAKE_IDS = [[5, 6, 7], [8, 9], [10, 11, 12]]


def test_other_processes_cpu_use_is_warned_of_before_the_run_and_reported_after(tmp_path, monkeypatch, capsys):
    """Counters where others used 60% of the CPU time before the first request and 30% over the run:
    a warning at the start, the share in results.json, report.md and the closing table; an idle
    machine gets neither warning."""
    from tokenleap.bench import runner
    from tokenleap.bench.machine import cpu_times, others_share
    now = cpu_times()  # (the real counters: busy within total, this process's own seconds counted)
    assert now is None or (0 <= now[0] <= now[1] and now[2] > 0)
    # (busy, total, own): others = busy - own over total, each between two readings
    assert others_share((10.0, 100.0, 1.0), (16.0, 110.0, 2.0)) == 0.5
    assert others_share((10.0, 100.0, 1.0), (10.5, 110.0, 2.0)) == 0.0  # (own time counted late: not below 0)
    assert others_share(None, (1.0, 2.0, 0.0)) is None and others_share((1.0, 2.0, 0.0), (1.0, 2.0, 0.0)) is None
    for readings, warned, share in (([(0.0, 0.0, 0.0), (0.6, 1.0, 0.0), (3.6, 11.0, 0.0)], True, 0.3),
                                    ([(0.0, 0.0, 0.0), (0.5, 1.0, 0.5), (5.5, 11.0, 5.5)], False, 0.0)):
        it = iter(readings)
        monkeypatch.setattr(runner, "cpu_times", lambda: next(it))
        out = tmp_path / str(warned)
        results = run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
        err = capsys.readouterr().err
        assert ("[bench] warning: other processes are using 60% of this machine's CPU time" in err) == warned
        assert results["others_cpu_share"] == share
        assert ("warning: other processes used 30% of this machine's CPU time during the run" in err) == warned
        assert f"other processes' share of the CPU time during the run: {share:.0%}" in (out / "report.md").read_text()


def test_resumed_with_fewer_repeats_reports_only_those(tmp_path):
    out = tmp_path / "o"
    run_bench(settings(out, repeats=2), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    results = run_bench(settings(out, repeats=1, resume=True), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    assert sorted(r["repeat"] for r in results["requests"]) == [0, 0, 0]  # (the rows of repeat 1 stay on disk)
    assert results["summary"]["overall"]["plain"]["requests"] == 3


def test_resume_with_other_settings_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import tokenleap.bench.suite as suite
    out = tmp_path / "o"
    run_bench(settings(out, identity={"target": SMOL, "max_new_tokens": 8, "dataset": "chat"}),
              FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(suite, "ModelPool", no_loading)
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--max-new-tokens", "4", "--out", str(out), "--resume"])
    assert rc == 2 and "cannot resume" in capsys.readouterr().err
    # the threads a run's timings were taken with are part of its settings
    threaded = tmp_path / "t"
    run_bench(settings(threaded, identity={"target": SMOL, "max_new_tokens": 8, "dataset": "chat", "threads": 1}),
              FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--max-new-tokens", "8", "--threads", "2",
               "--out", str(threaded), "--resume"])
    assert rc == 2 and "threads: 1 then, 2 now" in capsys.readouterr().err


def test_failing_peer_is_reported_and_skipped(tmp_path):
    peer = Fake("hf-plain", PEER, fail_at=3)  # warm-up and one request pass, then it fails
    results = run_bench(settings(tmp_path / "o"), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), peer])
    info = {m["name"]: m for m in results["methods"]}
    assert info["hf-plain"]["status"] == "failed" and "peer crashed" in info["hf-plain"]["reason"]
    assert peer.calls == 3
    assert len([r for r in results["requests"] if r["method"] == "plain"]) == 3
    assert results["failures"][0]["method"] == "hf-plain"


def test_mismatch_is_announced_on_the_console(tmp_path, capsys):
    class Off(Fake):
        def generate(self, prompt_ids, params):
            g = super().generate(prompt_ids, params)
            return Generation(g.token_ids[:-1] + [0], g.text, g.seconds, g.finish_reason)
    results = run_bench(settings(tmp_path / "o"), FAKE_PROMPTS, FAKE_IDS, [Off("draft"), Fake("plain")])
    err = capsys.readouterr().err
    assert "MISMATCH: draft differs from plain on q0 (repeat 0) at generated token 7" in err
    assert "!!! MISMATCH: 3 request(s) of tokenleap methods" in err
    assert results["summary"]["overall"]["draft"]["mismatches"] == 3
    summary = {line.split()[0]: line.split(None, 4)[-1] for line in err.splitlines()
               if line.startswith(("draft ", "plain "))}
    assert summary["draft"].endswith("NO (3/3)") and summary["plain"].endswith("ref")  # (the report's words)


def test_seeded_sampled_run_is_checked_against_plain(tmp_path, capsys):
    """A sampled bench run is seeded per prompt: a tokenleap method that differs from plain is a
    mismatch (and fails the command), a peer is left out of the comparison."""
    class Off(Fake):
        def generate(self, prompt_ids, params):
            assert params.seed is not None and params.temperature == 0.7
            g = super().generate(prompt_ids, params)
            return Generation(g.token_ids[:-1] + [0], g.text, g.seconds, g.finish_reason)
    results = run_bench(settings(tmp_path / "o", temperature=0.7), FAKE_PROMPTS, FAKE_IDS,
                        [Fake("plain"), Off("draft"), Off("hf-plain", PEER)])
    eq = results["equality"]
    assert eq["checked"] and eq["mode"] == "seeded" and eq["not_compared"] == ["hf-plain"]
    assert {m["method"] for m in eq["mismatches"]} == {"draft"}
    err = capsys.readouterr().err
    assert "MISMATCH: draft differs from plain on q0" in err and "hf-plain differs" not in err
    report = (tmp_path / "o" / "report.md").read_text()
    assert "MISMATCH: 3 request(s)" in report and "not compared: `hf-plain`" in report
    assert "docs/METRICS.md" in report and "STYLE.md" not in report


def test_tokenleap_method_errors_are_not_swallowed(tmp_path):
    with pytest.raises(RuntimeError, match="peer crashed"):
        run_bench(settings(tmp_path / "o"), FAKE_PROMPTS, FAKE_IDS, [Fake("plain"), Fake("ngram", fail_at=2)])


def test_existing_out_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "results.json").write_text("{}")
    with pytest.raises(BenchError, match="already exists.*--resume"):
        run_bench(settings(out), FAKE_PROMPTS, FAKE_IDS, [Fake("plain")])
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--out", str(out)])
    assert rc == 2 and "already exists" in capsys.readouterr().err
    assert (out / "results.json").read_text() == "{}"
    for resume in ([], ["--resume"]):  # a file as --out: said so, not "pass --resume"
        rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--out", str(out / "results.json"), *resume])
        assert rc == 2 and "is a file, not a directory" in capsys.readouterr().err


def test_schedule_interleaves_and_rotates():
    s = schedule(2, 2, ["plain", "a", "b"])
    assert s[:3] == [(0, 0, "plain"), (0, 0, "a"), (0, 0, "b")]
    assert s[3:6] == [(0, 1, "a"), (0, 1, "b"), (0, 1, "plain")]
    assert len(s) == 12 and len(set(s)) == 12


def test_equality_and_own_baselines():
    def rec(method, pid, ids, rep=0):
        return {"method": method, "prompt_id": pid, "repeat": rep, "token_ids": ids}
    records = [rec("plain", "a", [1, 2, 3]), rec("plain", "a", [1, 2, 3], 1), rec("ngram", "a", [1, 2, 3]),
               rec("hf-plain", "a", [1, 2, 4]), rec("hf-assisted", "a", [1, 2, 4]), rec("draft", "a", [1, 2])]
    eq = equality(records, greedy=True)
    assert {(m["method"], m["first_difference"]) for m in eq["mismatches"]} == {
        ("hf-plain", 2), ("hf-assisted", 2), ("draft", 2)}
    assert eq["own_baseline"]["hf-assisted"] == {"compared": 1, "identical": 1, "reference": "hf-plain"}
    sampled = equality(records, greedy=False)  # seeded: tokenleap's methods against plain, peers not compared
    assert sampled["checked"] and sampled["mode"] == "seeded"
    assert {(m["method"], m["first_difference"]) for m in sampled["mismatches"]} == {("draft", 2)}
    assert sampled["by_method"]["ngram"] == {"compared": 1, "identical": 1}
    assert sampled["not_compared"] == ["hf-assisted", "hf-plain"] and "hf-plain" not in sampled["by_method"]
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1], [2]) == 0


# -- datasets and method specs ---------------------------------------------------------------------------
def test_malformed_jsonl_names_the_line(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "category": "x"\n')
    with pytest.raises(BenchError, match=r"line 3: not valid JSON \(.*, column \d+\)$"):
        load_dataset(str(path))
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(BenchError, match=r"line 2: .*\"prompt\""):
        load_dataset(str(path))
    rc = main(["bench", "--target", SMOL, "--dataset", str(path), "--out", str(tmp_path / "o")])
    assert rc == 2 and "line 2" in capsys.readouterr().err
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(BenchError, match="is not UTF-8 text"):
        load_dataset(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')  # a byte-order mark is read past
    assert [p.text for p in load_dataset(str(path)).prompts] == ["a"]


def test_user_jsonl_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": 7, "category": "x"}\n{"prompt": "b"}\n')
    ds = load_dataset(str(path), limit=5)
    assert [(p.id, p.category) for p in ds.prompts] == [("7", "x"), ("line2", "default")]


def test_unknown_dataset_and_methods_list_the_valid_ones(capsys):
    with pytest.raises(BenchError, match="humaneval, codeedit, chat"):
        load_dataset("mtbench")
    with pytest.raises(BenchError, match="valid methods: plain, draft, ngram, .*hf-plain"):
        parse_methods("plain,medusa")
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--pass-at-1", "--out", "/nonexistent/x"])
    assert rc == 2 and "--pass-at-1 runs the prompts' tests" in capsys.readouterr().err
    with pytest.raises(BenchError, match="option k is given twice"):
        parse_methods("ngram:k=3,k=4")
    with pytest.raises(BenchError, match="unknown option 'q=3'; valid options: k, kmax"):
        parse_methods("draft:q=3")
    with pytest.raises(BenchError, match="integer >= 1 or auto"):
        parse_methods("ngram:k=0")
    rc = main(["bench", "--target", SMOL, "--methods", "plain,spec", "--out", "/nonexistent/x"])
    assert rc == 2 and "unknown method 'spec'" in capsys.readouterr().err


def test_parse_methods_options_and_plain_first():
    specs = parse_methods("ngram:k=3,max=4,min=1,draft:k=auto,hf-prompt-lookup:k=5")
    assert [s.name for s in specs] == ["plain", "ngram:k=3,max=4,min=1", "draft:k=auto", "hf-prompt-lookup:k=5"]
    assert specs[1].get("max") == 4 and specs[2].get("k") == "auto" and specs[3].kind == PEER
    with pytest.raises(BenchError, match="listed twice"):
        parse_methods("plain,ngram,ngram")
    with pytest.raises(BenchError, match="'ngram:max=4,min=2' is listed twice"):  # the same options reordered
        parse_methods("ngram:max=4,min=2,ngram:min=2,max=4")


def test_a_category_named_overall_keeps_the_overall_bar():
    from tokenleap.bench.plots import speedup_groups
    overall, own, poem = {"ngram": {"speedup": 1.75}}, {"ngram": {"speedup": 1.0}}, {"ngram": {"speedup": 2.5}}
    groups = speedup_groups({"summary": {"overall": overall, "by_category": {"overall": own, "poem": poem}}})
    assert groups == [("overall", overall), ("overall", own), ("poem", poem)]


def test_builtin_datasets():
    he = load_dataset("humaneval")
    assert len(he.prompts) == 164 and he.prompts[0].id == "HumanEval/0"
    assert he.prompts[0].text.startswith("from typing import List")
    assert "```python" in he.prompts[0].user_message and "entry_point" in he.prompts[0].extra
    chat = load_dataset("chat")
    assert len(chat.prompts) >= 30 and {"explain", "debug", "design"} <= set(chat.categories)
    first, second = codeedit_mod.build_codeedit(), codeedit_mod.build_codeedit()
    assert first == second and len(first) == 4 * codeedit_mod.PER_KIND
    assert [d["category"] for d in first[:4]] == ["type-hints", "f-strings", "docstring", "rename"]
    assert all("```python\n" in d["prompt"] for d in first)
    assert load_dataset("codeedit", limit=6).total == len(first)


def test_missing_peer_package_is_skipped(monkeypatch):
    monkeypatch.setattr(peers, "_installed", lambda module: False)
    built, infos = build_methods(parse_methods("llamacpp-plain,hf-plain", add_plain=False),
                                 ModelPool(ModelOptions("unused-model")))
    assert built == []
    assert [i.status for i in infos] == ["skipped", "skipped"]
    assert "pip install llama-cpp-python==0.3.36 diskcache" in infos[0].reason
    # installed, but a module it imports is not (llama-cpp-python does not pull in diskcache): what to install
    monkeypatch.setattr(peers, "_installed", lambda module: True)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    built, infos = build_methods(parse_methods("llamacpp-plain", add_plain=False), ModelPool(ModelOptions("unused")))
    assert built == [] and infos[0].status == "failed" and "diskcache`" in infos[0].reason


# -- HumanEval pass@1 ---------------------------------------------------------------------------------------
def test_pass_at_1_runs_the_tests():
    problem = load_dataset("humaneval", limit=1).prompts[0]  # has_close_elements
    body = ("    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
            "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n")
    assert passk.run_program(passk.check_program(problem, body, chat=False)) == (True, "passed")
    chat_answer = ("Here it is:\n```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], "
                   "threshold: float) -> bool:\n" + body + "```\nDone.")
    assert passk.run_program(passk.check_program(problem, chat_answer, chat=True))[0]
    ok, why = passk.run_program(passk.check_program(problem, "    return True\n", chat=False))
    assert not ok and why.startswith("failed")
    assert passk.run_program("while True: pass\n", timeout=0.5) == (False, "timed out")


def test_plots_without_matplotlib_say_which_extra(monkeypatch, tmp_path, capsys):
    """matplotlib comes with the bench extra only: without it the bench refuses before any model
    loads, and drawing plots names the extra to install."""
    import sys
    from tokenleap.bench.plots import write_plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(BenchError, match=r"pip install 'tokenleap\[bench\]'"):
        write_plots({}, tmp_path)
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenleap[bench]" in err and len(err.strip().splitlines()) == 1


def test_a_method_may_name_its_own_draft_model(pool, prompt_ids, capsys, tmp_path):
    """``draft:model=NAME`` drafts with NAME instead of --draft (another tokenizer's or size's draft
    beside the --draft one in the same run): built without --draft, its output equals plain's; a
    name that is no model is refused before anything loads."""
    built, infos = build_methods(parse_methods(f"plain,draft:k=2,model={SMOL}"), pool)
    assert [i.status for i in infos] == ["ok", "ok"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain, draft = (m.generate(prompt_ids[0], params) for m in built)
    assert draft.token_ids == plain.token_ids and draft.stats["draft_tokens"] > 0
    assert pool.draft("x", SMOL) is pool.draft("y", SMOL)  # loaded once
    with pytest.raises(BenchError, match="needs a draft model"):
        pool.draft("draft")
    with pytest.raises(BenchError, match="option model needs a model name"):
        parse_methods("draft:model=")
    rc = main(["bench", "--target", SMOL, "--methods", "plain,cascade:model=no-such-model", "--out", "/nonexistent/x"])
    assert rc == 2 and "'no-such-model' is neither a catalog model" in capsys.readouterr().err
    rc = main(["bench", "--target", SMOL, "--methods", f"plain,draft:k=2,model={SMOL}", "--dataset", "chat",
               "--limit", "1", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "own")])
    assert rc == 0  # no --draft needed (it was refused: "need a draft model")


# -- code completion at a cursor (fill in the middle) ------------------------------------------------
def test_fim_dataset_gaps_and_scoring():
    """Each ``fim`` prompt is a HumanEval problem with the middle of its reference body taken out:
    the reference middle put back passes the tests, a wrong one fails."""
    ds = load_dataset("fim")
    assert ds.total == 164 and all(p.category == "fim" and p.extra["middle"].strip() for p in ds.prompts)
    for p in ds.prompts[:4]:
        assert passk.run_program(passk.check_program(p, p.extra["middle"], chat=True)) == (True, "passed"), p.id
    ok, _ = passk.run_program(passk.check_program(ds.prompts[0], "    pass\n", chat=True))
    assert not ok


def test_fim_prompts_encode_as_fim_and_stop_at_its_tokens(tmp_path):
    from test_fim import FimToy
    from serving_helpers import VOCAB, ChatToyTokenizer
    from tokenleap.bench.suite import encode_prompts, stop_ids
    from tokenleap.text.fim import encode_fim
    tok = FimToy(VOCAB)
    prompts = [BenchPrompt("a", "fim", "def f(", extra={"suffix": "): pass"}), BenchPrompt("b", "chat", "hello")]
    assert encode_prompts(tok, prompts, chat=False) == [encode_fim(tok, "def f(", "): pass")[0], tok.encode("hello")]
    assert stop_ids(tok, prompts) == [(93,), ()]
    seen = []

    class Recording(Fake):
        def generate(self, prompt_ids, params):
            seen.append((tuple(prompt_ids), params.stop_token_ids))
            return super().generate(prompt_ids, params)
    run_bench(settings(tmp_path / "run"), prompts, [[1, 2], [3]], [Recording("plain")], stop_ids=[(93,), ()])
    assert set(seen) == {((1, 2), (93,)), ((3,), ())}  # the FIM prompt's requests stop at its token, the other's not
    with pytest.raises(BenchError, match="prompt a fills in the middle"):
        encode_prompts(ChatToyTokenizer(VOCAB), prompts, chat=False)


def test_a_pooled_method_forgets_its_warm_up_and_refuses_repeats(pool, methods, prompt_ids, tmp_path, capsys):
    [pooled], _ = build_methods(parse_methods("ngram:k=3,max=3,min=1,pool=4096", add_plain=False), pool)
    store = pooled.engine.proposer.output_pool
    results = run_bench(settings(tmp_path / "run"), PROMPTS, prompt_ids, [methods[0], pooled])
    assert store.outputs == len(PROMPTS)  # the replies to the prompts, not the warm-up's (prompt 0 again)
    assert results["equality"]["by_method"]["ngram:k=3,max=3,min=1,pool=4096"]["identical"] == len(PROMPTS)
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--methods", "ngram:pool=100", "--repeats", "2",
               "--out", str(tmp_path / "again")])
    assert rc == 2 and "--repeats 1" in capsys.readouterr().err
    rc = main(["bench", "--target", SMOL, "--dataset", "chat", "--methods", "ngram:pool=100", "--resume",
               "--out", str(tmp_path / "run")])  # its pool would start empty
    assert rc == 2 and "run them again from the start" in capsys.readouterr().err


def test_vocab_0_is_the_full_head_and_an_overlong_prompt_is_named_first(smollm2_gguf, tmp_path, capsys):
    assert parse_methods("draft:vocab=0,k=2")[1].get("vocab") == 0
    with pytest.raises(BenchError, match="vocab must be an integer >= 0"):
        parse_methods("draft:vocab=-1")
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "hi", "id": "short"}\n{"prompt": "' + "word " * 9000 + '", "id": "huge"}\n')
    rc = main(["bench", "--target", SMOL, "--dataset", str(long), "--methods", "plain", "--max-new-tokens", "2",
               "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "prompt huge has" in capsys.readouterr().err and not (tmp_path / "o").exists()
