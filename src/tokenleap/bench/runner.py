"""The bench loop: warm-up, interleaved requests, an append-only log, resume, then the outputs.

Protocol (figures defined in docs/METRICS.md): one short warm-up generation per method is run and
discarded; for every prompt and repeat all methods run back to back, their order rotated from one
prompt to the next, so drift of the machine touches every method alike; each finished request is
appended to ``results.jsonl`` at once, so an interrupted run keeps what it measured and
``--resume`` runs only what is missing -- by whole (prompt, repeat) groups: a group some method lacks
(cut by the interruption, or a method added on resuming) runs again with every method, so each speedup
still compares requests run side by side. A peer that failed stays skipped on resuming.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenleap.config import SamplingParams
from tokenleap.models.cache_files import written_aside
from tokenleap.bench import summary as S
from tokenleap.bench.common import PEER, BenchError, BenchMethod, MethodInfo
from tokenleap.bench.datasets import BenchPrompt
from tokenleap.bench.machine import BUSY_SHARE, cpu_times, load_average, memory_status, others_share, peak_rss_mb

RESULTS_LOG, RUN_FILE, RESULTS_FILE = "results.jsonl", "run.json", "results.json"
SCHEMA = "tokenleap-bench/1"


@dataclass(frozen=True)
class BenchSettings:
    out_dir: Path
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    resume: bool = False
    chat: bool = True
    pass_at_1: bool = False
    warmup_tokens: int = 8
    progress: bool = True
    identity: dict[str, Any] = field(default_factory=dict)  # must match the run being resumed

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise BenchError("--repeats and --max-new-tokens must be >= 1")
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    def params(self, prompt_index: int, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens or self.max_new_tokens, temperature=self.temperature,
                              seed=self.seed + prompt_index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# -- output directory and the append-only log ----------------------------------------------------
def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse a file, and an existing, non-empty output directory unless resuming."""
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file, not a directory: choose another --out")
    parent = next((d for d in out.absolute().parents if d.exists()), None)
    if not out.exists() and parent is not None and not parent.is_dir():
        raise BenchError(f"--out {out}: {parent} is a file, not a directory: choose another --out")
    if out.exists() and not resume and any(out.iterdir()):
        raise BenchError(f"output directory {out} already exists and is not empty; pass --resume to "
                         "continue the run in it, or choose another --out (nothing is overwritten)")


def open_out_dir(settings: BenchSettings, started: str) -> tuple[Path, str | None]:
    """Create the output directory; refuse an existing one unless resuming a run of the same setup.
    A new run's ``run.json`` keeps its setup and its start, ``started``, so that a resumed run reports
    when the whole run began. Returns the directory and, when resuming, the first run's start (None for
    a new run, or a ``run.json`` that holds no start)."""
    out = settings.out_dir
    run_file = out / RUN_FILE
    check_out_dir(out, settings.resume)
    saved: dict[str, Any] = {}
    if settings.resume and run_file.is_file():
        saved = _read_run_file(run_file)
        _check_identity(saved.get("identity", {}), settings.identity)
    out.mkdir(parents=True, exist_ok=True)
    if not run_file.is_file():  # (whole or not at all: a run cut here can still be resumed)
        with written_aside(run_file) as tmp:
            tmp.write_text(json.dumps({"schema": SCHEMA, "identity": settings.identity, "started": started},
                                      indent=2) + "\n", encoding="utf-8")
    return out, saved.get("started")


def _read_run_file(run_file: Path) -> dict[str, Any]:
    """``run.json``'s object, or a ``BenchError`` that says the file is not a bench run's."""
    try:
        saved = json.loads(run_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot resume: {run_file} is not a bench run's file ({e}); choose another --out") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("identity", {}), dict):
        raise BenchError(f"cannot resume: {run_file} is not a bench run's file (not its JSON object); choose "
                         "another --out")
    return saved


def check_resume(out: Path, known: dict[str, Any]) -> None:
    """Before any model loads: a resumed run's settings that are ``known`` already (not the dtype or
    the chat template, which come with the model) against those saved in ``out``."""
    run_file = out / RUN_FILE
    if run_file.is_file():
        saved = _read_run_file(run_file).get("identity", {})
        shared = [k for k in known if k in saved]
        _check_identity({k: saved[k] for k in shared}, {k: known[k] for k in shared})


def _check_identity(old: dict[str, Any], new: dict[str, Any]) -> None:
    diff = [f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]
    if diff:
        raise BenchError("cannot resume: the run in this directory used other settings (" + "; ".join(diff)
                         + "); resume with the same settings or choose another --out")


class ResultsLog:
    """``results.jsonl``: one JSON object per finished request (or ``{"event": "failure"}``); a request run
    again (its group resumed) replaces the earlier record of the same (prompt, method, repeat), and a
    ``{"event": "dropped"}`` line takes one out (a failed peer's, where its group ran again without it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[tuple[str, str, int], dict] = {}
        self.failures: list[dict] = []
        if path.is_file():
            self._load()

    @property
    def records(self) -> list[dict]:
        return list(self._records.values())

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        good: list[str] = []
        for n, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # a write cut short by an interruption: drop it
                    self.path.write_text("".join(good), encoding="utf-8")
                    return
                raise BenchError(f"{self.path} line {n} is corrupt; delete that line to resume") from None
            if not _is_entry(obj):
                raise BenchError(f"{self.path} line {n} is not a bench request's record; delete that line to resume")
            good.append(line if line.endswith("\n") else line + "\n")
            self._add(obj)
        if lines and not lines[-1].endswith("\n"):
            self.path.write_text("".join(good), encoding="utf-8")

    def _add(self, obj: dict) -> None:
        if obj.get("event") == "failure":
            self.failures.append(obj)
        elif obj.get("event") == "dropped":
            self._records.pop(_key(obj), None)
        else:
            self._records[_key(obj)] = obj

    def drop(self, key: tuple[str, str, int]) -> None:
        """Take the record of (prompt, method, repeat) out, in the file too."""
        self.append({"event": "dropped", "prompt_id": key[0], "method": key[1], "repeat": key[2]})

    def done(self) -> set[tuple[str, str, int]]:
        return set(self._records)

    def append(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._add(obj)


def _key(obj: dict) -> tuple[str, str, int]:
    """A record's request: (prompt, method, repeat)."""
    return obj["prompt_id"], obj["method"], obj["repeat"]


def _is_entry(obj: Any) -> bool:
    """A request's record (its prompt, method, repeat and tokens), a failure event or a dropped record's."""
    if not isinstance(obj, dict):
        return False
    if obj.get("event") == "failure":
        return isinstance(obj.get("method"), str)
    keyed = (isinstance(obj.get("prompt_id"), str) and isinstance(obj.get("method"), str)
             and type(obj.get("repeat")) is int)
    return keyed and (obj.get("event") == "dropped" or isinstance(obj.get("token_ids"), list))


# -- the loop --------------------------------------------------------------------------------------
def schedule(num_prompts: int, repeats: int, methods: list[str]) -> list[tuple[int, int, str]]:
    """(prompt index, repeat, method), all methods of a prompt and repeat side by side, their
    order rotated by one place per step."""
    out, step = [], 0
    for pi in range(num_prompts):
        for rep in range(repeats):
            shift = step % len(methods)
            out += [(pi, rep, m) for m in methods[shift:] + methods[:shift]]
            step += 1
    return out


def _say(message: str) -> None:
    from tqdm import tqdm
    tqdm.write(message, file=sys.stderr)


class _Run:
    """State of one bench run: methods still active, the log, live equality warnings."""

    def __init__(self, settings: BenchSettings, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                 methods: list[BenchMethod], log: ResultsLog, stop_ids: list[tuple[int, ...]] | None = None) -> None:
        self.s, self.prompts, self.prompt_ids, self.log = settings, prompts, prompt_ids, log
        self.stop_ids = stop_ids or [()] * len(prompts)  # per prompt, tokens besides EOS that end a reply
        self.methods = {m.name: m for m in methods}
        # a peer that failed before an interruption stays skipped (its failure is the run's)
        self.failed: dict[str, str] = {f["method"]: f.get("error", "failed") for f in log.failures
                                       if f["method"] in self.methods}
        self.warned: set[tuple[str, str, int]] = set()  # requests already said to differ from plain's

    def fail(self, method: BenchMethod, prompt_id: str, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}"
        self.failed[method.name] = reason
        self.log.append({"event": "failure", "method": method.name, "prompt_id": prompt_id, "error": reason})
        _say(f"[bench] peer {method.name} failed ({reason}); it is skipped for the rest of the run (a --resume "
             "of it too: to try it again, start a new --out)")

    def params(self, pi: int, max_tokens: int | None = None) -> SamplingParams:
        params = self.s.params(pi, max_tokens)
        return replace(params, stop_token_ids=self.stop_ids[pi]) if self.stop_ids[pi] else params

    def warm_up(self, names: list[str]) -> None:
        for name in names:
            method = self.methods[name]
            try:
                method.generate(self.prompt_ids[0], self.params(0, min(self.s.warmup_tokens, self.s.max_new_tokens)))
                getattr(method, "forget_outputs", lambda: None)()  # (prompt 0 is measured next)
            except Exception as e:
                if method.kind != PEER:
                    raise
                self.fail(method, "(warm-up)", e)

    def run_one(self, pi: int, rep: int, name: str) -> None:
        method, prompt = self.methods[name], self.prompts[pi]
        try:
            g = method.generate(self.prompt_ids[pi], self.params(pi))
        except Exception as e:
            if method.kind != PEER:
                raise
            return self.fail(method, prompt.id, e)
        record = {"prompt_id": prompt.id, "category": prompt.category, "method": name, "kind": method.kind,
                  "repeat": rep, "prompt_tokens": len(self.prompt_ids[pi]), "num_tokens": len(g.token_ids),
                  "seconds": round(g.seconds, 4), "tokens_per_second": round(g.tokens_per_second, 3),
                  "finish_reason": g.finish_reason, "token_ids": g.token_ids, "text": g.text,
                  "stats": g.stats, "peak_rss_mb": peak_rss_mb(),
                  "finished_at": _dt.datetime.now().isoformat(timespec="seconds")}
        self.log.append(record)
        self._live_check(record)

    def _live_check(self, record: dict) -> None:
        """Warn at once when a request differs from plain's (greedy: any method; seeded sampling:
        tokenleap's methods, whose seeded tokens equal plain's)."""
        if not self.s.greedy and S.is_peer(record):
            return
        same = [r for r in self.log.records if r["prompt_id"] == record["prompt_id"]
                and (self.s.greedy or not S.is_peer(r))]
        ref = next((r for r in same if r["method"] == S.PLAIN), None)
        if ref is None:
            return
        for r in ([record] if record is not ref else same):
            diff = S.first_difference(r["token_ids"], ref["token_ids"])
            if r is not ref and diff is not None and _key(r) not in self.warned:
                self.warned.add(_key(r))
                what = "peer output differs (its own arithmetic)" if r["kind"] == PEER else "MISMATCH"
                _say(f"[bench] {what}: {r['method']} differs from plain on {r['prompt_id']} "
                     f"(repeat {r['repeat']}) at generated token {diff}")

    def todo(self) -> list[tuple[int, int, str]]:
        """The schedule's requests still to run: every (prompt, repeat) group that lacks a record of a
        method not failed runs whole -- its methods side by side in this session -- and a failed peer's
        record in such a group is dropped (it ran beside the plain run being replaced)."""
        done = self.log.done()
        order = [t for t in schedule(len(self.prompts), self.s.repeats, list(self.methods)) if t[2] not in self.failed]
        short = {(pi, rep) for pi, rep, name in order if (self.prompts[pi].id, name, rep) not in done}
        again = sum(1 for pi, rep, name in order if (pi, rep) in short and (self.prompts[pi].id, name, rep) in done)
        if again:
            _say(f"[bench] resuming: {again} finished request(s) run again beside the methods missing from their "
                 "prompt, so every speedup compares requests run side by side")
        for pi, rep in sorted(short):
            for name in self.failed:
                if (self.prompts[pi].id, name, rep) in done:
                    self.log.drop((self.prompts[pi].id, name, rep))
        return [t for t in order if (t[0], t[1]) in short]

    def loop(self) -> None:
        from tqdm import tqdm

        todo = self.todo()
        self.warm_up(list(dict.fromkeys(t[2] for t in todo)))
        bar = tqdm(total=len(todo), desc="bench", unit="req", disable=not self.s.progress, file=sys.stderr)
        with bar:
            for pi, rep, name in todo:
                if name not in self.failed:
                    bar.set_postfix_str(f"{name} {self.prompts[pi].id}")
                    self.run_one(pi, rep, name)
                bar.update(1)


def run_bench(settings: BenchSettings, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
              methods: list[BenchMethod], infos: list[MethodInfo] | None = None,
              context: dict[str, Any] | None = None,
              stop_ids: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Run (or resume) a bench and write results.json, report.md and the plots; returns results.
    ``stop_ids``: per prompt, tokens besides EOS that end its reply (every method honours them)."""
    if not prompts or len(prompts) != len(prompt_ids):
        raise BenchError("no prompts to run" if not prompts else "prompts and prompt_ids differ in length")
    names = [m.name for m in methods]
    if S.PLAIN not in names:
        raise BenchError("the method list must include plain: speedups and the equality check need it")
    now = _dt.datetime.now().isoformat(timespec="seconds")
    out, first_start = open_out_dir(settings, now)
    log = ResultsLog(out / RESULTS_LOG)
    # (a resumed run: started is the first run's start, resumed this part's)
    times = {"started": first_start, "resumed": now} if first_start else {"started": now}
    try:  # (from the moment the directory exists: a Ctrl-C says how to go on from it)
        run = _Run(settings, prompts, prompt_ids, methods, log, stop_ids)
        cpu_start = _warn_if_busy()
        run.loop()
    except KeyboardInterrupt:
        _say(f"[bench] interrupted: {len(log.records)} finished requests are kept in {log.path}; "
             "run the same command with --resume to continue")
        raise
    infos = _mark_failed(infos or [MethodInfo(m.name, m.name, m.kind) for m in methods], run.failed)
    busy = others_share(cpu_start, cpu_times())
    return finish(settings, prompts, log, infos, {**(context or {}), **times, "others_cpu_share": busy})


def _warn_if_busy() -> tuple[float, float, float] | None:
    """Half a second of the machine's CPU counters before the first request: where other processes are
    using the CPUs, say so before a long run rather than after. Returns the counters at the end of it."""
    import time
    before = cpu_times()
    time.sleep(0.5)
    after = cpu_times()
    share = others_share(before, after)
    if share is not None and share > BUSY_SHARE:
        _say(f"[bench] warning: other processes are using {share:.0%} of this machine's CPU time: every method "
             "will time slower and noisier than on an idle machine (compare runs made alike)")
    return after


def _mark_failed(infos: list[MethodInfo], failed: dict[str, str]) -> list[MethodInfo]:
    return [replace(i, status="failed", reason=f"failed at run time: {failed[i.name]}") if i.name in failed
            else i for i in infos]


def finish(settings: BenchSettings, prompts: list[BenchPrompt], log: ResultsLog, infos: list[MethodInfo],
           context: dict[str, Any]) -> dict[str, Any]:
    ids = {p.id for p in prompts}
    names = [i.name for i in infos]
    # (this run's prompts, methods and repeats: a run resumed with fewer --repeats keeps its other rows on disk)
    records = [r for r in log.records if r["prompt_id"] in ids and r["method"] in names
               and r.get("repeat", 0) < settings.repeats]
    if settings.pass_at_1:
        from tokenleap.bench.passk import score
        score(records, {p.id: p for p in prompts}, settings.chat)
    eq = S.equality(records, settings.greedy)
    results = {
        "schema": SCHEMA, **context, "finished": _dt.datetime.now().isoformat(timespec="seconds"),
        "load_average_end": load_average(),
        "settings": {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                     "seed": settings.seed, "repeats": settings.repeats, "chat": settings.chat,
                     "warmup_tokens": settings.warmup_tokens, "pass_at_1": settings.pass_at_1,
                     **settings.identity},
        "methods": [i.to_dict() for i in infos],
        "summary": S.summarize(records, [n for n in names if any(r["method"] == n for r in records)], eq),
        "equality": eq, "peak_rss_mb": peak_rss_mb(), "memory_at_end": memory_status(), "failures": log.failures, "requests": records,
    }
    write_outputs(results, settings.out_dir)
    return results


def write_outputs(results: dict[str, Any], out: Path) -> None:
    from tokenleap.bench.plots import write_plots
    from tokenleap.bench.report import console_summary, write_report

    results["plots"] = write_plots(results, out)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    write_report(results, out / "report.md")
    print(console_summary(results), file=sys.stderr)
