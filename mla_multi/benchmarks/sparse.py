"""Sparse MLA benchmarks: every installed sparse backend beside FlashMLA itself, on the same inputs.

    mla-multi bench sparse-decode [--cases 128x1x32768,...] [--kv fp8_ds_mla,bf16] [--backends TRITON,FLASHMLA]
    mla-multi bench sparse-prefill [--cases 128x4096x32768,...] [--rounds 3]
    mla-multi bench sparse-decode --format v4 [--cases 128x64x16384x512,...] [--window 128]
    mla-multi bench sparse-prefill --format v4 [--cases 128x4096x32768x2048,...]

``--format v32`` (the default) is DeepSeek-V3.2's contract
(`mm.ops.mla_sparse_decode` / `mla_sparse_prefill`); ``--format v4``
DeepSeek-V4's (`mm.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4`,
d_qk = d_v = 512, a sink per head): decode over the 584-byte
``fp8_ds_mla_v4`` cache in pages of 64, each request's top-k indices beside a
second segment of its last ``--window`` tokens (default 128) in a cache of
their own, with topk_length and extra_topk_length passed (full); prefill over
bf16 rows [S_kv, 512]. A case may name its own topk as a fourth number
(``NxBxSxK``); without it ``--topk`` holds. FLOPs (V4) = 2 * T * N * (512 +
512) * attended tokens (topk + window in decode).

DeepSeek dims (512 latent + 64 rotary), bf16 queries, topk 2048 (``--topk``),
each token's indices random among its request's tokens (decode: a request of
S cached tokens in blocks of 64 scattered over the cache; prefill: rows of
one kv of S_kv rows). A decode case is ``NxBxS`` (heads, requests, cached
tokens each), a prefill case ``NxTxS_kv``.

Per backend (through the package's interface, as `mm.ops` runs it) the time
is device time from a CUDA-graph replay, the inputs rotated over copies whose
working set is larger than L2: every column's graph is replayed in turn
``--rounds`` times (default 3; every other round in reverse order) and the median kept, so that no column owes its
ratio to where in the run the device's clock stood. The eager call (host path
included) is printed beside it. The query is one [T, N, 576] buffer passed as
two slices (as `MLAAttention` passes it). The column "FlashMLA" is FlashMLA's own Python call on the same
inputs (the `sgl-flash-mla` wheel, its sm_90 kernels), where installed: the
peer every ratio is taken against. FLOPs (V3.2) = 2 * T * N * topk * (576 + 512).
Each output is compared with the first column's (relative difference).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from mla_multi.benchmarks import in_turn

KV_LORA_RANK, ROPE_DIM = 512, 64
BLOCK_SIZE = 64
L2_FLUSH_BYTES = 256 * 1024 * 1024
DECODE_CASES = "128x1x32768,128x32x16384,128x64x16384,128x128x8192,64x64x16384"
PREFILL_CASES = "128x4096x32768,128x8192x65536,64x4096x32768"
# DeepSeek-V4: 128 heads top-512, 64 heads top-2048, each beside the 128-token window; prefill top-2048
V4_DECODE_CASES = "128x1x32768x512,128x64x16384x512,128x128x16384x512,64x64x16384x2048,64x128x16384x2048"
V4_PREFILL_CASES = "128x4096x32768x2048,64x4096x32768x2048"
FORMATS = ("v32", "v4")
V4_WIDTH = 512
V4_WINDOW = 128


def _parse_cases(text: str, topk: int | None = None) -> list[tuple[int, ...]]:
    """NxBxS (decode) or NxTxS_kv (prefill), each optionally with its topk as a fourth number: (a, b, c) or,
    with `topk` given, (a, b, c, k), k the case's own or `topk`."""
    cases = []
    for item in text.split(","):
        try:
            numbers = tuple(int(x, 10) for x in item.split("x"))
        except ValueError:
            numbers = ()
        if len(numbers) not in (3, 4) or min(numbers) < 1 or (len(numbers) == 4 and topk is None):
            extra = "[xK]" if topk is not None else ""
            raise ValueError(f"case {item!r}; accepted: NxBxS{extra} (decode) or NxTxS_kv{extra} (prefill) of "
                             f"positive integers, e.g. 128x64x16384" + ("x512" if extra else ""))
        if topk is not None:
            numbers = numbers if len(numbers) == 4 else numbers + (topk,)
        cases.append(numbers)
    return cases


def _graph(fn, copies: int):
    """A CUDA graph of one call on each copy of the inputs."""
    from mla_multi.testing import capture_graph

    return capture_graph(lambda: [fn(i) for i in range(copies)])


def _replay_us(graph, copies: int) -> float:
    """µs per call of a graph of `copies` calls (median of `triton.testing.do_bench`'s 200 ms)."""
    import triton

    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / copies * 1e3


def _eager_us(fn) -> float:
    import triton

    return triton.testing.do_bench(lambda: fn(0), warmup=10, rep=100, return_mode="median") * 1e3


def _flash_mla():
    try:
        import flash_mla

        return flash_mla if flash_mla.has_legacy() else None
    except Exception:  # not installed: no peer column
        return None


def _usable(phase: str, config, wanted) -> tuple[list[str], str | None, dict]:
    from mla_multi import registry

    rows = registry.default_registry.explain(phase, config)
    usable = [r["name"] for r in rows if r["available"] and (r["name"] != "REFERENCE" or "REFERENCE" in (wanted or ()))]
    if wanted:
        usable = [n for n in usable if n in wanted]
    try:
        chosen = registry.default_registry.select(phase, config).name
    except Exception:  # no backend: the table says so
        chosen = None
    return usable, chosen, {r["name"]: r["reasons"] for r in rows if not r["available"]}


def random_fp8_ds_mla_cache(num_blocks: int, device) -> torch.Tensor:
    """An fp8_ds_mla cache [num_blocks, BLOCK_SIZE, 656] of random rows, quantised 64K rows at a time (the
    float32 inputs of a whole cache would not fit beside it)."""
    from mla_multi.ds_mla_cache import quantize_fp8_ds_mla

    cache = torch.empty(num_blocks * BLOCK_SIZE, 656, dtype=torch.uint8, device=device)
    step = 1 << 16
    for start in range(0, cache.shape[0], step):
        stop = min(start + step, cache.shape[0])
        cache[start:stop] = quantize_fp8_ds_mla(torch.randn(stop - start, KV_LORA_RANK, device=device),
                                                torch.randn(stop - start, ROPE_DIM, device=device))
    return cache.view(num_blocks, BLOCK_SIZE, 656)


def bench_decode_case(heads, batch, seq_len, kv, topk, wanted=None, rounds: int = 3) -> dict:
    from mla_multi import ops, registry
    from mla_multi.dims import MLADims
    device = torch.device("cuda")
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    row_bytes = 656 if kv == "fp8_ds_mla" else 2 * (KV_LORA_RANK + ROPE_DIM)
    touched = batch * topk * row_bytes
    copies = max(1, math.ceil(L2_FLUSH_BYTES / max(touched, batch * blocks_per_seq * BLOCK_SIZE * row_bytes)))
    num_blocks = batch * blocks_per_seq * copies
    if kv == "fp8_ds_mla":
        cache = random_fp8_ds_mla_cache(num_blocks, device)
        kv_dtype = torch.uint8
    else:
        cache = torch.randn(num_blocks, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.bfloat16)
        kv_dtype = torch.bfloat16
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    indices = []
    for c in range(copies):
        table = perm[c * batch * blocks_per_seq:(c + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq).long()
        positions = torch.stack([torch.randperm(seq_len, device=device)[:topk] for _ in range(batch)])
        slots = table.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE
        indices.append(slots.to(torch.int32))
    # one [T, N, 576] query buffer, sliced (as `MLAAttention` passes it)
    q = torch.randn(batch, heads, KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.bfloat16)
    q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
    scale = 192**-0.5
    # the call's token count, as `mm.ops.mla_sparse_decode` plans it (a rule may choose by it)
    config = registry.sparse_config(MLADims(heads, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM),
                                    torch.bfloat16, kv_dtype, topk, num_tokens=batch)
    usable, chosen, reasons = _usable("sparse_decode", config, wanted)
    flops = 2 * batch * heads * topk * (KV_LORA_RANK + ROPE_DIM + KV_LORA_RANK)
    row = {"phase": "sparse_decode", "heads": heads, "batch": batch, "seq_len": seq_len, "kv": kv, "topk": topk,
           "copies": copies, "chosen": chosen, "us": {}, "eager_us": {}, "tflop_s": {}, "diff": {}, "errors": {}}
    runs = {name: (lambda i, name=name: ops.mla_sparse_decode(q_nope, q_pe, cache, indices[i], scale, backend=name))
            for name in usable}
    module = _flash_mla()
    if module is not None and kv == "fp8_ds_mla" and heads in (64, 128):
        q = q.unsqueeze(1)
        metas = []
        for i in range(copies):  # the scheduler made once per input, outside the timing (as an engine plans it)
            sched, _ = module.get_mla_metadata()
            module.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, KV_LORA_RANK, sched, softmax_scale=scale,
                                          is_fp8_kvcache=True, indices=indices[i].unsqueeze(1), use_legacy=True)
            metas.append(sched)

        def peer(i):
            return module.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, KV_LORA_RANK, metas[i],
                                                 softmax_scale=scale, is_fp8_kvcache=True,
                                                 indices=indices[i].unsqueeze(1), use_legacy=True)[0].view(batch, heads, -1)

        runs = {"FlashMLA": peer, **runs}
    _measure(row, runs, copies, flops, rounds)
    return row


def bench_prefill_case(heads, tokens, s_kv, topk, wanted=None, rounds: int = 3) -> dict:
    from mla_multi import ops, registry
    from mla_multi.dims import MLADims

    device = torch.device("cuda")
    kv_bytes = s_kv * (KV_LORA_RANK + ROPE_DIM) * 2
    copies = max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes))
    kvs = [torch.randn(s_kv, KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    indices = torch.stack([torch.randperm(s_kv, device=device)[:topk] for _ in range(tokens)]).to(torch.int32)
    q = torch.randn(tokens, heads, KV_LORA_RANK + ROPE_DIM, device=device, dtype=torch.bfloat16)
    q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
    scale = 192**-0.5
    config = registry.sparse_config(MLADims(heads, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM),
                                    torch.bfloat16, torch.bfloat16, topk)
    usable, chosen, reasons = _usable("sparse_prefill", config, wanted)
    flops = 2 * tokens * heads * topk * (KV_LORA_RANK + ROPE_DIM + KV_LORA_RANK)
    row = {"phase": "sparse_prefill", "heads": heads, "batch": tokens, "seq_len": s_kv, "kv": "bf16", "topk": topk,
           "copies": copies, "chosen": chosen, "us": {}, "eager_us": {}, "tflop_s": {}, "diff": {}, "errors": {}}
    runs = {name: (lambda i, name=name: ops.mla_sparse_prefill(q_nope, q_pe, kvs[i], indices, scale, backend=name))
            for name in usable}
    module = _flash_mla()
    if module is not None and heads in (64, 128):

        def peer(i):
            return module.flash_mla_sparse_fwd(q, kvs[i].unsqueeze(1), indices.unsqueeze(1), scale, KV_LORA_RANK,
                                               use_legacy=True)[0]

        runs = {"FlashMLA": peer, **runs}
    _measure(row, runs, copies, flops, rounds)
    return row


def random_v4_cache(num_blocks: int, device) -> torch.Tensor:
    """An fp8_ds_mla_v4 cache [num_blocks, BLOCK_SIZE, 584] (its padded block stride) of random rows written by
    `concat_and_cache_mla_v4`, 64K rows at a time."""
    from mla_multi import cache_formats, ops

    cache = cache_formats.FP8_DS_MLA_V4.allocate(num_blocks, BLOCK_SIZE, device, fill=None)
    step = 1 << 16
    slots = num_blocks * BLOCK_SIZE
    for start in range(0, slots, step):
        stop = min(start + step, slots)
        rows = torch.randn(stop - start, V4_WIDTH, device=device, dtype=torch.bfloat16)
        ops.concat_and_cache_mla_v4(rows[:, :V4_WIDTH - ROPE_DIM], rows[:, V4_WIDTH - ROPE_DIM:], cache,
                                    torch.arange(start, stop, device=device))
    return cache


def _v4_dims(heads: int):
    from mla_multi.dims import MLADims

    return MLADims(heads, kv_lora_rank=V4_WIDTH - ROPE_DIM, qk_rope_head_dim=ROPE_DIM)


def bench_v4_decode_case(heads, batch, seq_len, topk, window=V4_WINDOW, wanted=None, rounds: int = 3,
                         device="cuda") -> dict:
    """DeepSeek-V4's sparse decode: each request's `topk` indices among its `seq_len` tokens in the 584-byte
    cache beside its last `window` tokens in a cache of their own (pages of 64 both), a sink per head."""
    from mla_multi import ops, registry

    device = torch.device(device)
    fmt_bytes = 584
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    window_blocks = -(-window // BLOCK_SIZE)
    touched = batch * (topk + window) * fmt_bytes
    copies = max(1, math.ceil(L2_FLUSH_BYTES / max(touched, batch * blocks_per_seq * BLOCK_SIZE * fmt_bytes)))
    num_blocks = batch * blocks_per_seq * copies
    cache = random_v4_cache(num_blocks, device)
    windows = random_v4_cache(batch * window_blocks * copies, device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    window_perm = torch.randperm(batch * window_blocks * copies, device=device)
    indices, window_indices = [], []
    for c in range(copies):
        table = perm[c * batch * blocks_per_seq:(c + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq).long()
        positions = torch.stack([torch.randperm(seq_len, device=device)[:topk] for _ in range(batch)])
        slots = table.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE
        indices.append(slots.to(torch.int32))
        pages = window_perm[c * batch * window_blocks:(c + 1) * batch * window_blocks].view(batch, window_blocks)
        offsets = torch.arange(window, device=device)
        window_indices.append((pages[:, offsets // BLOCK_SIZE] * BLOCK_SIZE + offsets % BLOCK_SIZE).to(torch.int32))
    q = torch.randn(batch, heads, V4_WIDTH, device=device, dtype=torch.bfloat16)
    sink = torch.randn(heads, device=device)
    lengths = torch.full((batch,), topk, dtype=torch.int32, device=device)
    window_lengths = torch.full((batch,), window, dtype=torch.int32, device=device)
    scale = V4_WIDTH ** -0.5
    config = registry.sparse_config(_v4_dims(heads), torch.bfloat16, torch.uint8, topk + window, num_tokens=batch,
                                    with_lengths=True, kv_format="fp8_ds_mla_v4", extra_kv_format="fp8_ds_mla_v4",
                                    with_sink=True)
    usable, chosen, reasons = _usable("sparse_decode", config, wanted)
    flops = 2 * batch * heads * (V4_WIDTH + V4_WIDTH) * (topk + window)
    row = {"phase": "sparse_decode", "format": "v4", "heads": heads, "batch": batch, "seq_len": seq_len,
           "kv": f"fp8_ds_mla_v4 + window {window}", "topk": topk, "window": window, "copies": copies,
           "chosen": chosen, "us": {}, "eager_us": {}, "tflop_s": {}, "diff": {}, "errors": {}, "reasons": reasons}
    runs = {name: (lambda i, name=name: ops.mla_sparse_decode_v4(
        q, cache, indices[i], scale, topk_length=lengths, attn_sink=sink, extra_kv_cache=windows,
        extra_indices=window_indices[i], extra_topk_length=window_lengths, backend=name)) for name in usable}
    module = _flash_mla()
    # FlashMLA's own call takes index lists of whole tiles of 64 (the package's adapter pads them)
    if module is not None and heads in (64, 128) and topk % 64 == 0 and window % 64 == 0:
        q4 = q.unsqueeze(1)

        def call(i, sched):
            return module.flash_mla_with_kvcache(
                q4, cache.unsqueeze(2), None, None, V4_WIDTH, sched, softmax_scale=scale, is_fp8_kvcache=True,
                indices=indices[i].unsqueeze(1), attn_sink=sink, extra_k_cache=windows.unsqueeze(2),
                extra_indices_in_kvcache=window_indices[i].unsqueeze(1), topk_length=lengths,
                extra_topk_length=window_lengths, use_legacy=True, kv_format="V4")

        metas = []
        for i in range(copies):  # the scheduler made once per input, outside the timing (as an engine plans it)
            sched, _ = module.get_mla_metadata()
            call(i, sched)
            metas.append(sched)
        runs = {"FlashMLA": lambda i: call(i, metas[i])[0].view(batch, heads, -1), **runs}
    _measure(row, runs, copies, flops, rounds)
    return row


def bench_v4_prefill_case(heads, tokens, s_kv, topk, wanted=None, rounds: int = 3, device="cuda") -> dict:
    """DeepSeek-V4's sparse prefill: d_qk = d_v = 512 bf16 rows, a sink per head."""
    from mla_multi import ops, registry

    device = torch.device(device)
    kv_bytes = s_kv * V4_WIDTH * 2
    copies = max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes))
    kvs = [torch.randn(s_kv, V4_WIDTH, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    indices = torch.stack([torch.randperm(s_kv, device=device)[:topk] for _ in range(tokens)]).to(torch.int32)
    q = torch.randn(tokens, heads, V4_WIDTH, device=device, dtype=torch.bfloat16)
    sink = torch.randn(heads, device=device)
    scale = V4_WIDTH ** -0.5
    config = registry.sparse_config(_v4_dims(heads), torch.bfloat16, torch.bfloat16, topk, kv_format="rows",
                                    with_sink=True)
    usable, chosen, reasons = _usable("sparse_prefill", config, wanted)
    flops = 2 * tokens * heads * (V4_WIDTH + V4_WIDTH) * topk
    row = {"phase": "sparse_prefill", "format": "v4", "heads": heads, "batch": tokens, "seq_len": s_kv,
           "kv": "bf16 rows (d 512)", "topk": topk, "copies": copies, "chosen": chosen, "us": {}, "eager_us": {},
           "tflop_s": {}, "diff": {}, "errors": {}, "reasons": reasons}
    runs = {name: (lambda i, name=name: ops.mla_sparse_prefill_v4(q, kvs[i], indices, scale, attn_sink=sink,
                                                                  backend=name)) for name in usable}
    module = _flash_mla()
    if module is not None and heads in (64, 128) and topk % 128 == 0:  # FlashMLA's tile pairs (the adapter pads)

        def peer(i):
            return module.flash_mla_sparse_fwd(q, kvs[i].unsqueeze(1), indices.unsqueeze(1), scale, V4_WIDTH,
                                               attn_sink=sink, use_legacy=True)[0]

        runs = {"FlashMLA": peer, **runs}
    _measure(row, runs, copies, flops, rounds)
    return row


def _measure(row: dict, runs: dict, copies: int, flops: float, rounds: int = 3) -> None:
    """Each column's output against the first, its eager time, and its captured time: every column's graph
    made first, then replayed in turn `rounds` times (every other round in reverse, `in_turn`), the median
    kept (one pass in column order let the device's clock, falling toward its power limit over the run,
    decide ratios of long kernels: 0.86 for one column in one pass, 0.98-1.02 alternated; bench/RESULTS.md)."""
    first = None
    graphs = {}
    for name, run in runs.items():
        try:
            out = run(0).float()
            torch.cuda.synchronize()
            if first is None:
                first = out
            row["diff"][name] = ((out - first).norm() / first.norm()).item()
            row["eager_us"][name] = _eager_us(run)
            graphs[name] = _graph(run, copies)
        except Exception as error:  # one backend failing must not hide the others
            row["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"  {name}: {row['errors'][name]}", flush=True)
    times = {name: [] for name in graphs}
    for index in range(rounds):
        for name in in_turn(list(graphs), index):
            times[name].append(_replay_us(graphs[name], copies))
    for name, values in times.items():
        row["us"][name] = statistics.median(values)
        row["tflop_s"][name] = flops / (row["us"][name] * 1e-6) / 1e12
        row.setdefault("rounds", {})[name] = values
        print(f"  {name}: {row['us'][name]:.1f} µs captured (rounds {', '.join(f'{v:.1f}' for v in values)}), "
              f"{row['eager_us'][name]:.1f} µs eager", flush=True)
    del graphs


def format_rows(rows: list[dict]) -> str:
    """Markdown: µs captured / eager and TFLOP/s per column, the registry's choice starred, ratios to FlashMLA."""
    names = []
    for r in rows:
        names += [n for n in r["us"] if n not in names]
    size = "B x S" if rows and rows[0]["phase"] == "sparse_decode" else "T x S_kv"
    header = (f"| N | {size} | kv | topk | " + " | ".join(f"{n} µs captured / eager (TFLOP/s)" for n in names)
              + " | chosen | chosen / best | each / FlashMLA speed |")
    lines = [header, "|" + "--:|" * (len(names) + 7)]
    for r in rows:
        cells = []
        for n in names:
            us = r["us"].get(n)
            cell = "-" if us is None else f"{us:.1f} / {r['eager_us'][n]:.1f} ({r['tflop_s'][n]:.0f})"
            cells.append(cell + ("*" if n == r["chosen"] else ""))
        ours = {n: v for n, v in r["us"].items() if n != "FlashMLA"}
        best = min(r["us"].values()) if r["us"] else None
        chosen_us = r["us"].get(r["chosen"])
        ratio = f"{best / chosen_us:.2f}" if best and chosen_us else "-"
        peer = r["us"].get("FlashMLA")
        versus = ", ".join(f"{n} {peer / v:.2f}" for n, v in ours.items()) if peer else "-"
        lines.append(f"| {r['heads']} | {r['batch']} x {r['seq_len']} | {r['kv']} | {r['topk']} | " + " | ".join(cells)
                     + f" | {r['chosen']} | {ratio} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, phase: str = "sparse_decode") -> int:
    parser = argparse.ArgumentParser(prog=f"mla-multi bench {phase.replace('_', '-')}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    decode = phase == "sparse_decode"
    parser.add_argument("--format", default="v32", choices=FORMATS,
                        help="the contract: v32 (DeepSeek-V3.2, default) or v4 (DeepSeek-V4: d 512, a sink, "
                             + ("the 584-byte cache and a window segment)" if decode else "bf16 rows)"))
    parser.add_argument("--cases", default=None,
                        help="comma list of NxBxS (decode) or NxTxS_kv (prefill), a fourth number the case's topk "
                             "(default per format: " + (f"{DECODE_CASES}; v4 {V4_DECODE_CASES}" if decode else
                                                        f"{PREFILL_CASES}; v4 {V4_PREFILL_CASES}") + ")")
    parser.add_argument("--topk", type=int, default=2048, help="the topk of cases that name none")
    if decode:
        parser.add_argument("--kv", default=None, help="v32: comma list of fp8_ds_mla, bf16 (default fp8_ds_mla)")
        parser.add_argument("--window", type=int, default=None,
                            help=f"v4: the tokens of the window segment (default {V4_WINDOW})")
    parser.add_argument("--backends", default="", help="comma list of backends (default: every installed one)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="captured times: every column replayed in turn this many times, the median kept")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    v4 = args.format == "v4"
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}; accepted: 1 or more")
    if args.topk < 1:
        parser.error(f"--topk {args.topk}; accepted: 1 or more")
    kinds = ["bf16"]
    window = None
    if decode:
        if v4 and args.kv is not None:
            parser.error(f"--kv {args.kv!r} with --format v4, whose caches are fp8_ds_mla_v4; accepted: --kv "
                         "with --format v32 only")
        if not v4 and args.window is not None:
            parser.error(f"--window {args.window} with --format v32; accepted: --window with --format v4 only")
        window = V4_WINDOW if args.window is None else args.window
        if window < 1:
            parser.error(f"--window {window}; accepted: 1 or more")
        kinds = (args.kv or "fp8_ds_mla").split(",")
        for kv in kinds:
            if kv not in ("fp8_ds_mla", "bf16"):
                parser.error(f"--kv {kv!r}; accepted: fp8_ds_mla, bf16")
    cases_text = args.cases or ((V4_DECODE_CASES if decode else V4_PREFILL_CASES) if v4 else
                                (DECODE_CASES if decode else PREFILL_CASES))
    try:
        cases = _parse_cases(cases_text, args.topk)
    except ValueError as error:
        parser.error(f"--cases: {error}")
    if not torch.cuda.is_available():
        from mla_multi.benchmarks import needs_gpu

        return needs_gpu(f"mla-multi bench {phase.replace('_', '-')}")
    wanted = [b for b in args.backends.split(",") if b] or None
    rows = []
    for a, b, c, k in cases:
        for kv in (["fp8_ds_mla_v4"] if v4 and decode else kinds):
            label = f"kv={kv}" + (f" window={window}" if v4 and decode else "")
            print(f"{phase} ({args.format}) N={a} {'B' if decode else 'T'}={b} {'S' if decode else 'S_kv'}={c} "
                  f"topk={k} {label}", flush=True)
            if v4:
                row = bench_v4_decode_case(a, b, c, k, window, wanted, args.rounds) if decode else \
                    bench_v4_prefill_case(a, b, c, k, wanted, args.rounds)
            else:
                row = bench_decode_case(a, b, c, kv, k, wanted, args.rounds) if decode else bench_prefill_case(
                    a, b, c, k, wanted, args.rounds)
            rows.append(row)
            torch.cuda.empty_cache()  # the case's inputs and graphs, freed on return
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
