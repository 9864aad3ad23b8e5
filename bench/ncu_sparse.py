"""One fp8_ds_mla sparse decode case (TRITON, and FlashMLA's own call where it is installed) called three
times each on the same inputs, for Nsight Compute to profile the third call of each:

    ncu --clock-control none -k regex:"mla_decode_ws|flash" -s 2 -c 1 --section SpeedOfLight \\
        python3 bench/ncu_sparse.py 128,128      # N,T; topk 2048 rows drawn from a 256K-row cache
"""
import sys

import torch

import mla_multi as mm
from mla_multi.benchmarks.sparse import random_fp8_ds_mla_cache

torch.manual_seed(0)
heads, tokens = (int(x) for x in sys.argv[1].split(","))
rows = 1 << 18
cache = random_fp8_ds_mla_cache(rows // 64, "cuda")
indices = torch.stack([torch.randperm(rows, device="cuda")[:2048] for _ in range(tokens)]).int()
q = torch.randn(tokens, heads, 576, device="cuda", dtype=torch.bfloat16)
scale = 192**-0.5
for _ in range(3):
    mm.ops.mla_sparse_decode(q[..., :512], q[..., 512:], cache, indices, scale, backend="TRITON")
torch.cuda.synchronize()
try:
    import flash_mla
except ImportError:
    flash_mla = None
if flash_mla is not None and heads in (64, 128):
    sched, _ = flash_mla.get_mla_metadata()
    for _ in range(3):
        flash_mla.flash_mla_with_kvcache(q.unsqueeze(1), cache.view(-1, 64, 1, 656), None, None, 512, sched,
                                         softmax_scale=scale, is_fp8_kvcache=True, indices=indices.unsqueeze(1),
                                         use_legacy=True)
    torch.cuda.synchronize()
