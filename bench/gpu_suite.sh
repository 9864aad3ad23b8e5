#!/usr/bin/env bash
# The whole GPU test suite in one device call: bash bench/gpu_suite.sh OUTDIR [pytest args ...], then the examples
# Carry .whl (FlashMLA, pytest-xdist, execnet) for FLASHMLA's tests and parallel workers; without them the
# FLASHMLA tests skip with their reasons and the suite runs in one process. Six workers by default: with
# twelve, workers held up to 28 GiB each and 35 prefill and memory tests ran out of an H200's memory (with six,
# once, 7; with seven, 12, every one out of memory while the other workers held 18-33 GiB each; the tests that
# fail among workers run again alone after the suite, gpu_rerun.log). Each worker hands its cached memory back
# after every GPU test (tests/conftest.py). SUITE_S must leave the rerun its time: 450 s cut one run at 95 %.
set -uo pipefail
out=${1:-.}
shift || true
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
source bench/carried_wheels.sh
workers=()
if ls .whl/pytest_xdist-*.whl .whl/execnet-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xdist .whl/pytest_xdist-*.whl \
    .whl/execnet-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/xdist && workers=(-n "${WORKERS:-6}")
fi
timeout "${SUITE_S:-540}" python3 -m pytest -m gpu "${workers[@]}" -q -p no:cacheprovider -rfE tests "$@" 2>&1 \
  | tee "$out/gpu_suite.log" | tail -25
# tests that failed among parallel workers (a float64 reference can run out of the memory the other workers hold),
# run again alone: the log says which passed so and which failed again
mapfile -t failed < <(grep -oE '^(FAILED|ERROR) tests/[^ ]+' "$out/gpu_suite.log" | cut -d' ' -f2 | sort -u)
if [ ${#failed[@]} -gt 0 ] && [ ${#workers[@]} -gt 0 ]; then
  echo "== the ${#failed[@]} failed tests again, one process" | tee "$out/gpu_rerun.log"
  timeout "${RERUN_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "${failed[@]}" 2>&1 \
    | tee -a "$out/gpu_rerun.log" | tail -8
fi
# the examples as a user runs them (each picks the GPU where there is one): not marked gpu, so run here too
timeout "${EXAMPLES_S:-300}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_examples.py 2>&1 \
  | tee "$out/examples.log" | tail -5
