"""Host time of one step's metadata (`CommonAttentionMetadata.from_lengths`) and plan (`MLAAttention.plan`)
on a GPU: the issue's mixed step (64 decodes of 4096 + 16 prefills of 512 over 3584 cached), 128 heads, the
registry's default backends. Each figure is the best of 40 batches of 20 fresh steps (a noisy host's spikes
left out); with a second argument, also a Python profile of 200 steps and the cost of the primitives.

    PYTHONPATH=. python3 bench/plan_host_time.py LABEL [profile]
"""
import cProfile
import io
import pstats
import sys
import time

import torch

import mla_multi as mm

query_lens = [1] * 64 + [512] * 16
seq_lens = [4096] * 64 + [4096] * 16
heads, block_size = 128, 64
dims = mm.MLADims.deepseek_v3(num_heads=heads)
device = "cuda"
weight = (torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, device=device)
          / dims.kv_lora_rank**0.5).to(torch.bfloat16)
layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=block_size, max_model_len=8192,
                        max_num_seqs=256)
table = torch.randperm(80 * 128, device=device).int().reshape(80, 128)


def metadata():
    return mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, block_size)


layer.plan(metadata())
torch.cuda.synchronize()
best_metadata = best_plan = float("inf")
for _ in range(40):
    start = time.perf_counter()
    steps = [metadata() for _ in range(20)]
    middle = time.perf_counter()
    for step in steps:
        layer.plan(step)
    end = time.perf_counter()
    torch.cuda.synchronize()
    best_metadata = min(best_metadata, (middle - start) / 20 * 1e6)
    best_plan = min(best_plan, (end - middle) / 20 * 1e6)
label = sys.argv[1] if len(sys.argv) > 1 else ""
print(f"{label} metadata {best_metadata:.1f} µs  plan {best_plan:.1f} µs  total {best_metadata + best_plan:.1f}")

if len(sys.argv) > 2:
    from mla_multi.benchmarks import host_time

    def per_call(name, fn):
        print(f"  {name}: {host_time(fn, calls=2000):.2f} µs")

    host = torch.tensor(query_lens, dtype=torch.int32)
    pinned = host.pin_memory()
    per_call("torch.tensor(80 ints)", lambda: torch.tensor(query_lens, dtype=torch.int32))
    per_call("pin_memory()", lambda: host.pin_memory())
    per_call("pinned.to(cuda, non_blocking)", lambda: pinned.to(device, non_blocking=True))
    per_call("torch.empty on the GPU", lambda: torch.empty(8192, dtype=torch.int64, device=device))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        layer.plan(metadata())
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
