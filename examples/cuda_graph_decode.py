"""A decode loop captured once in a CUDA graph and replayed for every step with new lengths.

    python examples/cuda_graph_decode.py

The recipe: plan the step with `cuda_graph=True`, run it once, lock the shared workspace (once, for every
layer of the device), capture, and before each replay copy the step's new lengths and slots into the
captured metadata tensors. On a machine without a CUDA device the same loop runs eagerly and the capture
is skipped, with the reason printed.

Shapes: B decode requests of one token; q [B, N, 192], kv_c [B, 512], k_pe [B, 64], output [B, N * 128].
"""

import torch

import mla_multi as mm

on_gpu = torch.cuda.is_available()
device = mm.current_platform().torch_device
dtype = torch.bfloat16 if on_gpu else torch.float32
dims = mm.MLADims.deepseek_v3(num_heads=16)
batch, block_size, max_blocks = 4, 64, 16  # up to 1024 tokens a request
torch.manual_seed(0)

weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                     device=device, dtype=dtype) / dims.kv_lora_rank**0.5
# TRITON's decode reads the lengths on the device, so a replay needs nothing but the copied lengths; a
# backend that plans on the host (FLASHINFER) would also be re-planned before each replay.
layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=block_size,
                        max_model_len=max_blocks * block_size, max_num_seqs=batch,
                        decode_backend="TRITON" if on_gpu else None)
print("backends:", layer.backends())
block_table = torch.arange(batch * max_blocks, dtype=torch.int32, device=device).reshape(batch, max_blocks)
kv_cache = torch.randn(batch * max_blocks, block_size, dims.kv_cache_width, device=device, dtype=dtype)

# The captured step's inputs live in fixed buffers: each step writes its new tokens into them.
q = torch.empty(batch, dims.num_heads, dims.qk_head_dim, device=device, dtype=dtype)
kv_c = torch.empty(batch, dims.kv_lora_rank, device=device, dtype=dtype)
k_pe = torch.empty(batch, dims.qk_rope_head_dim, device=device, dtype=dtype)
out = torch.empty(batch, dims.num_heads * dims.v_head_dim, device=device, dtype=dtype)


def metadata_for(seq_lens):
    return mm.CommonAttentionMetadata.from_lengths([1] * batch, seq_lens, block_table, block_size)


seq_lens = [300, 17, 900, 512]
captured = metadata_for(seq_lens)  # the tensors the graph reads
graph = None
if on_gpu:
    layer.plan(captured, cuda_graph=True)
    layer.forward(q.normal_(), kv_c.normal_(), k_pe.normal_(), kv_cache, captured, output=out)  # warm-up
    layer.lock_workspace()  # nothing may grow the shared workspace once a graph holds its address
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward(q, kv_c, k_pe, kv_cache, captured, output=out)
else:
    print("CUDA graph capture skipped: no CUDA device is visible to torch; the steps run eagerly")

for step in range(4):
    seq_lens = [length + 1 for length in seq_lens]
    fresh = metadata_for(seq_lens)
    q.normal_(), kv_c.normal_(), k_pe.normal_()
    expected = layer.forward(q, kv_c, k_pe, kv_cache.clone(), fresh)  # eager, on a copy of the cache
    if graph is not None:
        captured.seq_lens.copy_(fresh.seq_lens)  # the new lengths ...
        captured.slot_mapping.copy_(fresh.slot_mapping)  # ... and the slots of the new tokens
        graph.replay()
        result = out
    else:
        result = layer.forward(q, kv_c, k_pe, kv_cache, fresh, output=out)
    error = ((result.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error
    print(f"step {step}: seq_lens {seq_lens} -> output {tuple(result.shape)}, "
          f"{'replayed' if graph is not None else 'eager'}, rel err against eager {error:.1e}")
if graph is not None:
    layer.workspace.unlock()
