"""Per-tile time of the sm_90 warp-specialised decode kernels, with the cache in L2 or in HBM.

    PYTHONPATH=. python3 bench/tile_times.py

One split per request, so each program walks S / 64 tiles in a row; for each
kernel (`ws` at 16 heads, `rm` at 128) and cache dtype (FP8, bf16) it times
(median of `triton.testing.do_bench`, eager launches):

* B = 4: four programs, a 9-19 MB cache that stays in L2 between launches,
  nothing else on the device (the kernel's own chain per tile);
* B = 128, random and sequential block tables, and random over a cache with
  60000 more blocks (whether page locality or the TLB matter).

Per tile = time / (S / 64); at 128 heads and B = 128 there are two programs per
SM, so the per-SM figure is half of it.
"""
import torch
import triton

from mla_multi.benchmarks.decode import parse_config
from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd


def run(batch, seq_len, heads, config, dtype, order, extra_blocks=0):
    cfg = parse_config(config)
    block = 64
    blocks = batch * seq_len // block + extra_blocks
    cache = torch.randn(blocks, block, 576, device="cuda").to(dtype)
    k_scale = torch.tensor([0.05], device="cuda") if dtype != torch.bfloat16 else None
    if order == "random":
        table = torch.randperm(blocks, device="cuda")[: batch * seq_len // block]
    else:
        table = torch.arange(batch * seq_len // block, device="cuda")
    table = table.int().reshape(batch, seq_len // block)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_nope)
    lse = torch.empty(batch, heads, device="cuda")
    logits = torch.empty(batch, heads, 1, attn_logits_width(512), device="cuda")

    def call():
        mla_decode_fwd(
            q_nope, q_pe, cache, table, lens, 0.07, k_scale=k_scale, num_kv_splits=1,
            attn_logits=logits, out=out, lse=lse, config=cfg,
        )

    call()
    torch.cuda.synchronize()
    us = triton.testing.do_bench(call, warmup=20, rep=200, return_mode="median") * 1e3
    tiles = seq_len // block
    print(
        f"N={heads:3d} B={batch:3d} S={seq_len} {config:13s} {str(dtype)[6:]:13s} {order:10s} "
        f"+{extra_blocks:5d} blocks: {us:7.1f} us, {us / tiles * 1e3:5.0f} ns per tile",
        flush=True,
    )


if __name__ == "__main__":
    for heads, config in ((16, "h16n64w4s2ws"), (128, "h64n64w4s2rm")):
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            run(4, 4096, heads, config, dtype, "random")
            run(128, 4096, heads, config, dtype, "random")
            run(128, 4096, heads, config, dtype, "sequential")
            run(128, 4096, heads, config, dtype, "random", extra_blocks=60000)
