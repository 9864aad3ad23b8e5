#!/usr/bin/env bash
# Memory safety of the Triton kernels on one NVIDIA GPU, whatever the index data, in one run (under 8 minutes):
#
#   1. canary: compute-sanitizer's memcheck must report a Triton load past a tensor
#      (otherwise a clean report below would prove nothing);
#   2. the GPU tests that feed each kind of bad index to each kernel through the
#      public ops (tests/test_safety.py, tests/test_errors.py; TRITON) under
#      `compute-sanitizer --tool memcheck`: the memcheck error count must be 0;
#   3. the GPU profile of the property tests (tests/test_properties.py, bfloat16);
#   4. the GPU tests of the kernels, ops and backends the checks touch (no sanitizer),
#      the REFERENCE bad-index cases included.
#
#   PYTHONPATH=. bash bench/gpu_check_safety.sh
#
# Logs go to $OUT (default ./gpu-logs); the last lines are the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MLA_MULTI_LOG_LEVEL=WARNING
BUDGET_S=${BUDGET_S:-460}
begin=$(date +%s)

# the time a step may take: its own limit, or what is left of the budget
limit() {
  local left=$(( BUDGET_S - ($(date +%s) - begin) ))
  (( left < 10 )) && left=10
  (( $1 < left )) && echo "$1" || echo "$left"
}

# total of the "ERROR SUMMARY: N errors" lines of a memcheck log ("none" without one)
memcheck_errors() {
  grep -o "ERROR SUMMARY: [0-9]* error" "$1" 2>/dev/null | awk '{s += $3; n++} END {print (n ? s : "none")}'
}

pytest_line() {
  grep -E "[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran" "$1" 2>/dev/null | tail -1
}

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, hypothesis; print('torch', torch.__version__, 'triton', triton.__version__, 'hypothesis', hypothesis.__version__)" | tee -a "$OUT/env.txt"
echo "compute-sanitizer: ${SANITIZER:-not found}" | tee -a "$OUT/env.txt"
[[ -n $SANITIZER ]] && "$SANITIZER" --version | tail -1 | tee -a "$OUT/env.txt"

# Without the caching allocator every tensor is its own allocation, so memcheck
# sees an access past a tensor instead of one inside the allocator's pool.
memcheck=("$SANITIZER" --tool memcheck --print-limit 50)

# 1. canary
cat > "$OUT/canary.py" <<'EOF'
import torch
import triton
import triton.language as tl


@triton.jit
def read(X, Y, offset):
    lanes = tl.arange(0, 128)
    tl.store(Y + lanes, tl.load(X + offset + lanes))


x = torch.zeros(1024, device="cuda")
y = torch.empty(128, device="cuda")
# far past the end of x: a read just past it can land in the next allocation,
# which the memory checker (rightly) does not report
read[(1,)](x, y, 1 << 30)
try:
    torch.cuda.synchronize()
except RuntimeError as error:  # the checker stops the kernel; the context reports it
    print("canary kernel failed as expected:", str(error).splitlines()[0])
print("canary ran")
EOF
canary_errors=none
if [[ -n $SANITIZER ]]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(limit 90)" "${memcheck[@]}" --log-file "$OUT/memcheck_canary.log" \
    python3 "$OUT/canary.py" > "$OUT/canary.txt" 2>&1
  canary_errors=$(memcheck_errors "$OUT/memcheck_canary.log")
  echo "canary: memcheck errors $canary_errors (expected > 0)"
fi

# 2. bad indices under memcheck (the REFERENCE cases run in step 4: PyTorch's own kernels)
step=$(date +%s)
if [[ -n $SANITIZER ]]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(limit 240)" "${memcheck[@]}" --log-file "$OUT/memcheck_safety.log" \
    python3 -m pytest -q -m gpu -p no:cacheprovider -k "not REFERENCE and not wgmma or bad_indices" tests/test_safety.py \
    tests/test_errors.py tests/test_kernels_decode_wgmma.py > "$OUT/safety_memcheck.txt" 2>&1
  safety_rc=$?
else
  timeout "$(limit 240)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_safety.py tests/test_errors.py \
    > "$OUT/safety_memcheck.txt" 2>&1
  safety_rc=$?
fi
safety_errors=$(memcheck_errors "$OUT/memcheck_safety.log")
echo "bad indices under memcheck: exit $safety_rc, memcheck errors $safety_errors, $(( $(date +%s) - step )) s"
tail -3 "$OUT/safety_memcheck.txt"

# 3. the GPU profile of the property tests
step=$(date +%s)
timeout "$(limit 150)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_properties.py \
  > "$OUT/properties.txt" 2>&1
properties_rc=$?
echo "properties (GPU profile): exit $properties_rc, $(( $(date +%s) - step )) s"
tail -3 "$OUT/properties.txt"

# 4. the GPU tests of what the checks touch
step=$(date +%s)
timeout "$(limit 200)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_safety.py tests/test_kernels_decode.py \
  tests/test_kernels_prefill.py tests/test_cache_ops_triton.py tests/test_kernels_merge.py tests/test_ops.py \
  tests/test_attention.py tests/test_backend_triton.py > "$OUT/regression.txt" 2>&1
regression_rc=$?
echo "GPU tests of the kernels and ops: exit $regression_rc, $(( $(date +%s) - step )) s"
tail -3 "$OUT/regression.txt"

verdict=PASS
[[ $canary_errors == none || $canary_errors == 0 ]] && verdict=FAIL
[[ $safety_errors != 0 || $safety_rc != 0 || $properties_rc != 0 || $regression_rc != 0 ]] && verdict=FAIL
{
  echo
  echo "==== summary ($(( $(date +%s) - begin )) s) ===="
  echo "canary (a load past a tensor): memcheck errors $canary_errors (must be > 0)"
  echo "bad indices, TRITON, under memcheck: memcheck errors $safety_errors (must be 0); pytest: $(pytest_line "$OUT/safety_memcheck.txt")"
  echo "properties, GPU profile: $(pytest_line "$OUT/properties.txt")"
  echo "GPU tests of the kernels and ops: $(pytest_line "$OUT/regression.txt")"
  echo "verdict: $verdict"
} | tee "$OUT/summary.txt"
[[ $verdict == PASS ]]
