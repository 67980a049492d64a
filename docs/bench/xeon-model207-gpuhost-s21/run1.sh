#!/bin/bash
# Device check: the CPU kind, the ISA-specific kernel tests, and step / kernel timings on 2 cores.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el machine; lscpu | grep -E "Model name|Vendor|CPU family|^Model:|Flags|L2|L3|^CPU\(s\)|NUMA node0"; nvidia-smi -L; free -g | head -2; gcc --version | head -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
el build
python3 - <<'PY'
import torch; print("torch", torch.__version__)
from tokenleap import kernels
kernels.build() if hasattr(kernels, "build") else None
print("available", kernels.available(), kernels.unavailable_reason())
f = kernels.cpu_flags(); print("flags", sorted(x for x in f if "avx512" in x or "amx" in x or "vnni" in x))
print("amx", kernels.amx_available(), "vnni", kernels.vnni_supported(), "w8a8", kernels.w8a8_available())
PY
el tests
timeout 300 taskset -c 0,1 python3 -m pytest -q -p no:cacheprovider -m "not slow" -rs tests/test_kernels.py tests/test_int6.py tests/test_w8a8.py tests/test_fused_layer.py tests/test_quant.py tests/test_transformer.py tests/test_tree_engine.py tests/test_kernel_build.py 2>&1 | tail -40
W8=$(python3 -c "from tokenleap import kernels; print(int(kernels.w8a8_available()))")
VN=$(python3 -c "from tokenleap import kernels; print(int(kernels.vnni_supported() and not kernels.amx_available()))")
for q in int4 none $([ "$W8" = 1 ] && echo w8a8); do
  el "steps $q"; timeout 150 taskset -c 0,1 python3 scripts/bench_steps.py --random-like .devrun/qwen2.5-coder-1.5b-instruct.json --quant $q --rows 1 4 8 16 --repeats 9
done
if [ "$VN" = 1 ]; then el "steps int4 vnni"; timeout 150 taskset -c 0,1 python3 scripts/bench_steps.py --random-like .devrun/qwen2.5-coder-1.5b-instruct.json --quant int4 --compare vnni --rows 1 4 8 16 --repeats 9; fi
el kernels; timeout 120 taskset -c 0,1 python3 scripts/bench_kernels.py --n 1536 --k 8960 --rows 1 2 4 8 16 --huge-pages
el done
