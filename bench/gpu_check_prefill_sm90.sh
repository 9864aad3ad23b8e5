#!/usr/bin/env bash
# GPU check of the sm_90 prefill kernel (mla_multi/kernels/prefill_wgmma.py), one device call:
#   bash bench/gpu_check_prefill_sm90.sh OUTDIR     (carry .whl_fi with FlashInfer's wheels for its column)
# 1. the prefill GPU tests: both kernels against float64, bad boundaries against the Triton kernel, the merge,
#    the layer and the safety cases; 2. mla-multi bench prefill: the default launch (the Gluon kernel on sm_90)
#    beside the Triton kernel, FlashInfer's fa3 and cuDNN in one run; 3. the layer's prefill steps.
set -uo pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if ls .whl_fi/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi .whl_fi/*.whl && export PYTHONPATH=.:/tmp/fi
fi
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/test_kernels_prefill_wgmma.py tests/test_kernels_prefill.py \
  tests/test_attention.py tests/test_safety.py -k "prefill or wgmma or layer" -p no:cacheprovider 2>&1 \
  | tee "$out/prefill_tests.log" | tail -6
timeout "${BENCH_S:-200}" python3 -m mla_multi bench prefill --heads 128,16 --shapes 1x8192,4x2048,16x512 \
  --configs m128n64w8s3,wgmma --json "$out/prefill.json" 2>&1 | tee "$out/prefill.log" | grep "^|"
timeout "${LAYER_S:-150}" python3 -m mla_multi bench layer --heads 128 \
  --steps prefill:16x512+3584,prefill:1x8192,mixed:64x4096+16x512+3584 --decode-backends TRITON \
  --prefill-backends ${PREFILL_BACKENDS:-default,TRITON} 2>&1 | tee "$out/layer.log" | grep "^|"
