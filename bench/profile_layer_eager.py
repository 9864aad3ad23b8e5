"""Host profile of one eager `MLAAttention.forward` decode step (DeepSeek-V3 dims, 128 heads, bf16, B = 1,
S = 8192, planned outside): host µs per call with the GPU synchronised after each, and the functions that
take it (cProfile, 300 calls; own time and cumulative)."""

import cProfile
import pstats
import time

import torch

import mla_multi as mm

dims = mm.MLADims.deepseek_v3(num_heads=128)
device = torch.device("cuda")
weight = (torch.randn(128 * 256, 512, device=device) / 512**0.5).to(torch.bfloat16)
layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=64, max_model_len=8192, max_num_seqs=256,
                        decode_backend="TRITON")
cache = torch.randn(128, 64, 576, device=device, dtype=torch.bfloat16)
table = torch.arange(128, device=device, dtype=torch.int32).view(1, 128)
q = torch.randn(1, 128, 192, device=device, dtype=torch.bfloat16)
kv_c = torch.randn(1, 512, device=device, dtype=torch.bfloat16)
k_pe = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
out = torch.empty(1, 128 * 128, device=device, dtype=torch.bfloat16)
md = mm.CommonAttentionMetadata.from_lengths([1], [8192], table, 64)
layer.plan(md)


def step():
    layer.forward(q, kv_c, k_pe, cache, md, output=out)


for _ in range(30):
    step()
torch.cuda.synchronize()
times = []
for _ in range(300):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
times.sort()
print(f"host µs per eager decode step (B=1, N=128): median {times[150] * 1e6:.1f}, min {times[0] * 1e6:.1f}")
profile = cProfile.Profile()
profile.enable()
for _ in range(300):
    step()
    torch.cuda.synchronize()
profile.disable()
stats = pstats.Stats(profile)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(30)
