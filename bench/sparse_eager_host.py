"""Host time of one eager `mm.ops.mla_sparse_decode` call (128 heads, topk 2048, the registry's default
backend) for the fp8_ds_mla and bf16 caches at 1 and 32 tokens: the best of 40 batches of 10 calls (a
noisy host's spikes left out), beside the call's time replayed from a CUDA graph.

    PYTHONPATH=. python3 bench/sparse_eager_host.py
"""
import time

import torch

import mla_multi as mm
from mla_multi.benchmarks import graph_time
from mla_multi.ds_mla_cache import quantize_fp8_ds_mla

torch.manual_seed(0)
latent = torch.randn(4096 * 64, 512, device="cuda")
rope = torch.randn(4096 * 64, 64, device="cuda")
caches = {"fp8_ds_mla": quantize_fp8_ds_mla(latent, rope).view(4096, 64, 656),
          "bf16": torch.cat([latent, rope], -1).to(torch.bfloat16).view(4096, 64, 576)}
for name, cache in caches.items():
    for tokens in (1, 32):
        q = torch.randn(tokens, 128, 576, device="cuda", dtype=torch.bfloat16)
        indices = torch.stack([torch.randperm(4096 * 64, device="cuda")[:2048] for _ in range(tokens)]).to(torch.int32)

        def call():
            return mm.ops.mla_sparse_decode(q[..., :512], q[..., 512:], cache, indices, 0.07)

        for _ in range(20):
            call()
        host = float("inf")
        for _ in range(40):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                call()
            host = min(host, (time.perf_counter() - start) / 10 * 1e6)
        torch.cuda.synchronize()
        print(f"{name} B={tokens}: host {host:.1f} µs a call, captured {graph_time(call):.1f} µs", flush=True)
