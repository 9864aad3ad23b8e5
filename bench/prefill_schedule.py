"""The sm_90 prefill kernel's schedules side by side (causal, qk 192 / v 128, bf16, the rotary key apart as MLA
passes it): persistent with the fixed alternating order, persistent taking items dynamically, one program per
item, and the default launch's choice (`prefill_wgmma.takes_dynamic`), on equal batches, long sequences and
ragged batches; TFLOP/s of CUDA-graph replays (`triton.testing.do_bench`, median), two rounds in one process.

    PYTHONPATH=. python3 bench/prefill_schedule.py
"""
import random

import torch
import triton

from mla_multi.kernels.prefill_wgmma import varlen_attention_wgmma
from mla_multi.testing import capture_graph

torch.manual_seed(0)
random.seed(3)
CASES = [(128, [512] * 16), (16, [512] * 16), (16, [2048] * 4), (128, [2048] * 4), (16, [8192]), (128, [8192])]
for heads in (16, 128):
    for _ in range(2):
        CASES.append((heads, [random.randint(64, 4096) for _ in range(random.choice([6, 12, 24]))]))
    CASES.append((heads, [8192, 4096, 2048, 1024, 512, 300, 128, 77, 17, 1]))
VARIANTS = {"fixed": dict(persistent=True, dynamic=False), "dynamic": dict(persistent=True, dynamic=True),
            "per-item": dict(persistent=False, dynamic=False), "default": {}}

for heads, lengths in CASES:
    total = sum(lengths)
    q = torch.randn(total, heads, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(total, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.empty(total, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(heads, total, device="cuda", dtype=torch.float32)
    flops = 2.0 * heads * sum(n * (n + 1) / 2 for n in lengths) * 320
    results = {name: [] for name in VARIANTS}
    for _ in range(2):
        for name, keywords in VARIANTS.items():
            def run(keywords=keywords):
                varlen_attention_wgmma(q, k, v, cu, cu, max(lengths), max(lengths), 192**-0.5, causal=True, out=out,
                                       lse=lse, k_pe=k_pe, **keywords)
            run()
            graph = capture_graph(run)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
            results[name].append(flops / ms / 1e9)
            del graph
    shape = (f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1
             else f"ragged, {len(lengths)} sequences up to {max(lengths)}")
    print(f"N={heads} {shape}: " + ", ".join(f"{name} {a:.1f} / {b:.1f}" for name, (a, b) in results.items()),
          flush=True)
