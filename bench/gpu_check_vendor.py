"""GPU check of the vendor backends on an NVIDIA GPU.

    PYTHONPATH=. python3 bench/gpu_check_vendor.py [--out DIR]

1. Reports what this torch offers for varlen prefill (varlen_attn and its
   signature, the flash / cuDNN attention ops) and which implementation
   CUDA_FLASH_ATTN picks.
2. Runs the gpu-marked tests of tests/test_backend_cuda_flash_attn.py.
3. Times CUDA_FLASH_ATTN's prefill on DeepSeek-V3 shapes (N 16 / 128, one
   causal sequence of 8192 tokens, qk 192 / v 128, bfloat16) beside PyTorch's
   dense SDPA kernels, in TFLOP/s counted as 2 * N * causal_pairs * (192 + 128).

Writes vendor_gpu.json and the test log under DIR (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import subprocess
import sys

import torch

from mla_multi.backends import cuda_flash_attn as fa
from mla_multi.backends.reference import varlen_attention_reference
from mla_multi.testing import relative_error


def environment() -> dict:
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "cudnn": torch.backends.cudnn.version(),
        "flash_attention_available": torch.backends.cuda.is_flash_attention_available(),
    }
    try:
        from torch.nn.attention import varlen

        info["varlen_attn_signature"] = str(inspect.signature(varlen.varlen_attn))
    except Exception as error:
        info["varlen_attn_signature"] = f"none ({type(error).__name__}: {error})"
    for op in ("_flash_attention_forward", "_cudnn_attention_forward"):
        info[op] = str(getattr(torch.ops.aten, op).default._schema) if hasattr(torch.ops.aten, op) else "none"
    info["implementations"] = {name: p.error or f"available {p.version or ''}".strip() for name, p in fa.probe_implementations().items()}
    info["selected_with_lse"] = fa.FlashAttnPrefillBackend.prefill_implementation(need_lse=True)
    info["selected_without_lse"] = fa.FlashAttnPrefillBackend.prefill_implementation(need_lse=False)
    return info


def run_tests(out: pathlib.Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-s",
               "tests/test_backend_cuda_flash_attn.py"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    (out / "vendor_gpu_tests.log").write_text(log)
    tail = log.strip().splitlines()[-3:] if log.strip() else []
    return {"returncode": done.returncode, "tail": tail}


def cudnn_varlen_probe() -> str:
    """Whether aten._cudnn_attention_forward runs varlen [T, N, D] inputs with Dv != Dqk, checked against float64."""
    if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        return "no _cudnn_attention_forward"
    generator = torch.Generator(device="cuda").manual_seed(0)
    lens = [64, 96]
    cu = torch.tensor([0, 64, 160], dtype=torch.int32, device="cuda")
    q = torch.randn(160, 4, 192, device="cuda", generator=generator).bfloat16()
    k = torch.randn(160, 4, 192, device="cuda", generator=generator).bfloat16()
    v = torch.randn(160, 4, 128, device="cuda", generator=generator).bfloat16()
    try:
        result = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max(lens), max(lens), True, 0.0, True, False, scale=0.1)
        out, lse = result[0], result[1]
    except Exception as error:
        return f"raises {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    ref, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, 0.1, True)
    return (f"runs: out {tuple(out.shape)} rel err {relative_error(out, ref):.2e}, "
            f"lse {tuple(lse.shape)} {lse.dtype}")


def time_ms(function, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench(num_heads: int, seq_len: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device="cuda").manual_seed(num_heads)
    q = torch.randn(seq_len, num_heads, 192, device="cuda", generator=generator).bfloat16()
    k = torch.randn(seq_len, num_heads, 192, device="cuda", generator=generator).bfloat16()
    v = torch.randn(seq_len, num_heads, 128, device="cuda", generator=generator).bfloat16()
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    scale = 192 ** -0.5
    flops = 2 * num_heads * (seq_len * (seq_len + 1) // 2) * (192 + 128)
    rows = []

    def record(name, function):
        try:
            ms = time_ms(function)
            rows.append({"N": num_heads, "S": seq_len, "kernel": name, "ms": round(ms, 3), "TFLOP/s": round(flops / ms / 1e9, 1)})
        except Exception as error:
            rows.append({"N": num_heads, "S": seq_len, "kernel": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})

    impl = fa.FlashAttnPrefillImpl(num_heads, scale, 512, 128, 64, 128)
    probes = fa.probe_implementations()
    for name in fa.PREFILL_IMPLEMENTATIONS:
        if probes[name].error:
            continue
        runner = fa._RUNNERS[name]
        record(f"CUDA_FLASH_ATTN[{name}] +lse", lambda r=runner, p=probes[name]: r(p, q, k, v, cu, cu, seq_len, seq_len, scale, True, True))
    record("CUDA_FLASH_ATTN forward_varlen (no lse)", lambda: impl.forward_varlen(q, k, v, cu, cu, seq_len, seq_len, True, False))
    # PyTorch's dense SDPA on the same problem, [1, N, S, D]; V keeps its 128 columns.
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def dense(backend=backend, value=vd):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, value, is_causal=True, scale=scale)
        record(f"sdpa[{backend.name}] dense", dense)
    vd_padded = torch.nn.functional.pad(vd, (0, 64))

    def dense_flash_padded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd_padded, is_causal=True, scale=scale)
    record("sdpa[FLASH_ATTENTION] dense, V padded to 192", dense_flash_padded)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (torch.cuda.is_available() and torch.version.cuda):
        sys.exit("needs an NVIDIA GPU")
    report = {"environment": environment()}
    for key, value in report["environment"].items():
        print(f"{key}: {value}")
    report["cudnn_varlen"] = cudnn_varlen_probe()
    print("cudnn varlen:", report["cudnn_varlen"])
    if not args.skip_tests:
        report["tests"] = run_tests(out)
        print("tests:", report["tests"])
    rows = []
    for num_heads in (16, 128):
        rows += bench(num_heads, 8192)
        torch.cuda.empty_cache()
    report["prefill"] = rows
    print(f"\n{'N':>4} {'S':>6}  {'kernel':<52} {'ms':>8} {'TFLOP/s':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['N']:>4} {row['S']:>6}  {row['kernel']:<52} {row['error']}")
        else:
            print(f"{row['N']:>4} {row['S']:>6}  {row['kernel']:<52} {row['ms']:>8.3f} {row['TFLOP/s']:>8.1f}")
    (out / "vendor_gpu.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
