"""From per-request records to the figures of docs/METRICS.md, per category and overall; equality.

tokens/s: median over prompts of each prompt's median over repeats (prefill included).
speedup: a method's tokens/s / plain's tokens/s, both over the prompts both completed.
tau, acceptance length, rates, per-position acceptance: from the summed counters of all requests.
equality: greedy runs compare every method with plain; sampled runs are seeded (seed + prompt
index), and tokenleap's seeded sampling gives plain's tokens whatever the proposer, so its methods
are compared with plain too -- peers, which draw from their own random streams, are not.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from tokenleap.spec.stats import SpecStats

PLAIN = "plain"
OWN_BASELINE = {"hf-": "hf-plain", "llamacpp-": "llamacpp-plain"}
_COUNTERS = ("new_tokens", "target_forwards", "draft_steps", "draft_tokens", "accepted_tokens",
             "prefill_seconds", "draft_seconds", "verify_seconds", "total_seconds")


def own_baseline(method: str) -> str | None:
    """A peer's own plain decoding (hf-assisted -> hf-plain), or None."""
    for prefix, base in OWN_BASELINE.items():
        if method.startswith(prefix) and method != base:
            return base
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _references(records: list[dict], name: str) -> dict[str, list[int]]:
    refs: dict[str, list[int]] = {}
    for r in sorted(records, key=lambda r: r["repeat"]):
        if r["method"] == name:
            refs.setdefault(r["prompt_id"], r["token_ids"])
    return refs


def _compare(records: list[dict], method_of, ref_name: str, refs: dict[str, list[int]]) -> tuple[dict, list]:
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"compared": 0, "identical": 0})
    mismatches = []
    for r in records:
        if method_of(r) != ref_name or r["prompt_id"] not in refs:
            continue
        c = counts[r["method"]]
        c["compared"] += 1
        diff = first_difference(r["token_ids"], refs[r["prompt_id"]])
        if diff is None:
            c["identical"] += 1
        else:
            mismatches.append({"method": r["method"], "reference": ref_name, "prompt_id": r["prompt_id"],
                               "repeat": r["repeat"], "first_difference": diff,
                               "method_tokens": len(r["token_ids"]), "reference_tokens": len(refs[r["prompt_id"]])})
    return dict(counts), mismatches


def is_peer(record: dict) -> bool:
    """A record of another engine (transformers, llama.cpp), by its kind or its method's name."""
    name = record["method"]
    return record.get("kind") == "peer" or any(name.startswith(prefix) for prefix in OWN_BASELINE)


def equality(records: list[dict], greedy: bool) -> dict[str, Any]:
    """Greedy: every record against plain's output for its prompt (plain's own repeats included);
    peers' speculative modes also against their own plain decoding. Sampled (seeded) runs: every
    tokenleap record against plain's seeded output; peers are not compared."""
    if not greedy:
        ours = [r for r in records if not is_peer(r)]
        by_method, mismatches = _compare(ours, lambda r: PLAIN, PLAIN, _references(ours, PLAIN))
        peers = sorted({r["method"] for r in records if is_peer(r)})
        return {"checked": True, "mode": "seeded", "reference": PLAIN, "by_method": by_method,
                "mismatches": mismatches, "own_baseline": {}, "own_baseline_mismatches": [],
                "not_compared": peers,
                "reason": "peers sample from their own random streams, so their sampled outputs differ"}
    plain_refs = _references(records, PLAIN)
    by_method, mismatches = _compare(records, lambda r: PLAIN, PLAIN, plain_refs)
    own, own_mismatches = {}, []
    for base in sorted({b for r in records if (b := own_baseline(r["method"]))}):
        counts, mm = _compare(records, lambda r: own_baseline(r["method"]), base, _references(records, base))
        own.update({m: {**c, "reference": base} for m, c in counts.items()})
        own_mismatches += mm
    return {"checked": True, "mode": "greedy", "reference": PLAIN, "by_method": by_method, "mismatches": mismatches,
            "own_baseline": own, "own_baseline_mismatches": own_mismatches}


def merged_stats(records: list[dict]) -> SpecStats | None:
    total = None
    for r in records:
        st = r.get("stats")
        if not st:
            continue
        one = SpecStats(**{k: st.get(k, 0) for k in _COUNTERS},
                        position_proposed=list(st.get("position_proposed", [])),
                        position_accepted=list(st.get("position_accepted", [])))
        if total is None:
            total = one
        else:
            total.merge(one)
    return total


def per_prompt_tps(records: list[dict]) -> dict[str, float]:
    """prompt id -> median tokens/s over that prompt's repeats."""
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_prompt[r["prompt_id"]].append(r["tokens_per_second"])
    return {p: statistics.median(v) for p, v in by_prompt.items()}


def _speedup(tps: dict[str, float], plain: dict[str, float]) -> float | None:
    common = [p for p in tps if p in plain]
    if not common:
        return None
    base = statistics.median(plain[p] for p in common)
    return round(statistics.median(tps[p] for p in common) / base, 4) if base > 0 else None


def figures(records: list[dict], plain_records: list[dict], mismatched: set[tuple]) -> dict[str, Any]:
    tps = per_prompt_tps(records)
    new_tokens, seconds = sum(len(r["token_ids"]) for r in records), sum(r["seconds"] for r in records)
    out: dict[str, Any] = {
        "requests": len(records), "prompts": len(tps),
        "new_tokens": new_tokens,
        "tokens_per_second": round(statistics.median(tps.values()), 3) if tps else None,
        # the set's throughput: unlike the median, it does not fall between two clusters of a mixed set
        "total_tokens_per_second": round(new_tokens / seconds, 3) if seconds > 0 else None,
        "speedup": _speedup(tps, per_prompt_tps(plain_records)),
        "seconds": round(seconds, 3),
        "peak_rss_mb": max((r.get("peak_rss_mb") or 0 for r in records), default=None),
        "mismatches": sum(1 for r in records if (r["method"], r["prompt_id"], r["repeat"]) in mismatched),
    }
    passed = [r["passed"] for r in records if r.get("passed") is not None]
    out["pass_at_1"] = round(sum(passed) / len(passed), 4) if passed else None
    stats = merged_stats(records)
    if stats is not None:
        d = stats.to_dict()
        drafted = ("acceptance_length", "draft_acceptance_rate", "per_position_acceptance", "draft_time_share")
        out.update({k: d[k] for k in ("mean_accepted_tokens", "prefill_seconds", "draft_seconds", "verify_seconds")})
        out.update({k: d[k] if stats.draft_steps else None for k in drafted})  # no draft, no such figure
    return out


def summarize(records: list[dict], methods: list[str], eq: dict[str, Any]) -> dict[str, Any]:
    """{"overall": {method: figures}, "by_category": {category: {method: figures}}}."""
    mismatched = {(m["method"], m["prompt_id"], m["repeat"]) for m in eq.get("mismatches", [])}
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["category"]].append(r)

    def table(recs: list[dict]) -> dict[str, Any]:
        plain = [r for r in recs if r["method"] == PLAIN]
        return {m: figures(sel, plain, mismatched) for m in methods
                if (sel := [r for r in recs if r["method"] == m])}

    return {"overall": table(records), "by_category": {c: table(groups[c]) for c in sorted(groups)}}
