"""Sample training text for ``tokenleap train-head --texts`` from files on this machine.

Pieces of about ``--piece`` characters, each starting and ending on a line, are drawn (seeded) from
randomly chosen files matching the globs until ``--chars`` characters are collected, and written to
one file. BENCHMARKS ("The draft head with five times the text") used:

    python scripts/head_texts.py --out docs.md --chars 480000 '/usr/share/doc/nodejs/api/*.md'
    LIB=$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
    python scripts/head_texts.py --out stdlib.py --chars 420000 "$LIB/**/*.py"

(the second pattern also reaches site-packages, so what it draws depends on the installed packages).
"""
from __future__ import annotations

import argparse
import glob
import random
from pathlib import Path


def sample(files: list[str], total: int, piece: int, rng: random.Random) -> str:
    out, size = [], 0
    texts = {}
    while size < total:
        name = rng.choice(files)
        text = texts.setdefault(name, Path(name).read_text(encoding="utf-8", errors="ignore"))
        if len(text) < 2000:
            continue
        start = text.find("\n", rng.randrange(0, max(1, len(text) - piece))) + 1
        chunk = text[start:start + piece]
        chunk = chunk[:chunk.rfind("\n") + 1]
        out.append(chunk)
        size += len(chunk)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("globs", nargs="+", help="file patterns (** allowed)")
    p.add_argument("--out", required=True)
    p.add_argument("--chars", type=int, default=400_000)
    p.add_argument("--piece", type=int, default=6000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    files = sorted({f for g in args.globs for f in glob.glob(g, recursive=True) if Path(f).is_file()})
    if not files:
        raise SystemExit("no files match")
    Path(args.out).write_text(sample(files, args.chars, args.piece, random.Random(args.seed)), encoding="utf-8")


if __name__ == "__main__":
    main()
