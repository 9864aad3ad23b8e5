#!/usr/bin/env bash
# GPU check of planning, the shared workspace, the registered ops and eager calls, one device call:
#   bash bench/gpu_check_host.sh OUTDIR     (carry .whl with sgl_flash_mla for the FlashMLA column)
# 1. the GPU tests of the host path and of the layer and ops (pytest -m gpu), 2. bench/host_bench.py
# (decode op eager / captured beside FlashMLA, layer decode steps, 61 layers' workspace, a mixed step's
# peak), 3. mla-multi bench layer, 4. bench/registration_cost.py on the GPU.
set -uo pipefail
out=${1:-.}
source bench/carried_wheels.sh
timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu tests/test_host_path.py tests/test_ops.py tests/test_attention.py \
  -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -8
timeout 150 python3 bench/host_bench.py 2>&1 | grep -v -i warn | tee "$out/host_bench.log"
timeout 100 python3 -m mla_multi bench layer --heads 128 2>&1 | tee "$out/bench_layer.log"
timeout 45 python3 bench/registration_cost.py --device cuda --calls 5000 --repeats 3 2>&1 | tee "$out/registration.log" | tail -14
