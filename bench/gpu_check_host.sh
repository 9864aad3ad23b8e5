#!/usr/bin/env bash
# GPU check of the planning / shared-workspace / registered-op work, one device call:
#   bash bench/gpu_check_host.sh OUTDIR [TEST_SECONDS]   (carry .whl with sgl_flash_mla for the FlashMLA column)
set -uo pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if ls .whl/sgl_flash_mla-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/sgl_flash_mla-*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
timeout 240 python3 bench/host_bench.py 2>&1 | grep -v -i warn | tee "$out/host_bench.log"
timeout "${2:-200}" python3 -m pytest -q -x -m gpu tests/test_attention.py tests/test_ops.py tests/test_kernels_decode.py \
  tests/test_kernels_decode_wgmma.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
