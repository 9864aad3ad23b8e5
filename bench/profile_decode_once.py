"""One decode launch to profile (e.g. under `ncu --launch-skip 2 --launch-count 1 -k regex:mla_decode`).

    PYTHONPATH=. python3 bench/profile_decode_once.py B S HEADS CONFIG [KV_DTYPE]

CONFIG as `mla-multi bench decode --configs` takes it (h64n64w4s2rm, h64n64w8s2wg,
h64n64w8s2nolicm, ...); KV_DTYPE a torch dtype name (default bfloat16). Block size
64, random scattered block tables, one split, three launches (two warm-ups).
"""
import sys, torch
from mla_multi.benchmarks.decode import parse_config
from mla_multi.kernels.mla_decode import mla_decode_fwd, attn_logits_width
B, S, H, cfg = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), parse_config(sys.argv[4])
dt = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.bfloat16
bs = 64; nb = B * S // bs
cache = torch.randn(nb, bs, 576, device="cuda").to(dt)
ks = torch.tensor([0.05], device="cuda") if dt != torch.bfloat16 else None
bt = torch.randperm(nb, device="cuda").int().reshape(B, S // bs)
sl = torch.full((B,), S, dtype=torch.int32, device="cuda")
qn = torch.randn(B, H, 512, device="cuda", dtype=torch.bfloat16); qp = torch.randn(B, H, 64, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(qn); lse = torch.empty(B, H, device="cuda")
al = torch.empty(B, H, 1, attn_logits_width(512), device="cuda")
for _ in range(3):
    mla_decode_fwd(qn, qp, cache, bt, sl, 0.07, k_scale=ks, num_kv_splits=1, attn_logits=al, out=out, lse=lse, config=cfg)
torch.cuda.synchronize()
