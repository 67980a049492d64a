"""The one-line summaries the CLI prints with ``--stats``."""
from __future__ import annotations

from typing import Any


def stats_line(stats: dict[str, Any]) -> str:
    pos = " ".join(f"{a:.2f}" for a in stats["per_position_acceptance"]) or "-"
    return (f"{stats['new_tokens']} tokens, {stats['tokens_per_second']:.2f} tok/s, "
            f"tau {stats['mean_accepted_tokens']:.2f}, acceptance length {stats['acceptance_length']:.2f}, "
            f"draft acceptance {stats['draft_acceptance_rate']:.1%}, per position [{pos}], "
            f"draft {stats['draft_seconds']:.2f}s / verify {stats['verify_seconds']:.2f}s "
            f"/ prefill {stats['prefill_seconds']:.2f}s{_proposer_shares(stats)}")


def _proposer_shares(stats: dict[str, Any]) -> str:
    """``, tokens by proposer: ngram 61%, draft 24%, none 15%`` where any proposer drafted (under
    ``--spec auto``, what it picked; ``none``: steps it decoded plainly)."""
    shares = stats.get("proposers") or {}
    if not any(n != "none" for n in shares):
        return ""
    ranked = sorted(shares.items(), key=lambda kv: -kv[1]["tokens"])
    return ", tokens by proposer: " + ", ".join(f"{n} {v['share']:.0%}" for n, v in ranked)
