"""GPU check of the decode kernel, the cache ops and the decode benchmark, in one script.

    PYTHONPATH=. python3 bench/gpu_check_decode.py [all|tests|bench|candidates|sweep]

Writes its logs under $OUT (or ./gpu_check_out): env.txt, pytest.log, bench.txt / bench.json,
candidates.txt, sweep.txt / sweep.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out")


def sh(command: list[str], log: str, timeout: float) -> int:
    start = time.time()
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    with open(os.path.join(OUT, log), "a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\nTIMEOUT after {timeout} s\n")
            code = 124
        handle.write(f"\n[exit {code}, {time.time() - start:.0f} s]\n")
    print(f"{log}: exit {code} in {time.time() - start:.0f} s", flush=True)
    return code


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all"
    os.makedirs(OUT, exist_ok=True)
    py = sys.executable
    sh(["bash", "-c", "nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'"],
       "env.txt", 60)
    if mode in ("all", "tests"):
        sh([py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_kernels_decode.py",
            "tests/test_cache_ops_triton.py", "tests/test_attention.py", "-rf"], "pytest.log",
           float(os.environ.get("TESTS_TIMEOUT", 200)))
        # the compile check with the device's own Triton
        sh([py, "-m", "mla_multi.compile_check", "--targets", "sm_90", "--kernels", "mla_decode"], "compile_sm90.txt",
           200)
    if mode in ("all", "bench"):
        sh([py, "-m", "mla_multi", "bench", "decode", "--kernel-times", "--json", os.path.join(OUT, "bench.json")], "bench.txt", 120)
        sh([py, "-m", "mla_multi", "bench", "decode", "--kv-dtype", "float8_e4m3fn", "--cases", "32x4096,128x4096,128x16384",
            "--json", os.path.join(OUT, "bench_fp8.json")], "bench.txt", 60)
    if mode in ("all", "candidates"):
        # the sm_90 64-row configurations with and without loop-invariant code
        # motion (with it they spill), against the 16-row tile
        sh([py, "-m", "mla_multi", "bench", "decode", "--heads", "64,128", "--cases", "32x4096,128x4096",
            "--configs", "h64n64w8s2nolicm,h64n64w8s2,h16n64w4s2"],
           "candidates.txt", 150)
        sh([py, "-m", "mla_multi", "bench", "decode", "--heads", "128", "--cases", "128x4096", "--kv-dtype", "float8_e4m3fn",
            "--configs", "h64n32w8s2nolicm,h64n32w8s2,h16n64w8s2"],
           "candidates.txt", 100)
    if mode in ("all", "sweep"):
        sh([py, "-m", "mla_multi", "bench", "decode", "--heads", "16", "--cases", "32x4096,1x32768", "--splits", "4,8,16,64,128"],
           "sweep.txt", 50)
        sh([py, "-m", "mla_multi", "bench", "decode", "--heads", "32,64", "--cases", "32x4096,128x4096"], "sweep.txt", 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
