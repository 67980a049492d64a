#!/bin/bash
# Device check 2: do C++ errors reach Python here; then the whole non-slow suite on this CPU.
exec > >(tee $OUT/log.txt) 2>&1
T0=$(date +%s)
el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m tokenleap.cli.main "$@"\n' > /tmp/bin/tokenleap && chmod +x /tmp/bin/tokenleap && export PATH=/tmp/bin:$PATH
el build; python3 -c "from tokenleap import kernels; print(kernels.available())"
el exceptions
for c in int4 amx amxdtype rows; do timeout 60 python3 .devrun/exc.py $c; echo "rc=$?"; done
el "suite"
timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not slow" -n 14 -rfEs --deselect tests/test_kernels.py::test_bf16_amx_product_rejects_mismatched_operands 2>&1 | tail -80
el done
