#!/usr/bin/env bash
# The sm_90 warpgroup decode kernels on one Hopper GPU, in one run: its GPU
# tests (and the decode kernel's), then the decode benchmarks beside the Triton
# kernel and every other installed backend (FlashInfer from .whl/ if present).
#
#   bash bench/gpu_check_wgmma.sh [tests|ab|backends|fp8|fp8ab|all]...
#
# Logs and JSON go to $OUT (default ./gpu-logs); a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
steps=${*:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 MAX_JOBS=16
has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
bench() { timeout "$1" python3 -m mla_multi bench decode "${@:2}"; }

if has tests; then
  start=$(date +%s)
  timeout 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider ${TESTS:-tests/test_kernels_decode_wgmma.py \
    tests/test_kernels_decode.py} 2>&1 | tee "$OUT/tests.txt" | tail -15
  echo "tests took $(( $(date +%s) - start )) s"
fi
if has ab; then
  # the Triton kernel against the warpgroup kernel, same inputs, graph replay
  bench 200 --no-ceilings --heads 64,128 --cases 1x32768,32x4096,128x4096,128x16384 \
    --configs h64n64w8s2nolicm,h64n64w8s2wg,h64n64w4s2rm --json "$OUT/ab_64.json" 2>&1 | tee "$OUT/ab.txt" | tail -25
  bench 150 --no-ceilings --heads 16,32 --cases 1x32768,32x4096,128x4096 \
    --configs h16n64w4s2,h32n64w4s2ws,h64n64w4s2rm --json "$OUT/ab_16.json" 2>&1 \
    | tee -a "$OUT/ab.txt" | tail -31
fi
if has backends; then
  # every installed decode backend through the package's interface (TRITON = the registry's kernel choice)
  bench 240 --backends all --no-ceilings --heads 16,32,64,128 --cases 1x32768,32x4096,128x4096 \
    --json "$OUT/decode_bf16.json" 2>&1 | tee "$OUT/backends.txt" | tail -14
  bench 240 --backends all --no-ceilings --heads 128 --cases 32x8192,64x4096,64x8192,32x16384,64x16384,128x8192,128x16384 \
    --json "$OUT/decode_bf16_long.json" 2>&1 | tee -a "$OUT/backends.txt" | tail -9
  bench 150 --backends all --no-ceilings --heads 128 --q-len 2,4 --cases 32x4096,128x4096 \
    --json "$OUT/decode_mtp.json" 2>&1 | tee -a "$OUT/backends.txt" | tail -6
fi
if has fp8; then
  # bf16 and FP8 caches in one process: every installed backend, the registry's choice marked
  bench 300 --backends all --no-ceilings --kv-dtype bfloat16,float8_e4m3fn --heads 16,32,64,128 \
    --cases 32x4096,128x4096 --json "$OUT/decode_fp8.json" 2>&1 | tee "$OUT/fp8.txt" | tail -18
fi
if has fp8ab; then
  # the FP8 kernels side by side (bf16 beside them, same process)
  bench 200 --no-ceilings --kv-dtype bfloat16,float8_e4m3fn --heads 16 --cases 32x4096,128x4096 \
    --configs h16n64w8s2,h16n64w4s2ws --json "$OUT/fp8_ab16.json" 2>&1 | tee "$OUT/fp8ab.txt" | tail -9
  bench 200 --no-ceilings --kv-dtype bfloat16,float8_e4m3fn --heads 128 --cases 32x4096,128x4096 \
    --configs h64n64w4s2rm --json "$OUT/fp8_ab128.json" 2>&1 | tee -a "$OUT/fp8ab.txt" | tail -5
fi
echo "== summary"
grep -hE "passed|failed|error" "$OUT/tests.txt" 2>/dev/null | tail -3
