"""Sparse MLA (DeepSeek-V3.2's top-k attention) over the fp8_ds_mla cache: the op, then the layer.

    python examples/sparse_cache.py

The fp8_ds_mla cache (FlashMLA's layout, `mla_multi.ds_mla_cache`) is uint8 [num_blocks, block_size, 656]:
per token 512 e4m3fn latent values, 4 float32 tile scales and 64 bf16 rotary values. Each query token names
the cache slots it attends to: indices int32 [T, topk], slot = block * block_size + offset, -1 = none.
Shapes: q_nope [T, N, 512] (absorbed), q_pe [T, N, 64]; output [T, N, 512], LSE [T, N] float32.
"""

import torch

import mla_multi as mm

device = mm.current_platform().torch_device
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
dims = mm.MLADims.deepseek_v3(num_heads=64)  # FlashMLA's sparse kernels take 64 or 128 heads
block_size, num_blocks, tokens, topk = 64, 8, 5, 128
torch.manual_seed(0)

# 512 cached tokens, written once into a float cache and once into an fp8_ds_mla cache.
num_slots = num_blocks * block_size
slots = torch.arange(num_slots, device=device)
kv_c = torch.randn(num_slots, dims.kv_lora_rank, device=device, dtype=dtype)
k_pe = torch.randn(num_slots, dims.qk_rope_head_dim, device=device, dtype=dtype)
cache = torch.zeros(num_blocks, block_size, dims.kv_cache_width, device=device, dtype=dtype)
ds_cache = torch.zeros(num_blocks, block_size, 656, device=device, dtype=torch.uint8)
mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots)
mm.ops.concat_and_cache_mla(kv_c, k_pe, ds_cache, slots)  # a uint8 [.., 656] cache: quantised per 128-value tile

q_nope = torch.randn(tokens, dims.num_heads, dims.kv_lora_rank, device=device, dtype=dtype)
q_pe = torch.randn(tokens, dims.num_heads, dims.qk_rope_head_dim, device=device, dtype=dtype)
indices = torch.randint(0, num_slots, (tokens, topk), device=device, dtype=torch.int32)
indices[:, -8:] = -1  # no token there
scale = dims.qk_head_dim**-0.5
out, lse = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, scale, return_lse=True)
ds_out = mm.ops.mla_sparse_decode(q_nope, q_pe, ds_cache, indices, scale)
error = ((ds_out.float() - out.float()).norm() / out.float().norm()).item()
print(f"sparse decode, top-{topk}: output {tuple(out.shape)}, lse {tuple(lse.shape)}; "
      f"fp8_ds_mla against the {dtype} cache: rel err {error:.2e}")
assert error < 1e-1, error  # e4m3 latent values: a few per cent

# The sparse layer: each new token's positions inside its own request (as an indexer makes them), written
# to the cache, turned into slots through the block table, and attended to in the latent space.
weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                     device=device, dtype=dtype) / dims.kv_lora_rank**0.5
layer = mm.MLAAttention(dims, scale, weight, block_size=block_size, max_model_len=4 * block_size, max_num_seqs=2,
                        sparse_topk=topk, kv_cache_dtype="fp8_ds_mla")
layer_cache = torch.zeros(num_blocks, block_size, 656, device=device, dtype=torch.uint8)
block_table = torch.arange(8, dtype=torch.int32, device=device).reshape(2, 4)
query_lens, seq_lens = [150, 100], [150, 100]
metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, block_table, block_size)
total = sum(query_lens)
q = torch.randn(total, dims.num_heads, dims.qk_head_dim, device=device, dtype=dtype)
new_kv_c = torch.randn(total, dims.kv_lora_rank, device=device, dtype=dtype)
new_k_pe = torch.randn(total, dims.qk_rope_head_dim, device=device, dtype=dtype)
# token j of a request sees positions 0..j of it (causal); pick topk of them, -1 where it has fewer
own_position = torch.cat([torch.arange(n, device=device) for n in query_lens])
picks = torch.randint(0, 1 << 30, (total, topk), device=device) % (own_position[:, None] + 1)
topk_indices = torch.where(torch.arange(topk, device=device) <= own_position[:, None], picks, -1).to(torch.int32)
hidden = layer.forward(q, new_kv_c, new_k_pe, layer_cache, metadata, topk_indices=topk_indices)
print(f"sparse MLAAttention (fp8_ds_mla, top-{topk}): q {tuple(q.shape)} -> output {tuple(hidden.shape)}, "
      f"backends {layer.backends()}")
