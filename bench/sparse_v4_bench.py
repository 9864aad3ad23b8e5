"""DeepSeek-V4 sparse decode and prefill: TRITON beside FlashMLA's own V4 call, CUDA-graph replay.

Decode: a 584-byte ``fp8_ds_mla_v4`` cache in pages of 64, top-k 512 of a 32768-token context and a
128-token window in its own cache of the same format, topk_length and extra_topk_length full, a sink; the
inputs copied enough times to exceed L2 and one graph replays a call on each copy (µs per call, median of
`triton.testing.do_bench`). TRITON reads the caches in place on sm_90; its other way, the rows gathered
first, is timed beside it ("TRITON rows gathered"), and that way's two parts alone: the gathering launch
(`kernels/sparse_v4.gather_rows`) and the rest (dense decode and sink). Prefill: float rows, top-k 2048
and a 128-row window.

    source bench/carried_wheels.sh && python bench/sparse_v4_bench.py [--decode 128x64,128x128,64x64,128x1]
        [--prefill 128x4096x32768]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

L2_FLUSH_BYTES = 256 << 20
BLOCK = 64
TOPK, WINDOW = 512, 128
CONTEXT = 32768


def _flash_mla():
    try:
        import flash_mla

        return flash_mla if flash_mla.has_legacy() else None
    except Exception:  # noqa: BLE001 - a missing wheel is no peer
        return None


def _replay_us(fn, copies: int) -> float:
    import triton

    from mla_multi.testing import capture_graph

    fn(0)
    torch.cuda.synchronize()
    graph = capture_graph(lambda: [fn(i) for i in range(copies)])
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / copies * 1e3


def _v4_cache(blocks: int):
    from mla_multi import cache_formats as cf

    fmt = cf.FP8_DS_MLA_V4
    cache = fmt.allocate(blocks, BLOCK, "cuda", fill=None)
    stride = fmt.block_bytes(BLOCK)
    flat = cache.as_strided((blocks * stride,), (1,))
    # e4m3 codes below 0x7F (no NaN) of either sign, scales 2^-6, bf16 RoPE values of randn
    flat.copy_(torch.randint(0, 0x7F, (blocks * stride,), device="cuda", dtype=torch.uint8))
    flat.bitwise_or_(torch.randint(0, 2, (blocks * stride,), device="cuda", dtype=torch.uint8) << 7)
    view = flat.view(blocks, stride)
    view[:, BLOCK * 576:BLOCK * 576 + BLOCK * 8] = 121
    rope = torch.randn(blocks, BLOCK, 64, device="cuda", dtype=torch.bfloat16).view(torch.uint8)
    view[:, :BLOCK * 576].view(blocks, BLOCK, 576)[:, :, 448:] = rope.reshape(blocks, BLOCK, 128)
    return cache


def bench_decode(heads: int, batch: int, rounds: int = 3, only: tuple[str, ...] = ()) -> dict:
    from mla_multi import ops
    from mla_multi.backends.triton import TritonSparseDecodeImpl
    from mla_multi.kernels import sparse_v4

    blocks_per_seq = CONTEXT // BLOCK
    touched = batch * (TOPK + WINDOW) * 584
    copies = max(1, math.ceil(L2_FLUSH_BYTES / touched))
    copies = min(copies, 64)
    cache = _v4_cache(batch * blocks_per_seq)  # a 32768-token context a request; each copy its own indices
    window_cache = _v4_cache(batch * 2 * copies + 1)
    slots = cache.shape[0] * BLOCK
    q = torch.randn(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    indices = [torch.randint(0, slots, (batch, TOPK), device="cuda", dtype=torch.int32) for _ in range(copies)]
    window = [(torch.arange(batch, device="cuda")[:, None] * 2 * copies + 2 * c) * BLOCK
              + torch.arange(WINDOW, device="cuda")[None, :] for c in range(copies)]
    window = [w.int() for w in window]
    lengths = torch.full((batch,), TOPK, dtype=torch.int32, device="cuda")
    extra_lengths = torch.full((batch,), WINDOW, dtype=torch.int32, device="cuda")
    sink = torch.randn(heads, device="cuda")
    scale = 512 ** -0.5
    row = {"phase": "decode", "heads": heads, "batch": batch, "copies": copies, "us": {}}

    def triton_call(i):
        return ops.mla_sparse_decode_v4(q, cache, indices[i], scale, topk_length=lengths, attn_sink=sink,
                                        extra_kv_cache=window_cache, extra_indices=window[i],
                                        extra_topk_length=extra_lengths, backend="TRITON", return_lse=True)

    runs = {"TRITON": triton_call}
    impl = TritonSparseDecodeImpl(heads, 448, 64, q.device)
    width = TOPK + WINDOW
    table, lens, rows_buf = impl._v4_scratch(q, batch, width, batch * width)

    def gather(i):
        sparse_v4.gather_rows(indices[i], lengths, cache, "fp8_ds_mla_v4", window[i], extra_lengths, window_cache,
                              "fp8_ds_mla_v4", rows=rows_buf, table=table, lens=lens)

    gather(0)

    def dense(i):
        return impl._v4_pages(q, rows_buf.view(-1, 1, 576), table, lens, scale, sink)

    # TRITON with the rows gathered first, where it reads the caches in place: an impl of its own with
    # `read_v4_in_place` off, called directly (the op's plan for the layout keeps the in-place launch it bound)
    gathering = TritonSparseDecodeImpl(heads, 448, 64, q.device)
    gathering.read_v4_in_place = False

    def gathered(i):
        return gathering.forward_v4(q, cache, indices[i], scale, kv_format="fp8_ds_mla_v4", topk_length=lengths,
                                    attn_sink=sink, extra_kv=window_cache, extra_indices=window[i],
                                    extra_topk_length=extra_lengths, extra_kv_format="fp8_ds_mla_v4")

    runs["TRITON rows gathered"] = gathered
    runs["TRITON gather"] = gather
    runs["TRITON dense+sink"] = dense
    module = _flash_mla()
    if module is not None:
        q4 = q.unsqueeze(1)
        metas = []
        for i in range(copies):
            sched, _ = module.get_mla_metadata()
            module.flash_mla_with_kvcache(
                q4, cache.unsqueeze(2), None, None, 512, sched, softmax_scale=scale, is_fp8_kvcache=True,
                indices=indices[i].unsqueeze(1), attn_sink=sink, extra_k_cache=window_cache.unsqueeze(2),
                extra_indices_in_kvcache=window[i].unsqueeze(1), topk_length=lengths, extra_topk_length=extra_lengths,
                use_legacy=True, kv_format="V4")
            metas.append(sched)

        def peer(i):
            return module.flash_mla_with_kvcache(
                q4, cache.unsqueeze(2), None, None, 512, metas[i], softmax_scale=scale, is_fp8_kvcache=True,
                indices=indices[i].unsqueeze(1), attn_sink=sink, extra_k_cache=window_cache.unsqueeze(2),
                extra_indices_in_kvcache=window[i].unsqueeze(1), topk_length=lengths, extra_topk_length=extra_lengths,
                use_legacy=True, kv_format="V4")

        runs = {"FlashMLA": peer, **runs}
        got = triton_call(0)[0].float()
        want = peer(0)[0].view(batch, heads, 512).float()
        row["diff_vs_flashmla"] = float((got - want).norm() / want.norm())
    if only:
        runs = {name: fn for name, fn in runs.items() if name in only}
    for r in range(rounds):
        for name, fn in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
            try:
                us = _replay_us(fn, copies)
            except Exception as error:  # noqa: BLE001 - reported, the others still run
                row.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:300]
                continue
            row["us"][name] = min(us, row["us"].get(name, float("inf")))
    if "FlashMLA" in row["us"] and "TRITON" in row["us"]:
        row["speed_vs_flashmla"] = row["us"]["FlashMLA"] / row["us"]["TRITON"]
    return row


def bench_prefill(heads: int, tokens: int, s_kv: int, rounds: int = 3) -> dict:
    from mla_multi import ops

    topk = 2048
    kv = torch.randn(s_kv, 512, device="cuda", dtype=torch.bfloat16)
    extra_kv = torch.randn(tokens + WINDOW, 512, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(tokens, heads, 512, device="cuda", dtype=torch.bfloat16)
    indices = torch.randint(0, s_kv, (tokens, topk), device="cuda", dtype=torch.int32)
    window = (torch.arange(tokens, device="cuda")[:, None] + torch.arange(WINDOW, device="cuda")[None, :]).int()
    sink = torch.randn(heads, device="cuda")
    scale = 512 ** -0.5
    row = {"phase": "prefill", "heads": heads, "tokens": tokens, "s_kv": s_kv, "us": {}}

    def triton_call(i):
        return ops.mla_sparse_prefill_v4(q, kv, indices, scale, attn_sink=sink, extra_kv=extra_kv,
                                         extra_indices=window, backend="TRITON", return_lse=True)

    runs = {"TRITON": triton_call}
    module = _flash_mla()
    if module is not None:
        # FlashMLA's sparse prefill over one segment: the window's rows appended to kv, its indices offset
        all_kv = torch.cat([kv, extra_kv]).unsqueeze(1)
        all_indices = torch.cat([indices, window + s_kv], dim=1).unsqueeze(1)

        def peer(i):
            return module.flash_mla_sparse_fwd(q, all_kv, all_indices, scale, 512, attn_sink=sink, use_legacy=True)

        try:
            peer(0)
            runs = {"FlashMLA (one segment)": peer, **runs}
        except Exception as error:  # noqa: BLE001
            row["flashmla_error"] = f"{type(error).__name__}: {error}"[:300]
    flops = 2 * tokens * heads * (topk + WINDOW) * 1024
    for r in range(rounds):
        for name, fn in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
            try:
                us = _replay_us(fn, 1)
            except Exception as error:  # noqa: BLE001
                row.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:300]
                continue
            row["us"][name] = min(us, row["us"].get(name, float("inf")))
    row["tflop_s"] = {name: flops / us / 1e6 for name, us in row["us"].items()}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", default="128x64,128x128,64x64,128x32,128x1")
    parser.add_argument("--prefill", default="128x4096x32768")
    parser.add_argument("--runs", default="", help="comma list of the decode runs to time (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        from mla_multi.benchmarks import needs_gpu

        return needs_gpu("bench/sparse_v4_bench.py")
    for item in filter(None, args.decode.split(",")):
        heads, batch = (int(x) for x in item.split("x"))
        only = tuple(filter(None, args.runs.split(",")))
        print(json.dumps(bench_decode(heads, batch, only=only)), flush=True)
    for item in filter(None, args.prefill.split(",")):
        heads, tokens, s_kv = (int(x) for x in item.split("x"))
        print(json.dumps(bench_prefill(heads, tokens, s_kv)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
