#!/usr/bin/env bash
# The FLASHINFER backend on one NVIDIA GPU, in one run: its GPU tests, then the
# decode benchmark of every installed backend and the prefill benchmark.
#
#   bash bench/gpu_check_flashinfer.sh [tests|bench|all]
#
# FlashInfer may come as wheels in .whl/ (flashinfer_python, apache_tvm_ffi);
# they are installed into /tmp/site. Logs go to $OUT (default ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 MLA_MULTI_LOG_LEVEL=INFO MAX_JOBS=16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m mla_multi info 2>&1 | tee "$OUT/info.txt" | grep -E "selected|priority|FLASHINFER|flashinfer" | head -20

if [[ $what == tests || $what == all ]]; then
  start=$(date +%s)
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backend_flashinfer.py 2>&1 | tee "$OUT/tests.txt" | tail -25
  echo "tests took $(( $(date +%s) - start )) s"
fi

if [[ $what == bench || $what == all ]]; then
  timeout 300 python3 -m mla_multi bench decode --backends all --no-ceilings --heads 16,32,64,128 \
    --cases 1x32768,32x4096,128x4096 --json "$OUT/decode_bf16.json" 2>&1 | tee "$OUT/decode.txt" | tail -14
  timeout 200 python3 -m mla_multi bench decode --backends all --no-ceilings --heads 128 --cases 32x8192,64x16384,128x16384 \
    --json "$OUT/decode_bf16_long.json" 2>&1 | tee -a "$OUT/decode.txt" | tail -5
  timeout 200 python3 -m mla_multi bench decode --backends all --no-ceilings --kv-dtype float8_e4m3fn --heads 16,32,64,128 \
    --cases 128x4096 --json "$OUT/decode_fp8.json" 2>&1 | tee -a "$OUT/decode.txt" | tail -6
  timeout 200 python3 -m mla_multi bench decode --backends all --no-ceilings --heads 128 --q-len 2,4 --cases 32x4096,128x4096 \
    --json "$OUT/decode_mtp.json" 2>&1 | tee -a "$OUT/decode.txt" | tail -6
  timeout 200 python3 -m mla_multi bench prefill --heads 16,128 --shapes 1x8192,4x2048 --json "$OUT/prefill.json" 2>&1 \
    | tee "$OUT/prefill.txt" | tail -8
fi
