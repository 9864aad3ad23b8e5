"""An MLA layer inside a model step: plan once per step, then every layer only runs; eager and torch.compile.

Runs as written on the CPU (REFERENCE backend, float32) and on a GPU (the selected backends, bfloat16):

    python examples/layer_in_a_model.py

Shapes (DeepSeek-V3 dims, N heads): q [T, N, 192] (128 nope + 64 rope), kv_c_normed [T, 512],
k_pe [T, 64] (rotary applied), the paged cache [num_blocks, block_size, 576], the layer's output
[T, N * 128], which the model's o_proj takes.
"""

import torch

import mla_multi as mm

device = mm.current_platform().torch_device
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
dims = mm.MLADims.deepseek_v3(num_heads=8)  # 8 heads: one GPU's share at TP16, small enough for a CPU
block_size, num_blocks, max_blocks = 16, 32, 8
torch.manual_seed(0)


class Step(torch.nn.Module):
    """What a model does around the attention: the attention, then o_proj."""

    def __init__(self, layer: mm.MLAAttention, hidden: int) -> None:
        super().__init__()
        self.layer = layer
        self.o_proj = torch.nn.Linear(dims.num_heads * dims.v_head_dim, hidden, bias=False)

    def forward(self, q, kv_c, k_pe, kv_cache, metadata=None):
        return self.o_proj(self.layer.forward(q, kv_c, k_pe, kv_cache, metadata))


# kv_b_proj.weight as checkpoints store it: [N * (128 + 128), 512]
kv_b_proj_weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                               device=device, dtype=dtype) / dims.kv_lora_rank**0.5
layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, kv_b_proj_weight, block_size=block_size,
                        max_model_len=max_blocks * block_size, max_num_seqs=4)
model = Step(layer, hidden=256).to(device, dtype)
print("backends:", layer.backends())

# Each request owns max_blocks blocks; an engine's block manager would hand them out.
block_table = torch.arange(4 * max_blocks, dtype=torch.int32, device=device).reshape(4, max_blocks)
kv_cache = torch.zeros(num_blocks, block_size, dims.kv_cache_width, device=device, dtype=dtype)


def step_inputs(query_lens, seq_lens):
    """The batch's metadata (decodes first) and its new tokens' q, kv_c, k_pe."""
    metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, block_table[: len(query_lens)], block_size)
    tokens = sum(query_lens)
    q = torch.randn(tokens, dims.num_heads, dims.qk_head_dim, device=device, dtype=dtype)
    kv_c = torch.randn(tokens, dims.kv_lora_rank, device=device, dtype=dtype)
    k_pe = torch.randn(tokens, dims.qk_rope_head_dim, device=device, dtype=dtype)
    return metadata, q, kv_c, k_pe


# Three steps of a serving loop: two prefills; two decodes and a new prefill; three decodes.
steps = [([40, 25], [40, 25]), ([1, 1, 30], [41, 26, 30]), ([1, 1, 1], [42, 27, 31])]
eager = []
with torch.inference_mode():
    for query_lens, seq_lens in steps:
        metadata, q, kv_c, k_pe = step_inputs(query_lens, seq_lens)
        layer.plan(metadata)  # once per step, shared by every layer of the model
        hidden = model(q, kv_c, k_pe, kv_cache, metadata)
        eager.append((metadata, q, kv_c, k_pe, hidden))
        print(f"step query_lens={query_lens} seq_lens={seq_lens}: q {tuple(q.shape)} -> hidden {tuple(hidden.shape)}")

# The same steps compiled: the layer is one opaque op that runs the step `plan` made current. On a GPU
# Inductor compiles the rest; on the CPU "aot_eager" traces the same graph without a C++ compiler.
backend = "inductor" if device.type == "cuda" else "aot_eager"
compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
kv_cache.zero_()
with torch.inference_mode():
    for metadata, q, kv_c, k_pe, expected in eager:
        layer.plan(metadata)  # outside the compiled region
        hidden = compiled(q, kv_c, k_pe, kv_cache)
        error = ((hidden.float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error
print(f"torch.compile ({backend}, fullgraph, dynamic) matches the eager steps")
