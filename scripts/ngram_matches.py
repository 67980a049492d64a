"""How well prompt lookup's guesses do by the length of the suffix match they come from, replayed on
a bench run's plain outputs (no model runs: the target's tokenizer re-encodes the prompts).

Usage: python scripts/ngram_matches.py RUN_DIR [--model qwen2.5-coder-1.5b-instruct] [--k 8]

RUN_DIR is a ``tokenleap bench`` output directory (``results.jsonl`` or ``results.jsonl.gz``, and
``run.json`` for the dataset and chat setting) whose methods include ``plain``. At every
position of every plain output, n-gram lookup (``NgramProposer`` with ngram_min 1) finds the
longest earlier match of the text's suffix (4 tokens down to 1) and proposes up to k tokens; the
table gives, per prompt category and match length n: the share of positions, the share whose first
guessed token is the one plain decoding emitted, the mean number of guessed tokens matching, and the
conditional acceptance b_i by position (docs/METRICS.md).
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

from tokenleap.bench.datasets import load_dataset
from tokenleap.bench.suite import encode_prompts
from tokenleap.models.catalog import resolve_gguf
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.text.tokenizer import Tokenizer, read_gguf_tokenizer_metadata


def read_rows(run: Path) -> list[dict]:
    path = run / "results.jsonl"
    opener = open if path.exists() else gzip.open
    with opener(path if path.exists() else run / "results.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                    help="catalog name or GGUF path of the target")
    ap.add_argument("--k", type=int, default=8, help="tokens a guess proposes at most")
    args = ap.parse_args()
    identity = json.loads((args.run / "run.json").read_text())["identity"]
    gguf = Path(args.model) if Path(args.model).is_file() else resolve_gguf(args.model)
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(gguf))
    prompts = {p.id: p for p in load_dataset(identity["dataset"]).prompts}
    lookup = NgramProposer(4, 1)
    # (category, n) -> [positions, first guessed token right, guessed tokens right, hits by position, trials by position]
    table: dict[tuple[str, int], list] = defaultdict(lambda: [0, 0, 0, [0] * args.k, [0] * args.k])
    for i, row in enumerate(r for r in read_rows(args.run) if r["method"] == "plain" and r["repeat"] == 0):
        ids = encode_prompts(tok, [prompts[row["prompt_id"]]], identity.get("chat", True))[0]
        out = row["token_ids"]
        lookup.begin(i, ids)
        for t in range(len(out)):
            text = ids + out[:t]
            found = lookup.match(i, text)
            cell = table[row["category"], found[0] if found else 0]
            cell[0] += 1
            if found:
                guess = text[found[1]:found[1] + args.k]
                right = next((j for j, g in enumerate(guess) if t + j >= len(out) or g != out[t + j]), len(guess))
                cell[1] += right > 0
                cell[2] += right
                for j in range(min(len(guess), right + 1)):
                    cell[4][j] += 1
                    cell[3][j] += j < right
        lookup.end(i)
    totals = defaultdict(int)
    for (cat, _), cell in table.items():
        totals[cat] += cell[0]
    print("| category | match length | share of positions | first token right | mean tokens right | b_1 .. b_k |")
    print("|---|---|---|---|---|---|")
    for (cat, n), cell in sorted(table.items()):
        b = " ".join(f"{h / t:.2f}" if t else "-" for h, t in zip(cell[3], cell[4]))
        first = f"{cell[1] / cell[0]:.2f}" if n else "-"
        mean = f"{cell[2] / cell[0]:.2f}" if n else "-"
        print(f"| {cat} | {n or 'none'} | {cell[0] / totals[cat]:.0%} | {first} | {mean} | {b if n else '-'} |")


if __name__ == "__main__":
    main()
