#!/usr/bin/env bash
# What the memory-safety changes cost the Triton kernels: the decode and
# prefill benchmarks of the tree before them (exported to .before/, e.g.
# `git archive cdcfdca mla_multi | tar -x -C .before/`) and of this tree, run
# alternately twice in one process each, same device, same method.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for round in 1 2; do
  for tree in .before .; do
    echo "== round $round, tree $tree"
    PYTHONPATH=$tree timeout 120 python3 -m mla_multi bench decode --no-ceilings --heads 16,128 --cases 32x4096,128x4096 \
      --configs h16n64w4s2,h64n64w8s2nolicm --json "$OUT/decode_${round}_${tree//./x}.json" 2>&1 | tail -9
    PYTHONPATH=$tree timeout 120 python3 -m mla_multi bench prefill --heads 128 --shapes 1x8192,4x2048 \
      --json "$OUT/prefill_${round}_${tree//./x}.json" 2>&1 | tail -4
  done
done
