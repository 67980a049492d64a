#!/bin/bash
# A/B of --spec auto's deepening after a draft accepted whole: BASE (a checkout without it) against NEW
# (one with it), alternating, two rounds; each writes its bench directories and count-*.txt here.
# usage: BASE=/path/to/old/checkout NEW=/path/to/new/checkout docs/bench/deepen-ab-zen3-s48/run.sh
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE"
TL='import sys; from tokenleap.cli.main import main; sys.exit(main())'
COMMON="--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --quant int4 --draft-quant int4
        --max-new-tokens 128 --no-progress --repeats 1"
COUNT="Write the integers from 1 to 300 as digits, one per line, nothing else."
for round in 1 2; do
  for build in base new; do
    if [ $build = base ]; then SRC=$BASE/src; else SRC=$NEW/src; fi
    echo "== round $round $build $(date +%T)"
    PYTHONPATH=$SRC OMP_NUM_THREADS=2 python -c "$TL" bench $COMMON --dataset mix --limit 16 \
        --methods plain,auto --out mix-$build-$round
    PYTHONPATH=$SRC OMP_NUM_THREADS=2 python -c "$TL" bench $COMMON --methods auto --out kinds-$build-$round \
        --dataset "$HERE/../kinds16-zen3-s47/prompts.jsonl"
    PYTHONPATH=$SRC OMP_NUM_THREADS=2 python -c "$TL" generate --model qwen2.5-coder-1.5b-instruct --quant int4 \
        --spec auto --chat --prompt "$COUNT" --max-tokens 400 --json > count-$build-$round.txt
  done
done
