"""A DeepSeek-V4 attention layer (`mla_multi.MLAAttentionV4`) through a prefill and decode steps.

    python examples/deepseek_v4_layer.py

Per layer: a main cache of compressed rows (here a stand-in compressor writes the mean of every 4 tokens'
rows) of which each token attends to its top-k (here every compressed row before it: a short context, where
DeepSeek-V4's indexer selects them all), a 128-token window of the newest tokens in a cache of its own, and
an attention sink per head. The layer writes the window rows itself; the compressed rows reach the main cache
through `compressed_kv`. Its output is each head's 512-wide attended rows, which the model projects (inverse
RoPE, wo_a, wo_b). The last decode token is checked against float64 attention written out here.

Shapes: q [T, N, 512], kv [T, 512], output [T, N * 512].
"""

import torch

import mla_multi as mm
from mla_multi import cache_formats

on_gpu = torch.cuda.is_available()
device = mm.current_platform().torch_device
dtype = torch.bfloat16 if on_gpu else torch.float32
heads, block_size, ratio, topk, window = 16, 64, 4, 512, 128
torch.manual_seed(0)

layer = mm.MLAAttentionV4(heads, 512**-0.5, block_size=block_size, max_model_len=4096, max_num_seqs=4,
                          topk=topk, window_size=window, kv_format="fp8_ds_mla_v4", dtype=dtype, device=device)
layer.load_state_dict({"attn_sink": torch.randn(heads, device=device)})  # the checkpoint's sink
print(layer)
kv_cache = layer.allocate_kv_cache(64)        # compressed rows: slot = block * 64 + offset
window_cache = layer.allocate_window_cache(64)
block_table = torch.arange(2 * 32, dtype=torch.int32, device=device).reshape(2, 32)  # 2 requests
history = {0: torch.empty(0, 512, device=device, dtype=dtype), 1: torch.empty(0, 512, device=device, dtype=dtype)}
compressed_slots = {0: [], 1: []}  # request -> main-cache slots of its compressed rows (request r owns blocks 32r..)


def step(new_tokens):
    """One step: new_tokens[r] tokens of request r (1 = decode). Returns (q, output, per-token topk slots)."""
    lengths = [history[r].shape[0] + n for r, n in enumerate(new_tokens)]
    metadata = mm.CommonAttentionMetadata.from_lengths(new_tokens, lengths, block_table, block_size)
    tokens = metadata.num_actual_tokens
    q = torch.randn(tokens, heads, 512, device=device, dtype=dtype)
    kv = torch.randn(tokens, 512, device=device, dtype=dtype)
    rows, slots, offset = [], [], 0
    for r, n in enumerate(new_tokens):
        history[r] = torch.cat([history[r], kv[offset: offset + n]])
        offset += n
        while len(compressed_slots[r]) < history[r].shape[0] // ratio:  # the stand-in compressor
            c = len(compressed_slots[r])
            rows.append(history[r][c * ratio: (c + 1) * ratio].float().mean(0).to(dtype))
            compressed_slots[r].append(r * 32 * 64 + c)
            slots.append(compressed_slots[r][-1])
    # each token's top-k: every compressed row complete at its position (as slots of kv_cache), -1 after
    picks = torch.full((tokens, topk), -1, dtype=torch.int32)
    t = 0
    for r, n in enumerate(new_tokens):
        for p in range(lengths[r] - n, lengths[r]):
            visible = compressed_slots[r][: (p + 1) // ratio][:topk]
            picks[t, : len(visible)] = torch.tensor(visible, dtype=torch.int32)
            t += 1
    layer.plan(metadata)  # once per step, for every layer
    with torch.inference_mode():
        out = layer(q, kv, kv_cache, window_cache, metadata, topk_indices=picks.to(device),
                    compressed_kv=torch.stack(rows) if rows else None,
                    compressed_slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device) if rows else None)
    return q, out, picks


q, out, _ = step([300, 45])
print(f"prefill: {q.shape[0]} tokens -> output {tuple(out.shape)}")
for index in range(3):
    q, out, picks = step([1, 1])
    print(f"decode {index}: output {tuple(out.shape)}, finite: {bool(torch.isfinite(out).all())}")

# float64 check of the last token (request 1): its top-k rows and its window rows, dequantised, one softmax, the sink
fmt = cache_formats.get_format("fp8_ds_mla_v4")
main_cpu = torch.empty_strided(kv_cache.shape, kv_cache.stride(), dtype=torch.uint8).copy_(kv_cache)
window_cpu = torch.empty_strided(window_cache.shape, window_cache.stride(), dtype=torch.uint8).copy_(window_cache)
position = history[1].shape[0] - 1
window_slots = [int(block_table[1, p // block_size]) * block_size + p % block_size
                for p in range(max(0, position - window + 1), position + 1)]
rows = torch.cat([fmt.read_rows(main_cpu, torch.float64, picks[-1][picks[-1] >= 0].long()),
                  fmt.read_rows(window_cpu, torch.float64, torch.tensor(window_slots))])
scores = q[-1].double().cpu() @ rows.T * layer.scale
lse = torch.logsumexp(scores, dim=1, keepdim=True)
expected = torch.softmax(scores, dim=1) @ rows * torch.sigmoid(lse - layer.attn_sink.double().cpu().unsqueeze(1))
error = ((out[-1].double().cpu().view(heads, 512) - expected).norm() / expected.norm()).item()
print(f"last token against float64: relative error {error:.2e}")
assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error
