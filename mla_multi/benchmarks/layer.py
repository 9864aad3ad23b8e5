"""A whole `MLAAttention` step, eager and captured, for every installed backend pair.

    mla-multi bench layer [--heads 128] [--steps decode:64x4096,prefill:16x512+3584,mixed:64x4096+16x512+3584]
    mla-multi bench layer --v4 584 [--heads 64] [--steps ...]

A step is `plan` + `forward` of one layer on DeepSeek-V3 dims (bf16, block size
64). With ``--v4 FORMATS`` ("584", "528" or "528+288": the main cache's bytes a token, + the window
cache's) the layer is a DeepSeek-V4 `MLAAttentionV4`: top-512 of one compressed row per 4 cached tokens,
a 128-token window written by the layer from the step's rows (its cache paged by the step's block
table), a sink, every slot of both caches written with a random row; every token's top-k is a random choice of its
request's compressed rows (`topk_length` the count), and a step writes no compressed rows. Per backend
(decode backend for decode steps, prefill backend for prefill steps, both for mixed ones) it reports:

* metadata µs: the host time of `CommonAttentionMetadata.from_lengths` for the step (median);
* plan µs: the host time of `layer.plan(metadata)` (once per step for all layers; median of 11
  fresh steps);
* eager µs: `triton.testing.do_bench` of `forward` with the step planned outside (it clears L2 with a
  memset before each call, which hides a host path shorter than the memset);
* back to back µs: per call, 50 eager forwards (10 for prefill steps) issued back to back as a model's
  layers are: the larger of the host path and the kernels;
* captured µs: `forward` replayed from a CUDA graph (decode steps only, as
  engines capture them), the workspace locked;
* eager - captured: what the host path adds to a layer.

Step syntax: ``decode:BxS`` (B decodes of S cached tokens), ``prefill:PxQ+C``
(P prefills of Q new tokens after C cached), ``mixed:BxS+PxQ+C``.
"""

from __future__ import annotations

import argparse
import time

import torch

BLOCK_SIZE = 64
DEFAULT_STEPS = "decode:1x8192,decode:64x4096,decode:128x4096,prefill:16x512+3584,mixed:64x4096+16x512+3584"


def parse_step(text: str) -> tuple[str, list[int], list[int]]:
    """(kind, query_lens, seq_lens) of a step written as in the module docstring."""
    kind, _, body = text.partition(":")
    query_lens: list[int] = []
    seq_lens: list[int] = []
    try:
        parts = body.split("+")
        if kind in ("decode", "mixed"):
            b, s = (int(x) for x in parts.pop(0).split("x"))
            query_lens += [1] * b
            seq_lens += [s] * b
        if kind in ("prefill", "mixed"):
            p, q = (int(x) for x in parts[0].split("x"))
            cached = int(parts[1]) if len(parts) > 1 else 0
            query_lens += [q] * p
            seq_lens += [q + cached] * p
    except (ValueError, IndexError):
        kind = ""
    if kind not in ("decode", "prefill", "mixed") or not query_lens:
        raise ValueError(f"step {text!r}; accepted: decode:BxS, prefill:PxQ+C or mixed:BxS+PxQ+C")
    return kind, query_lens, seq_lens


def _back_to_back(step, calls: int, repeats: int = 5) -> float:
    """µs per call of `calls` eager calls issued back to back, as a model's layers are (no cache flush
    between them): the larger of the host path and the kernels; median of `repeats`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


PLAN_REPEATS = 11  # fresh steps planned; the median is reported


def v3_case(text: str, heads: int, decode_backend: str | None, prefill_backend: str | None, device,
            dtype=torch.bfloat16):
    """(layer, metadata(), step(metadata), the step's tensors by name) of a DeepSeek-V3 `MLAAttention` step
    written as in the module docstring: the cache random, the block table a permutation, `step` the layer's
    forward into one output."""
    import mla_multi as mm

    kind, query_lens, seq_lens = parse_step(text)
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = (torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, device=device)
              / dims.kv_lora_rank**0.5).to(dtype)
    max_len = max(seq_lens)
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK_SIZE, max_model_len=max_len,
                            max_num_seqs=max(256, len(seq_lens)), decode_backend=decode_backend,
                            prefill_backend=prefill_backend)
    blocks = -(-max_len // BLOCK_SIZE)
    num_blocks = len(seq_lens) * blocks
    cache = torch.randn(num_blocks, BLOCK_SIZE, dims.kv_cache_width, device=device, dtype=dtype)
    table = torch.randperm(num_blocks, device=device).to(torch.int32).reshape(len(seq_lens), blocks)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dims.qk_head_dim, device=device, dtype=dtype)
    kv_c = torch.randn(tokens, dims.kv_lora_rank, device=device, dtype=dtype)
    k_pe = torch.randn(tokens, dims.qk_rope_head_dim, device=device, dtype=dtype)
    out = torch.empty(tokens, heads * dims.v_head_dim, device=device, dtype=dtype)

    def metadata():
        return mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK_SIZE)

    def step(md):
        return layer.forward(q, kv_c, k_pe, cache, md, output=out)

    return layer, metadata, step, {"q": q, "kv_c": kv_c, "k_pe": k_pe, "kv_cache": cache, "block_table": table}


V4_FORMATS = {"584": ("fp8_ds_mla_v4", None), "528": ("fp8_ds_mla_v41", None),
              "528+288": ("fp8_ds_mla_v41", "fp4_ds_mla_v41")}
V4_TOPK, V4_WINDOW, V4_RATIO = 512, 128, 4  # DeepSeek-V4: top-512 of one compressed row per 4 tokens, 128 recent


def fill_cache(cache: torch.Tensor, kv_format: str, dtype=torch.bfloat16, chunk: int = 1 << 16) -> None:
    """Every slot of a byte-format cache written with a random row of 512 (448 latent + 64 RoPE values) through
    `mla_multi.ops.concat_and_cache_mla_v4`, `chunk` slots a call."""
    import mla_multi as mm

    num_slots = cache.shape[0] * cache.shape[1]
    for first in range(0, num_slots, chunk):
        slots = torch.arange(first, min(num_slots, first + chunk), device=cache.device)
        rows = torch.randn(slots.numel(), 512, device=cache.device, dtype=dtype)
        mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, slots, kv_format=kv_format)


def v4_case(text: str, heads: int, formats: str, decode_backend: str | None, prefill_backend: str | None, device,
            dtype=torch.bfloat16, topk: int = V4_TOPK, window: int = V4_WINDOW):
    """(layer, metadata(), step(metadata), the step's tensors by name) of a DeepSeek-V4 `MLAAttentionV4` step
    (the module docstring)."""
    import mla_multi as mm

    if formats not in V4_FORMATS:
        raise ValueError(f"--v4 {formats!r}; accepted: {', '.join(V4_FORMATS)}")
    kind, query_lens, seq_lens = parse_step(text)
    kv_format, window_kv_format = V4_FORMATS[formats]
    requests, max_len = len(seq_lens), max(seq_lens)
    layer = mm.MLAAttentionV4(heads, 512**-0.5, block_size=BLOCK_SIZE, max_model_len=max_len,
                              max_num_seqs=max(256, requests), topk=topk, window_size=window, kv_format=kv_format,
                              window_kv_format=window_kv_format, dtype=dtype, device=device,
                              decode_backend=decode_backend, prefill_backend=prefill_backend)
    layer.attn_sink.data.copy_(torch.randn(heads) + 2.0)  # a loaded sink
    blocks = -(-max_len // BLOCK_SIZE)
    window_cache = layer.allocate_window_cache(requests * blocks)
    compressed = [max(1, length // V4_RATIO) for length in seq_lens]  # each request's compressed rows
    main_blocks = -(-max(compressed) // BLOCK_SIZE)
    kv_cache = layer.allocate_kv_cache(requests * main_blocks)
    fill_cache(window_cache, window_kv_format or kv_format, dtype)
    fill_cache(kv_cache, kv_format, dtype)
    table = torch.randperm(requests * blocks, device=device).to(torch.int32).reshape(requests, blocks)
    tokens = sum(query_lens)
    indices = torch.full((tokens, topk), -1, dtype=torch.int32, device=device)
    lengths = torch.empty(tokens, dtype=torch.int32, device=device)
    first = 0
    for request, (new, rows) in enumerate(zip(query_lens, compressed)):
        picked = min(topk, rows)  # a random choice of the request's compressed rows, for each of its tokens
        order = torch.rand(new, rows, device=device).argsort(dim=1)[:, :picked]
        indices[first: first + new, :picked] = (request * main_blocks * BLOCK_SIZE + order).to(torch.int32)
        lengths[first: first + new] = picked
        first += new
    q = torch.randn(tokens, heads, 512, device=device, dtype=dtype)
    kv = torch.randn(tokens, 512, device=device, dtype=dtype)
    out = torch.empty(tokens, heads * 512, device=device, dtype=dtype)

    def metadata():
        return mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK_SIZE)

    def step(md):
        return layer.forward(q, kv, kv_cache, window_cache, md, output=out, topk_indices=indices,
                             topk_length=lengths)

    return layer, metadata, step, {"q": q, "kv": kv, "kv_cache": kv_cache, "window_cache": window_cache,
                                   "block_table": table, "topk_indices": indices, "topk_length": lengths}


def bench_step(text: str, heads: int, decode_backend: str | None, prefill_backend: str | None,
               v4: str | None = None) -> dict:
    import triton

    from mla_multi.testing import capture_graph

    kind = parse_step(text)[0]
    device = torch.device("cuda")
    if v4 is None:
        layer, metadata, run, _ = v3_case(text, heads, decode_backend, prefill_backend, device)
    else:
        layer, metadata, run, _ = v4_case(text, heads, v4, decode_backend, prefill_backend, device)
    md = metadata()
    layer.plan(md)  # the first plan of a layer also makes its lazily built state
    times, built = [], []
    for _ in range(PLAN_REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fresh = metadata()
        middle = time.perf_counter()
        layer.plan(fresh)
        end = time.perf_counter()
        built.append((middle - start) * 1e6)
        times.append((end - middle) * 1e6)
    plan_us = sorted(times)[len(times) // 2]
    metadata_us = sorted(built)[len(built) // 2]

    def step():
        return run(md)

    step()
    eager = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3
    back_to_back = _back_to_back(step, 50 if kind == "decode" else 10)
    captured = None
    if kind == "decode":
        md = metadata()
        layer.plan(md, cuda_graph=True)
        shared = v4 is None  # the V4 layer holds no shared workspace (a capture's calls get buffers of their own)
        if shared:
            layer.lock_workspace()
        try:
            graph = capture_graph(step, repeats=10)
            captured = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / 10
        finally:
            if shared:
                layer.workspace.unlock()
    return {"step": text, "heads": heads, "backends": layer.backends(), "metadata_us": metadata_us, "plan_us": plan_us, "eager_us": eager, "back_to_back_us": back_to_back,
            "captured_us": captured}


def backend_names(names: dict) -> tuple[str, str]:
    """(decode, prefill) backend names of a layer's `backends()`: `MLAAttention`'s (its context and short
    prefill backends named where they differ) or `MLAAttentionV4`'s sparse phases."""
    if "sparse_decode_v4" in names:
        return names["sparse_decode_v4"], names["sparse_prefill_v4"]
    prefill_name = names["prefill"]
    if "prefill_context" in names:
        which = "context and short" if "prefill_short" in names else "context"
        prefill_name += f" ({which}: {names['prefill_context']})"
    return names["decode"], prefill_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--steps", default=DEFAULT_STEPS, help="comma list of steps (see above)")
    parser.add_argument("--decode-backends", default="", help="comma list; 'default' (or none given): the registry's choice")
    parser.add_argument("--prefill-backends", default="", help="comma list; 'default' (or none given): the registry's choice")
    parser.add_argument("--v4", choices=sorted(V4_FORMATS), default=None,
                        help="a DeepSeek-V4 layer (MLAAttentionV4) over caches of these bytes a token (main+window)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    for text in steps:
        try:
            parse_step(text)  # bad syntax fails before any GPU work
        except ValueError as error:
            parser.error(str(error))
    if not torch.cuda.is_available():
        from mla_multi.benchmarks import needs_gpu

        return needs_gpu("mla-multi bench layer")
    decode_names = [None if b == "default" else b for b in args.decode_backends.split(",") if b] or [None]
    prefill_names = [None if b == "default" else b for b in args.prefill_backends.split(",") if b] or [None]
    print("| step | decode / prefill backend | metadata µs | plan µs | eager µs | back to back µs | captured µs | "
          "eager - captured |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for text in steps:
        for decode in decode_names:
            for prefill in prefill_names:
                try:
                    row = bench_step(text, args.heads, decode, prefill, args.v4)
                except Exception as error:  # one pair failing must not hide the others
                    print(f"| {text} | {decode} / {prefill} | {type(error).__name__}: {str(error)[:120]} | | | | | |")
                    continue
                captured = row["captured_us"]
                gap = "-" if captured is None else f"{row['eager_us'] - captured:.1f}"
                decode_name, prefill_name = backend_names(row["backends"])
                print(f"| {text} | {decode_name} / {prefill_name} | {row['metadata_us']:.0f} | "
                      f"{row['plan_us']:.0f} | "
                      f"{row['eager_us']:.1f} | {row['back_to_back_us']:.1f} | {'-' if captured is None else f'{captured:.1f}'} | {gap} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
