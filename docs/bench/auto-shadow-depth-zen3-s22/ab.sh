#!/bin/bash
# Alternating A/B of `--spec auto` on the mix: "base" from a checkout of the old commit
# (git worktree add /tmp/base <rev>), "new" from this working tree; run from the repository root.
# usage: ab.sh OUT ROUNDS METHODS   e.g. ab.sh /tmp/ab 2 auto
out=$1; shift; n=$1; shift; mkdir -p "$out"
for i in $(seq 1 "$n"); do
  for v in base new; do
    if [ $v = base ]; then pp=${BASE_SRC:-/tmp/base/src}; else pp=$PWD/src; fi
    PYTHONPATH=$pp python -m tokenleap.cli.main bench --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --quant int4 --draft-quant int4 --dataset mix --limit 16 \
        --max-new-tokens 128 --no-progress --out "$out/$v$i" --methods "$@" > "$out/$v$i.log" 2>&1
  done
done
