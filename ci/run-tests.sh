#!/usr/bin/env bash
# Run the test suite on one CI runner and check the backends that runner must select.
#   ci/run-tests.sh --platform cpu|cuda|rocm
# Expects mla_multi installed in the active Python (python3 or $PYTHON).
set -euo pipefail

platform=""
while [ $# -gt 0 ]; do
  case "$1" in
    --platform) platform="${2:-}"; shift 2 ;;
    --platform=*) platform="${1#*=}"; shift ;;
    *) echo "ci/run-tests.sh: unknown argument '$1'; usage: ci/run-tests.sh --platform cpu|cuda|rocm" >&2; exit 2 ;;
  esac
done
case "$platform" in
  cpu|cuda|rocm) ;;
  *) echo "ci/run-tests.sh: --platform '$platform' is not accepted; use cpu, cuda or rocm" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
cd "$(dirname "$0")/.."

"$python" -m mla_multi info
# The selection this runner must make (ci/expected_backends.json) is asserted inside the suite.
export MLA_MULTI_CI_PLATFORM="$platform"
markers=()
if [ "$platform" = cpu ]; then markers=(-m "not gpu"); fi
"$python" -m pytest "${markers[@]}"
# The Triton kernels are compiled ahead of time for AMD and NVIDIA targets on every runner.
"$python" -m mla_multi compile-check
