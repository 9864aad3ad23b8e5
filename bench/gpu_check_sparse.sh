#!/usr/bin/env bash
# GPU check of sparse MLA and the FLASHMLA backend, one device call:
#   bash bench/gpu_check_sparse.sh OUTDIR     (carry .whl with sgl_flash_mla for FLASHMLA and the FlashMLA column)
# 0. (COMPILE=substring) mla-multi compile-check for sm_90 of the kernels named, 1. the sparse GPU tests (every installed sparse backend, FLASHMLA dense decode), 2. the host-path GPU tests,
# 3. mla-multi bench sparse-decode (fp8_ds_mla and bf16 caches) and sparse-prefill beside FlashMLA.
set -uo pipefail
out=${1:-.}
source bench/carried_wheels.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
if [ -n "${COMPILE:-}" ]; then  # ahead-of-time compilation with the device's Triton: spills, shared memory
  timeout 300 python3 -m mla_multi compile-check --targets sm_90 --kernels "$COMPILE" 2>&1 | grep -v -i warn \
    | tee "$out/compile_check.log" | tail -12
fi
timeout "${SPARSE_TESTS_S:-200}" python3 -m pytest -q -m gpu tests/test_sparse_gpu.py -p no:cacheprovider -rs \
  2>&1 | tee "$out/sparse_tests.log" | tail -25
if [ -n "${HOST_TESTS_S:-}" ]; then
  timeout "$HOST_TESTS_S" python3 -m pytest -q -m gpu tests/test_host_path.py -p no:cacheprovider 2>&1 \
    | tee "$out/host_tests.log" | tail -8
fi
[ -z "${SKIP_BENCH:-}" ] && timeout "${BENCH_S:-150}" python3 -m mla_multi bench sparse-decode --kv ${SPARSE_KV:-fp8_ds_mla,bf16} ${DECODE_ARGS:-} \
  --json "$out/sparse_decode.json" 2>&1 | tee "$out/sparse_decode.log" | grep -v "^  " | tail -14
[ -z "${SKIP_BENCH:-}${SKIP_PREFILL:-}" ] && timeout "${BENCH_S:-150}" python3 -m mla_multi bench sparse-prefill ${PREFILL_ARGS:-} --json "$out/sparse_prefill.json" \
  2>&1 | tee "$out/sparse_prefill.log" | grep -v "^  " | tail -8
if [ -n "${PROFILE:-}" ]; then
  timeout 60 python3 bench/profile_sparse_eager.py 2>&1 | tee "$out/profile_sparse_eager.log" | grep -E "host per|tottime|\.py" | head -40
fi
if [ -n "${CONFIGS:-}" ]; then
  timeout 150 python3 bench/sparse_configs.py 2>&1 | tee "$out/sparse_configs.log" | grep -v -i warn
fi
if [ -n "${DENSE:-}" ]; then
  timeout 200 python3 -m mla_multi bench decode --backends all --heads 16,128 --cases 1x8192,32x8192,64x8192,128x8192 \
    2>&1 | tee "$out/dense_decode.log" | grep "^|"
fi
