#!/bin/bash
# Device check 5: int4 / int6 on the AVX-512 VNNI tiles against the AVX2 tiles an AMX Xeon takes
# for 1-3 rows (bitwise the same values): a whole int4 step, then the 1.5B's head and down shapes.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
el build; python3 -c "from tokenleap import kernels; print(kernels.available(), kernels.vnni_supported())"
el "steps int4, VNNI vs AVX2 tiles"; timeout 80 taskset -c 0,1 python3 scripts/bench_steps.py --random-like .devrun/qwen2.5-coder-1.5b-instruct.json --quant int4 --compare vnni --rows 1 2 3 --repeats 9
for nk in "1536 8960" "151936 1536"; do
  set -- $nk; el "kernels n=$1 k=$2"; timeout 60 taskset -c 0,1 python3 scripts/bench_kernels.py --n $1 --k $2 --rows 1 2 3
done
el done
