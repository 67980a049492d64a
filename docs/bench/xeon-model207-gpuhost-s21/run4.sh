#!/bin/bash
# Device check 4: why the suite's 17 failures and 6 import errors (run 2) happen on this machine.
exec > >(tee $OUT/log.txt) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENLEAP_CACHE=/tmp/tlcache
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m tokenleap.cli.main "$@"\n' > /tmp/bin/tokenleap && chmod +x /tmp/bin/tokenleap && export PATH=/tmp/bin:$PATH
python3 -c "import typing_extensions, sys; print(sys.version)"; python3 -m pip show typing_extensions 2>/dev/null | grep Version
for m in uvicorn openai tokenleap.serve.app tokenleap.serve.protocol; do python3 -c "import $m" 2>&1 | tail -1 | sed "s/^/$m: /"; done
python3 -c "from tokenleap import kernels; kernels.available()"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 14 --tb=line -W ignore tests/test_bench.py tests/test_cli.py tests/test_layerskip.py tests/test_cascade.py tests/test_tokenizer_spm.py tests/test_prefix_cache.py tests/test_tree_budget.py -k "refused or malformed or unknown_dataset or without_matplotlib or bad_flags or skip_lookup_flag or misuse or match_transformers or server_reports_cached or default_is_auto" 2>&1 | grep -v "^SKIPPED\|^\.\|passed\|^$" | cut -c1-400 | head -60
