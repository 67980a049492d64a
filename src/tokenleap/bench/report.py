"""report.md and the console summary, from results.json's dictionary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenleap.bench.machine import BUSY_SHARE

_MAX_LISTED = 50


def _num(x: Any, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _positions(fig: dict[str, Any]) -> str:
    pos = fig.get("per_position_acceptance") or []
    return " ".join(f"{a:.2f}" for a in pos[:8]) + (" …" if len(pos) > 8 else "") if pos else "-"


def _equal_cell(fig: dict[str, Any], eq: dict[str, Any], method: str) -> str:
    if not eq["checked"] or method not in eq["by_method"]:  # a peer in a sampled run is not compared
        return "-"
    if fig["mismatches"]:
        return f"**NO ({fig['mismatches']}/{fig['requests']})**"
    return "ref" if method == "plain" else "yes"


def method_table(table: dict[str, dict], results: dict[str, Any]) -> list[str]:
    eq = results["equality"]
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    show_pass = any(f.get("pass_at_1") is not None for f in table.values())
    head = ["method", "kind", "tok/s (median)", "tok/s (total)", "speedup", "τ", "accept len", "draft accept",
            "per-position a_i", "draft time", "= plain", "requests"]
    head += ["pass@1"] if show_pass else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, f in table.items():
        cells = [f"`{name}`", kinds.get(name, "?"), _num(f["tokens_per_second"]), _num(f.get("total_tokens_per_second")),
                 _num(f["speedup"], ".2f", "×"),
                 _num(f.get("mean_accepted_tokens")), _num(f.get("acceptance_length")),
                 _num(f.get("draft_acceptance_rate"), ".1%"), _positions(f),
                 _num(f.get("draft_time_share"), ".0%"), _equal_cell(f, eq, name), str(f["requests"])]
        cells += [_num(f.get("pass_at_1"), ".1%")] if show_pass else []
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _setup(results: dict[str, Any]) -> list[str]:
    s, m, ds = results["settings"], results.get("machine", {}), results.get("dataset", {})
    flags = ", ".join(f for f, on in m.get("cpu_flags", {}).items() if on) or "-"
    versions = ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items() if v)
    cats = ", ".join(f"{c} ({n})" for c, n in ds.get("categories", {}).items())
    return [
        f"- command: `{results.get('command', '-')}`",
        f"- run: {results.get('started', '-')} → {results.get('finished', '-')}"
        + (f" (resumed {results['resumed']})" if results.get("resumed") else ""),
        f"- target: `{s.get('target')}` ({s.get('dtype')}, quant {s.get('quant')}); "
        + (f"draft: `{s['draft']}` (quant {s.get('draft_quant')})" if s.get("draft") else "no draft model"),
        f"- dataset: `{ds.get('name', s.get('dataset'))}`, {ds.get('num_prompts', '?')} prompts: {cats}",
        f"- decoding: {s['max_new_tokens']} new tokens max, temperature {s['temperature']}, "
        f"{s['repeats']} repeat(s), chat template {'on' if s['chat'] else 'off'}, warm-up excluded",
        f"- machine: {m.get('cpu', '?')}, {m.get('usable_cores', '?')} usable cores, "
        f"{m.get('memory_gb', '?')} GB; flags: {flags}; torch threads {m.get('torch_threads', '?')}",
        f"- load average (1 / 5 / 15 min) at the start: {_loads(m.get('load_average'))}, at the end: "
        f"{_loads(results.get('load_average_end'))}; other processes' share of the CPU time during the run: "
        f"{_share(results.get('others_cpu_share'))}",
        f"- versions: {versions}",
    ]


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _loads(loads: list[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in loads) if loads else "-"


def _equality(results: dict[str, Any]) -> list[str]:
    eq = results["equality"]
    if not eq["checked"]:
        return [f"Not checked: {eq.get('reason')}."]
    lines = []
    ours, peers = _split_mismatches(results)
    if ours:
        lines.append(f"**MISMATCH: {len(ours)} request(s) of tokenleap methods differ from `plain` token by token:**\n")
        lines += _listed(ours, bold=True)
    elif eq.get("mode") == "seeded":
        lines.append("Sampled run, seeded per prompt: every tokenleap method's output is token-identical to "
                     "`plain`'s seeded output for the same prompt.")
    else:
        lines.append("Every greedy output of a tokenleap method is token-identical to `plain`'s output for the "
                     "same prompt.")
    if peers:  # (not a losslessness failure: their kernels round differently)
        lines.append(f"\nPeers: {len(peers)} request(s) differ from tokenleap `plain`'s output:\n")
        lines += _listed(peers, bold=False)
    for name, c in eq["by_method"].items():
        lines.append(f"- `{name}`: {c['identical']}/{c['compared']} identical to `plain`")
    for name, c in eq.get("own_baseline", {}).items():
        lines.append(f"- `{name}`: {c['identical']}/{c['compared']} identical to its own `{c['reference']}`")
    if eq.get("not_compared"):
        lines.append(f"- not compared: {', '.join(f'`{n}`' for n in eq['not_compared'])} ({eq['reason']})")
    lines.append("\nPeers run other kernels (transformers on the dequantized weights, llama.cpp on the GGUF's "
                 "quantized blocks), so their outputs can differ from tokenleap's where two tokens are nearly tied.")
    return lines


def _split_mismatches(results: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The requests that differ from ``plain``'s: tokenleap methods' (a losslessness failure), peers'."""
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    mm = results["equality"].get("mismatches", [])
    return ([m for m in mm if kinds.get(m["method"]) == "tokenleap"],
            [m for m in mm if kinds.get(m["method"]) != "tokenleap"])


def _listed(mm: list[dict], bold: bool) -> list[str]:
    b = "**" if bold else ""
    lines = [f"- {b}`{m['method']}`{b} on `{m['prompt_id']}` (repeat {m['repeat']}): first difference at "
             f"generated token {m['first_difference']} ({m['method_tokens']} vs {m['reference_tokens']} tokens)"
             for m in mm[:_MAX_LISTED]]
    return lines + ([f"- … and {len(mm) - _MAX_LISTED} more (see results.json)"] if len(mm) > _MAX_LISTED else [])


def _methods_not_run(results: dict[str, Any]) -> list[str]:
    bad = [m for m in results["methods"] if m["status"] != "ok"]
    return [f"- `{m['name']}`: {m['status']} — {m['reason']}" for m in bad] or ["All methods ran."]


def _memory(results: dict[str, Any]) -> list[str]:
    end = results.get("memory_at_end", {})
    lines = [f"Peak RSS of the bench process (getrusage high-water mark): {results['peak_rss_mb']:.0f} MB; at the end "
             f"{_num(end.get('rss_anon_mb'), '.0f')} MB anonymous + {_num(end.get('rss_file_mb'), '.0f')} MB "
             "file-backed. All methods run in one process with every model loaded at once, so this is the whole "
             "run's figure, not any one method's. File-backed pages are memory-mapped weight files: counted once "
             "per mapping (tokenleap and transformers mapping the same converted file count it twice) and "
             "evictable, so RSS overstates the RAM in use. What each method added when it was built (models "
             "shared with earlier methods add nothing; the target, loaded first in "
             f"{_num(results.get('target_load_seconds'), '.1f', ' s')}, counts under the first method; "
             "transformers maps its weights lazily, so they show up once it runs):", "",
             "| method | load s | RSS after load MB | anonymous MB | file-backed MB | added MB |", "|---|---|---|---|---|---|"]
    before = results.get("rss_before_load_mb")
    for m in results["methods"]:
        after = m.get("rss_after_load_mb")
        added = after - before if after is not None and before is not None else None
        lines.append(f"| `{m['name']}` | {_num(m.get('load_seconds'), '.1f')} | {_num(after, '.0f')} | "
                     f"{_num(m.get('rss_anon_after_load_mb'), '.0f')} | {_num(m.get('rss_file_after_load_mb'), '.0f')} | "
                     f"{_num(added, '.0f')} |")
        before = after if after is not None else before
    return lines


def write_report(results: dict[str, Any], path: Path) -> None:
    lines = ["# tokenleap bench", "", *_setup(results), "", "## Overall", "",
             *method_table(results["summary"]["overall"], results)]
    for cat, table in results["summary"]["by_category"].items():
        shown = " ".join(str(cat).split()).replace("`", "'")  # (a dataset's own names: one line, no code fence)
        lines += ["", f"## Category `{shown}`", "", *method_table(table, results)]
    lines += ["", "## Output equality", "", *_equality(results), "",
              "## Methods skipped or failed", "", *_methods_not_run(results), "", "## Memory", "",
              *_memory(results), "",
              "## Definitions", "",
              "tok/s: new tokens / wall time per request, prefill included, median over prompts of the median "
              "over repeats. tok/s (total): all new tokens / all wall time of the method's requests (a set's "
              "throughput). speedup: tok/s ÷ `plain`'s tok/s over the same prompts, same run. τ: new tokens / "
              "target forwards (plain = 1.00). accept len: 1 + accepted / steps with a draft. draft accept: "
              "accepted / proposed draft tokens. per-position a_i: share of drafting steps whose first i drafts "
              "were all accepted. draft time: draft seconds / (draft + verify seconds). Formulas and how the "
              "figures relate: docs/METRICS.md in the tokenleap repository.", ""]
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in results.get("plots", [])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def console_summary(results: dict[str, Any]) -> str:
    out = ["", f"{'method':28s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'= plain':>9s}"]
    for name, f in results["summary"]["overall"].items():
        eq = results["equality"]
        equal = _equal_cell(f, eq, name).strip("*")  # (as the report's table, without its bold)
        out.append(f"{name:28s} {_num(f['tokens_per_second']):>8s} {_num(f['speedup'], '.2f', 'x'):>8s} "
                   f"{_num(f.get('mean_accepted_tokens')):>6s} {equal:>9s}")
    for m in results["methods"]:
        if m["status"] != "ok":
            out.append(f"{m['name']}: {m['status']} ({m['reason']})")
    busy = results.get("others_cpu_share")
    if busy is not None and busy > BUSY_SHARE:
        out.append(f"warning: other processes used {busy:.0%} of this machine's CPU time during the run: the "
                   "timings are slower and noisier than on an idle machine")
    ours, peers = _split_mismatches(results)
    if ours:
        out.append(f"!!! MISMATCH: {len(ours)} request(s) of tokenleap methods differ from plain's output; see "
                   "report.md")
    if peers:
        out.append(f"note: {len(peers)} request(s) of peers differ from tokenleap plain's output (other kernels "
                   "round differently; not a losslessness failure); see report.md")
    return "\n".join(out)
