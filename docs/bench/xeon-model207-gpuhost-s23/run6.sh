#!/bin/bash
# Device check 6: the kernel / layer / tree tests after the paired attention and rms_norm changes;
# int4 / int6 on VNNI against AMX-INT8 tiles at 4-16 rows (layer shapes, whole 1.5B and 0.5B steps);
# the paired attention against the kernel before it (51ed09a~1) at the 1.5B's shape. Timings on 2 cores.
# Run from the repo root with .devrun/ (git-ignored) holding the model configs (in the repo: the 1.5B's in
# docs/bench/xeon-model207-gpuhost-s21/, the 0.5B's beside this script) and .devrun/old/src the older kernel.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el machine; lscpu | grep -E "Model name|^Model:|^CPU\(s\)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
el build; python3 -c "from tokenleap import kernels; print(kernels.available(), kernels.vnni_supported(), kernels.w8a8_available())"
( cd .devrun/old && PYTHONPATH=/tmp/site:$PWD/src python3 -c "from tokenleap import kernels; print('old', kernels.available())" ) &
OLDPID=$!; el tests
: skip python3 -m pytest -q -p no:cacheprovider -m "not slow" -n 12 -rfE --deselect tests/test_kernels.py::test_bf16_amx_product_rejects_mismatched_operands tests/test_kernels.py tests/test_int6.py tests/test_w8a8.py tests/test_fused_layer.py tests/test_quant.py tests/test_transformer.py tests/test_tree_engine.py tests/test_kernel_build.py tests/test_paged_cache.py tests/test_engine.py tests/test_tree_verify.py tests/test_batched_verify.py tests/test_tree_draft.py 2>&1 | tail -25
wait $OLDPID
B="timeout 70 taskset -c 0,1 python3"
for nk in "151936 1536" "1536 8960" "9728 896"; do
  set -- $nk; el "kernels n=$1 k=$2"; $B scripts/bench_kernels.py --n $1 --k $2 --rows 4 6 8 12 16 --huge-pages
done
el "step 1.5B int4, AMX from 4 rows vs VNNI"; $B scripts/bench_steps.py --random-like .devrun/qwen2.5-coder-1.5b-instruct.json --quant int4 --compare amx --rows 4 6 8 12 16 --repeats 9
el "step 0.5B int4, AMX from 4 rows vs VNNI"; $B scripts/bench_steps.py --random-like .devrun/qwen2.5-coder-0.5b-instruct.json --quant int4 --compare amx --rows 4 8 16 --repeats 9
for i in 1 2; do
  el "attention new $i"; $B scripts/bench_attention.py --context 300 1000 --rows 1 4 8 16
  el "attention old $i"; PYTHONPATH=/tmp/site:$PWD/.devrun/old/src $B scripts/bench_attention.py --context 300 1000 --rows 1 4 8 16
done
el done
