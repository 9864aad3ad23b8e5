"""Launch configurations of the TRITON sparse decode kernel over the fp8_ds_mla cache (graph replay, one
process): `python3 bench/sparse_configs.py` prints µs per call for each (BLOCK_H, BLOCK_N, warps, splits)."""

import math

import torch
import triton

from mla_multi.ds_mla_cache import quantize_fp8_ds_mla
from mla_multi.kernels.sparse_decode import sparse_decode
from mla_multi.testing import capture_graph

CONFIGS = [(16, 16, 4), (32, 32, 8), (32, 16, 4), (16, 32, 4)]
for heads, batch in ((128, 1), (128, 64), (64, 64), (128, 128)):
    slots = 1 << 20
    cache = torch.empty(slots, 656, dtype=torch.uint8, device="cuda")
    for start in range(0, slots, 1 << 16):
        cache[start:start + (1 << 16)] = quantize_fp8_ds_mla(torch.randn(1 << 16, 512, device="cuda"),
                                                             torch.randn(1 << 16, 64, device="cuda"))
    cache = cache.view(-1, 64, 656)
    copies = max(1, math.ceil(256e6 / (batch * 2048 * 656)))
    indices = [torch.randint(0, slots, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(copies)]
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)
    for bh, bn, w in CONFIGS:
        for splits in (None, 1):
            try:
                def run():
                    for idx in indices:
                        sparse_decode(q[..., :512], q[..., 512:], cache, idx, 0.07, block_h=bh, block_n=bn,
                                      num_warps=w, num_splits=splits)
                run()
                graph = capture_graph(run)
                us = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / copies * 1e3
                flops = 2 * batch * heads * 2048 * 1088
                print(f"N={heads} B={batch} h{bh} n{bn} w{w} splits={splits or 'auto'}: {us:.1f} µs "
                      f"({flops / us / 1e6:.0f} TFLOP/s)", flush=True)
            except Exception as error:
                print(f"N={heads} B={batch} h{bh} n{bn} w{w}: {type(error).__name__}: {str(error)[:120]}", flush=True)
    del cache
