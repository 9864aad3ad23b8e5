"""Host profile of one eager mm.ops.mla_sparse_decode call per backend (B = 1, N = 128, topk 2048, fp8_ds_mla):
the top functions by own time over 300 calls, and the mean wall time per call with the GPU idle."""

import cProfile
import pstats
import sys

import torch

import mla_multi as mm
from mla_multi.benchmarks import host_time
from mla_multi.ds_mla_cache import quantize_fp8_ds_mla

backends = sys.argv[1].split(",") if len(sys.argv) > 1 else ["FLASHMLA", "TRITON"]
cache = quantize_fp8_ds_mla(torch.randn(4096 * 64, 512, device="cuda"), torch.randn(4096 * 64, 64, device="cuda"))
cache = cache.view(4096, 64, 656)
q = torch.randn(1, 128, 576, device="cuda", dtype=torch.bfloat16)
indices = torch.randperm(4096 * 64, device="cuda")[:2048].view(1, 2048).to(torch.int32)
for backend in backends:
    def call():
        return mm.ops.mla_sparse_decode(q[..., :512], q[..., 512:], cache, indices, 0.07, backend=backend)

    for _ in range(20):
        call()
    host = host_time(call)
    print(f"{backend}: {host:.1f} µs host per eager call (300 calls, no sync between)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        call()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(22)
