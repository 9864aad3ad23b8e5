"""One GPU session for the prefill kernels: GPU tests, then the benchmark.

Runs ``pytest -m gpu`` on the prefill and merge kernel tests and then
``mla-multi bench prefill`` (optionally sweeping launch configurations), writing every
log under ``--out``. Usage on a CUDA machine::

    PYTHONPATH=. python3 bench/gpu_check_prefill.py --out /tmp/prefill-check \\
        [--configs m128n64w8s3,m128n64w8s3tma] [--skip-tests] [--skip-bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], log_path: str, timeout: float) -> int:
    start = time.time()
    print(f"$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
            log.write(f"\n[timed out after {timeout:.0f} s]\n")
    print(f"  -> exit {code} in {time.time() - start:.0f} s; log {log_path}", flush=True)
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/prefill-check"))
    parser.add_argument("--configs", default="")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--shapes", default="1x8192,4x2048,1x16384")
    parser.add_argument("--extra", action="store_true", help="pass --extra to the benchmark")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--test-timeout", type=float, default=150)
    parser.add_argument("--bench-timeout", type=float, default=200)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    info = subprocess.run(
        [sys.executable, "-c", "import torch, triton; print(torch.__version__, triton.__version__, "
         "torch.cuda.get_device_name(), torch.backends.cudnn.version())"],
        capture_output=True, text=True,
    )  # fmt: skip
    print("env:", info.stdout.strip() or info.stderr.strip()[-500:], flush=True)

    codes = {}
    if not args.skip_tests:
        codes["tests"] = _run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider",
             "tests/test_kernels_prefill.py", "tests/test_kernels_merge.py"],
            os.path.join(args.out, "pytest.log"),
            args.test_timeout,
        )  # fmt: skip
        with open(os.path.join(args.out, "pytest.log")) as log:
            print("".join(log.readlines()[-25:]), flush=True)
    if not args.skip_bench:
        codes["bench"] = _run(
            [sys.executable, "-m", "mla_multi", "bench", "prefill", "--heads", args.heads, "--shapes", args.shapes,
             "--configs", args.configs, "--json", os.path.join(args.out, "bench.json")]
            + (["--extra"] if args.extra else []),
            os.path.join(args.out, "bench.log"),
            args.bench_timeout,
        )  # fmt: skip
        with open(os.path.join(args.out, "bench.log")) as log:
            print(log.read()[-6000:], flush=True)
    print("exit codes:", codes)
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
