#!/bin/bash
# The checks an AMX Xeon session runs first (a GPU machine's host CPU counts: tokenleap does not use the
# GPU), in one go, within ~8 minutes on 16 vCPUs: the ISA-specific tests (AMX / VNNI / AVX-512 paths
# the AMD machines cannot run), then timings pinned to 2 CPUs on random weights in the models' shapes
# (no checkpoint needed): attention AVX-512 vs AVX2, prefill batched vs row-exact windows (int4, w8a8),
# one step on AMX-INT8 vs VNNI tiles. Logs go to $OUT (default ./xeon-check), one file per part.
#
#     OUT=/tmp/x bash scripts/xeon_check.sh       # from the repo root, tokenleap importable (PYTHONPATH=src)
#
# Where the machine's torch is not 2.13 (a GPU image's), test_bf16_amx_product_rejects_mismatched_operands
# is deselected: torch 2.11's formatted TORCH_CHECK messages segfault there (BENCHMARKS §0).
OUT=${OUT:-xeon-check}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/summary.txt"; }
export PYTHONUNBUFFERED=1
el machine; { lscpu | grep -E "Model name|^Model:|^CPU\(s\)|Thread|Core|Socket|L2|L3"; lscpu | grep -o -E "amx[a-z0-9_]*|avx512_vnni|avx512_bf16" | sort -u | tr '\n' ' '; echo; } | tee -a "$OUT/summary.txt"
python3 -c "import torch; from tokenleap import kernels; print(torch.__version__, 'kernels', kernels.available(), kernels.unavailable_reason(), 'amx', kernels.amx_available(), 'vnni', kernels.vnni_supported(), 'w8a8', kernels.w8a8_available(), 'avx512 attention', kernels.attention512_supported())" 2>&1 | tee -a "$OUT/summary.txt"
ISA="tests/test_kernels.py tests/test_int6.py tests/test_w8a8.py tests/test_fused_layer.py tests/test_quant.py tests/test_transformer.py tests/test_tree_engine.py tests/test_prefix_cache.py tests/test_paged_cache.py tests/test_engine.py"
D=$(python3 -c "import torch; print('' if torch.__version__.startswith('2.13') else '--deselect tests/test_kernels.py::test_bf16_amx_product_rejects_mismatched_operands')")
el "ISA tests"; OMP_NUM_THREADS=2 timeout 240 python3 -m pytest -q -p no:cacheprovider -m "not slow" -n 8 -rfE $D $ISA > "$OUT/tests.log" 2>&1
tail -4 "$OUT/tests.log" | tee -a "$OUT/summary.txt"
B="timeout 150 taskset -c 0,1 python3"
C15=docs/bench/xeon-model207-gpuhost-s21/qwen2.5-coder-1.5b-instruct.json
el "attention"; $B scripts/bench_attention.py --compare-avx512 --context 300 1000 4000 --rows 1 4 16 --repeats 7 2>&1 | tee -a "$OUT/summary.txt"
W8=$(python3 -c "from tokenleap import kernels; print('w8a8' if kernels.w8a8_available() else '')")
for q in int4 $W8; do
  el "prefill 1.5B $q"; $B scripts/bench_prefill.py --random-like $C15 --quant $q --compare-row-exact --tokens 400 1000 --repeats 3 2>&1 | tee -a "$OUT/summary.txt"
done
el "row-exact prefill, AVX-512 vs AVX2 attention"; $B scripts/bench_prefill.py --random-like $C15 --quant int4 --compare-attention512 --tokens 1000 --repeats 3 2>&1 | tee -a "$OUT/summary.txt"
[ -n "$W8" ] && el "step, AMX-INT8 vs VNNI" && $B scripts/bench_steps.py --random-like $C15 --quant int4 --compare amx --rows 4 8 16 --repeats 7 2>&1 | tee -a "$OUT/summary.txt"
el done
