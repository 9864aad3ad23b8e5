"""GPU check of decode context parallelism on a machine with 2 GPUs, in one script.

    PYTHONPATH=. python3 bench/gpu_check_dcp.py [all|tests|bench]

1. the GPU tests of DCP: NCCL with 2 processes, the TRITON backend, CUDA-graph
   capture of the whole DCP decode, the layer with DCP against the layer
   without (tests/test_distributed.py), and the LSE correction kernel
   (tests/test_kernels_dcp_combine.py);
2. `mla-multi bench dcp`: DeepSeek-V3 decode, N = 128 heads, B in {8, 32},
   S in {32768, 131072}, 1 GPU against 2.

Writes its logs under $OUT (or ./gpu_check_out): env.txt, pytest.log,
bench.txt, bench_dcp.json; prints a short summary at the end. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out")
ENV = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1")


def sh(command: list[str], log: str, timeout: float) -> int:
    start = time.time()
    with open(os.path.join(OUT, log), "a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        try:
            proc = subprocess.run(command, cwd=ROOT, env=ENV, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\nTIMEOUT after {timeout} s\n")
            code = 124
        handle.write(f"\n[exit {code}, {time.time() - start:.0f} s]\n")
    print(f"{log}: exit {code} in {time.time() - start:.0f} s", flush=True)
    return code


def tail_lines(log: str, keep) -> list[str]:
    path = os.path.join(OUT, log)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [line.rstrip("\n") for line in handle if keep(line)]


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    os.makedirs(OUT, exist_ok=True)
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    py = sys.executable
    sh(["bash", "-c", "nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch, triton; "
        "print(torch.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())'"],
       "env.txt", 60)
    codes = {}
    if mode in ("all", "tests"):
        codes["tests"] = sh(
            [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfs",
             "tests/test_distributed.py", "tests/test_kernels_dcp_combine.py"],
            "pytest.log", float(os.environ.get("TESTS_TIMEOUT", 200)),
        )
    if mode in ("all", "bench"):
        codes["bench"] = sh(
            [py, "-m", "mla_multi", "bench", "dcp", "--json", os.path.join(OUT, "bench_dcp.json")],
            "bench.txt", float(os.environ.get("BENCH_TIMEOUT", 240)),
        )
    print("\n== summary ==")
    if "tests" in codes:
        results = tail_lines("pytest.log", lambda line: re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)
                             or line.startswith(("FAILED", "ERROR", "SKIPPED")))
        print("tests:", *(results[-12:] or ["no result line (see pytest.log)"]), sep="\n  ")
    if "bench" in codes:
        table = tail_lines("bench.txt", lambda line: line.startswith(("device:", "   B  "))
                           or re.match(r"\s*\d+\s+\d+\s+\d+\s", line))
        print("bench dcp:", *(table or ["no table (see bench.txt)"]), sep="\n  ")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
