#!/usr/bin/env bash
# lm-evaluation-harness (0.4.13, pip install "lm-eval[api]") against `tokenleap serve`, and the same
# tasks on transformers reading the same GGUF file: scores, per-sample log-likelihoods and generations
# compared. Run from the repository root; OUT (default /tmp/lmeval-out) gets the runs.
set -euo pipefail
D=docs/bench/lmeval-zen4-s35
OUT=${OUT:-/tmp/lmeval-out/$(date +%Y%m%d-%H%M%S)}
MODEL=qwen2.5-coder-0.5b-instruct
GGUF=$(python -c "from tokenleap.models.catalog import resolve_gguf; print(resolve_gguf('$MODEL'))")
mkdir -p "$OUT"
for dtype in float32 auto; do
  tokenleap serve --model $MODEL --dtype $dtype --port 8123 --served-model-name qwen > "$OUT/server-$dtype.log" 2>&1 &
  pid=$!
  until curl -sf localhost:8123/health > /dev/null; do sleep 2; done
  lm_eval --model local-completions \
    --model_args model=qwen,base_url=http://127.0.0.1:8123/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True \
    --tasks tl_mc,tl_gen,tl_ppl --include_path $D/tasks --output_path "$OUT/tokenleap-$dtype" --log_samples 2>&1 | tail -10
  kill $pid; wait $pid || true
done
lm_eval --model hf --model_args "pretrained=$(dirname "$GGUF"),gguf_file=$(basename "$GGUF"),dtype=float32" --device cpu \
  --tasks tl_mc,tl_gen,tl_ppl --include_path $D/tasks --output_path "$OUT/transformers" --log_samples 2>&1 | tail -10
echo "tokenleap float32 vs transformers float32:"; python $D/compare.py "$OUT/tokenleap-float32" "$OUT/transformers"
echo "tokenleap auto (bf16 here) vs transformers float32:"; python $D/compare.py "$OUT/tokenleap-auto" "$OUT/transformers"
