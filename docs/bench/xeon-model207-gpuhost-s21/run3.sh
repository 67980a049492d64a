#!/bin/bash
# Device check 3: is the formatted-TORCH_CHECK segfault this torch build's, or tokenleap's AMX file's;
# then the int4 kernels at the 1.5B's layer shapes, 1 and 16 rows.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
el probe
for c in plain formatted; do timeout 120 python3 .devrun/abi.py $c; echo "rc=$?"; done
el build; python3 -c "from tokenleap import kernels; print(kernels.available())"
for c in amx amxdtype; do timeout 60 python3 .devrun/exc.py $c; echo "rc=$?"; done
for nk in "2048 1536" "1536 1536" "17920 1536" "1536 8960" "151936 1536"; do
  set -- $nk; el "kernels n=$1 k=$2"; timeout 90 taskset -c 0,1 python3 scripts/bench_kernels.py --n $1 --k $2 --rows 1 4 16
done
el done
