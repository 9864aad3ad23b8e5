"""An FP8 KV cache: per-tensor scale, written by concat_and_cache_mla, dequantised inside the decode.

    python examples/fp8_cache.py

The FP8 flavour is the platform's (float8_e4m3fnuz on gfx942 / MI300, float8_e4m3fn on gfx950 and NVIDIA;
e4m3fn on the CPU). Shapes: kv_c [T, 512] and k_pe [T, 64] written into kv_cache [num_blocks, block_size, 576];
q_nope [B, N, 512] (absorbed), q_pe [B, N, 64]; output [B, N, 512], LSE [B, N] float32.
"""

import torch

import mla_multi as mm

platform = mm.current_platform()
device = platform.torch_device
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
fp8 = platform.fp8_dtype or torch.float8_e4m3fn
dims = mm.MLADims.deepseek_v3(num_heads=16)
block_size, batch, seq_len = 64, 3, 200
blocks_per_request = -(-seq_len // block_size)
torch.manual_seed(0)

block_table = torch.arange(batch * blocks_per_request, dtype=torch.int32, device=device).reshape(batch, -1)
seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
# every token of every request: slot = block * block_size + offset
positions = torch.arange(seq_len, device=device)
slots = torch.cat([block_table[b, positions // block_size].long() * block_size + positions % block_size
                   for b in range(batch)])
kv_c = torch.randn(batch * seq_len, dims.kv_lora_rank, device=device, dtype=dtype)
k_pe = torch.randn(batch * seq_len, dims.qk_rope_head_dim, device=device, dtype=dtype)

# The same tokens in a 16/32-bit cache and in an FP8 one; the scale maps the values' range onto FP8's.
shape = (batch * blocks_per_request, block_size, dims.kv_cache_width)
cache = torch.zeros(shape, device=device, dtype=dtype)
fp8_cache = torch.zeros(shape, device=device, dtype=fp8)
k_scale = max(kv_c.abs().max().item(), k_pe.abs().max().item()) / torch.finfo(fp8).max
mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots)
mm.ops.concat_and_cache_mla(kv_c, k_pe, fp8_cache, slots, scale=k_scale)  # quantised: value / k_scale

q_nope = torch.randn(batch, dims.num_heads, dims.kv_lora_rank, device=device, dtype=dtype)
q_pe = torch.randn(batch, dims.num_heads, dims.qk_rope_head_dim, device=device, dtype=dtype)
scale = dims.qk_head_dim**-0.5
out, lse = mm.ops.mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale, return_lse=True)
fp8_out, fp8_lse = mm.ops.mla_decode(q_nope, q_pe, fp8_cache, block_table, seq_lens, scale, k_scale=k_scale,
                                     return_lse=True)
error = ((fp8_out.float() - out.float()).norm() / out.float().norm()).item()
print(f"{fp8} cache ({fp8_cache.element_size()} byte a value, k_scale {k_scale:.3g}): output "
      f"{tuple(fp8_out.shape)}, lse {tuple(fp8_lse.shape)}; rel err against the {dtype} cache {error:.2e}")
assert error < 1e-1, error  # e4m3 keeps 3 mantissa bits: a few per cent

# The layer keeps its cache in FP8 with kv_cache_dtype="fp8" and a per-tensor kv_cache_scale.
weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                     device=device, dtype=dtype) / dims.kv_lora_rank**0.5
layer = mm.MLAAttention(dims, scale, weight, block_size=block_size, max_model_len=1024, max_num_seqs=batch,
                        kv_cache_dtype="fp8", kv_cache_scale=k_scale)
layer_cache = torch.zeros(shape, device=device, dtype=layer.kv_cache_dtype)
metadata = mm.CommonAttentionMetadata.from_lengths([seq_len] * batch, [seq_len] * batch, block_table, block_size)
q = torch.randn(batch * seq_len, dims.num_heads, dims.qk_head_dim, device=device, dtype=dtype)
hidden = layer.forward(q, kv_c, k_pe, layer_cache, metadata)
print(f"MLAAttention with kv_cache_dtype='fp8': cache {layer.kv_cache_dtype}, output {tuple(hidden.shape)}, "
      f"backends {layer.backends()}")
