"""GPU memory of a 61-layer DeepSeek-V3 attention stack beyond its kv_b_proj weights (torch.cuda.memory_allocated).

    PYTHONPATH=. python3 bench/layer_weights_memory.py [--heads 128] [--layers 61]

Each layer gets its own kv_b_proj weight (bf16 [N * 256, 512], as a model loads them: 32 MiB a layer at 128 heads);
the weights are allocated first, then the layers are built. "Beyond the weights" is what the layers add: the
shared workspace, and (before MLAAttention held W_UK / W_UV as views of the weight) a copy of every weight. Runs
on any revision of the package (public API only), e.g. the one before the change:

    git archive e8bdf49 mla_multi | tar -x -C /tmp/before && PYTHONPATH=/tmp/before python3 bench/layer_weights_memory.py
"""
from __future__ import annotations

import argparse
import gc

import torch

import mla_multi as mm

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--layers", type=int, default=61)
    args = parser.parse_args()
    device = torch.device("cuda")
    dims = mm.MLADims.deepseek_v3(num_heads=args.heads)
    mm.workspace.set_workspace_manager(None, device)
    gc.collect()
    torch.cuda.empty_cache()
    weights = [torch.randn(args.heads * 256, 512, device=device, dtype=torch.bfloat16) / 512**0.5
               for _ in range(args.layers)]
    torch.cuda.synchronize()
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    base = torch.cuda.memory_allocated()
    layers = [mm.MLAAttention(dims, dims.qk_head_dim**-0.5, w, block_size=64, max_model_len=32768, max_num_seqs=256)
              for w in weights]
    torch.cuda.synchronize()
    added = torch.cuda.memory_allocated() - base
    workspace = layers[0].workspace.size_bytes
    print(f"package {mm.__file__}")
    print(f"{args.layers} layers, {args.heads} heads, bf16, max_num_seqs 256, max_model_len 32768, backends "
          f"{layers[0].backends()}")
    print(f"kv_b_proj weights (allocated before the layers): {weight_bytes / MIB:9.1f} MiB "
          f"({weight_bytes / args.layers / MIB:.1f} MiB a layer)")
    print(f"added by building the layers:                     {added / MIB:9.1f} MiB")
    print(f"  of which the shared workspace:                  {workspace / MIB:9.1f} MiB")
    print(f"  the rest (per-layer weight copies, if any):     {(added - workspace) / MIB:9.1f} MiB")
    print(f"model total (weights + layers):                   {(weight_bytes + added) / MIB:9.1f} MiB")


if __name__ == "__main__":
    main()
