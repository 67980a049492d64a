#!/bin/bash
# Device check 7 (a GPU machine's host CPU; tokenleap does not use the GPU): the test suite on this
# CPU's kernels (AMX where it has them); prefill with row-exact windows against batched forwards
# (int4, w8a8), which the prefix cache takes where backend.exact_prefill_is_free says they cost
# nothing; one step on AMX-INT8 vs VNNI tiles (AMX_INT8_MIN_ROWS). Timings pinned to 2 CPUs.
# Run from the repo root with .whl/ (git-ignored) holding the wheels the image lacks.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el machine; lscpu | grep -E "Model name|Vendor|CPU family|^Model:|^CPU\(s\)|L2|L3"; lscpu | grep -o -E "amx[a-z0-9_]*|avx512_vnni|avx512_bf16" | sort -u | tr '\n' ' '; echo; nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
el build; python3 -c "import torch; from tokenleap import kernels; print(torch.__version__, kernels.available(), kernels.unavailable_reason(), 'amx', kernels.amx_available(), 'vnni', kernels.vnni_supported(), 'w8a8', kernels.w8a8_available())"
el tests; timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" -n 14 -rfE 2>&1 | tail -30
B="timeout 200 taskset -c 0,1 python3"
C15=docs/bench/xeon-model207-gpuhost-s21/qwen2.5-coder-1.5b-instruct.json
C05=docs/bench/xeon-model207-gpuhost-s23/qwen2.5-coder-0.5b-instruct.json
W8=$(python3 -c "from tokenleap import kernels; print(int(kernels.w8a8_available()))")
for q in int4 $([ "$W8" = 1 ] && echo w8a8); do
  el "prefill 1.5B $q, batched vs row-exact"; $B scripts/bench_prefill.py --random-like $C15 --quant $q --compare-row-exact --tokens 100 400 1000 --repeats 4
done
el "prefill 0.5B int4, batched vs row-exact"; $B scripts/bench_prefill.py --random-like $C05 --quant int4 --compare-row-exact --tokens 100 400 --repeats 4
[ "$W8" = 1 ] && { el "step 1.5B int4, AMX-INT8 vs VNNI tiles"; $B scripts/bench_steps.py --random-like $C15 --quant int4 --compare amx --rows 4 6 8 12 16 --repeats 9; }
el done
