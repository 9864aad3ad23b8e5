"""GPU kernels of one eager `MLAAttention` step (DeepSeek-V3 dims, bf16, block 64), per prefill backend:
torch.profiler's CUDA time per kernel, to see where a layer step's time goes beyond its attention kernel.

    python3 bench/profile_layer_kernels.py [--heads 128] [--steps prefill:1x8192,prefill:16x512+3584] [--backends TRITON,FLASHINFER]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import mla_multi as mm
from mla_multi.benchmarks.layer import BLOCK_SIZE, parse_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--steps", default="prefill:1x8192,prefill:16x512+3584")
    parser.add_argument("--backends", default="TRITON,FLASHINFER")
    args = parser.parse_args()
    heads = args.heads
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    device = torch.device("cuda")
    weight = (torch.randn(heads * 256, 512, device=device) / 512**0.5).to(torch.bfloat16)
    for text in args.steps.split(","):
        _, query_lens, seq_lens = parse_step(text)
        max_len = max(seq_lens)
        blocks = -(-max_len // BLOCK_SIZE)
        cache = torch.randn(len(seq_lens) * blocks, BLOCK_SIZE, 576, device=device, dtype=torch.bfloat16)
        table = torch.arange(len(seq_lens) * blocks, device=device, dtype=torch.int32).view(len(seq_lens), blocks)
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)
        kv_c = torch.randn(tokens, 512, device=device, dtype=torch.bfloat16)
        k_pe = torch.randn(tokens, 64, device=device, dtype=torch.bfloat16)
        out = torch.empty(tokens, heads * 128, device=device, dtype=torch.bfloat16)
        for backend in args.backends.split(","):
            try:
                layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK_SIZE,
                                        max_model_len=max_len, max_num_seqs=max(256, len(seq_lens)),
                                        prefill_backend=backend)
            except Exception as error:  # noqa: BLE001 - a backend not installed
                print(f"{text} {backend}: {type(error).__name__}: {str(error)[:120]}")
                continue
            md = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK_SIZE)
            layer.plan(md)
            for _ in range(3):
                layer.forward(q, kv_c, k_pe, cache, md, output=out)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    layer.forward(q, kv_c, k_pe, cache, md, output=out)
                torch.cuda.synchronize()
            totals: dict[str, list] = {}
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    entry = totals.setdefault(event.name[:90], [0, 0.0])
                    entry[0] += 1
                    entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            whole = sum(t for _, t in totals.values()) / 5
            print(f"\n{text} N={heads} prefill={backend}: {whole:.0f} µs of kernels per step")
            for name, (count, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:12]:
                print(f"  {total / 5:9.1f} µs  x{count // 5:<3d} {name}")


if __name__ == "__main__":
    main()
