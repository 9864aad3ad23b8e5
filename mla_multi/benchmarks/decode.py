"""Decode benchmark of the Triton split-KV MLA kernel, against the device's own ceilings.

DeepSeek-V3 shapes (kv_lora_rank 512, rope 64), block size 64, bf16 cache by
default.  In the same run it measures the device's HBM rate (a large
device-to-device copy, bytes read + written over time) and its bf16 matmul
rate (8192^3), then prints per case the time (median of
``triton.testing.do_bench``), the KV read rate (B * S * 576 * elem bytes, the
floor: every cache row read once) and the FLOP rate (2 * B * N * S * (576 + 512)),
each also as a percentage of the measured ceiling.  The time is device time:
the calls are captured in a CUDA graph and the graph replayed (the eager time,
host launch path included, is printed beside it).  Small cases rotate through
several caches (one captured call each) so that the timed working set is
larger than L2.

    mla-multi bench decode (or PYTHONPATH=. python3 -m mla_multi bench decode) [--heads 16,128] [--cases 32x4096,...]
        [--configs h16n64w4s2,h32n32w8s2] [--json out.json]

With ``--backends all`` it times every decode backend installed on the machine
instead (TRITON, FLASHINFER, CUDA_FLASH_ATTN, ROCM_AITER: whichever can run the
configuration), each through the package's own interface on the same inputs,
one column per backend with the registry's choice starred; ``--q-len 1,2,4``
adds multi-token decode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch

DEFAULT_CASES = "1x32768,32x4096,64x8192,128x4096,128x16384"
KV_LORA_RANK, ROPE_DIM = 512, 64
L2_FLUSH_BYTES = 256 * 1024 * 1024


def measure_ceilings() -> dict[str, float]:
    """HBM rate (TB/s, bytes read + written by a 4 GiB copy) and bf16 matmul rate (TFLOP/s)."""
    import triton

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    hbm = 2 * src.numel() / (copy_ms * 1e-3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    mma = 2 * 8192**3 / (mm_ms * 1e-3) / 1e12
    return {"hbm_tb_s": hbm, "bf16_tflop_s": mma}


def parse_config(text: str):
    """'h16n64w4s2' -> DecodeLaunchConfig(block_h=16, block_n=64, num_warps=4, num_stages=2)."""
    import re

    from mla_multi.kernels.launch_config import DECODE_KERNEL_SUFFIXES, DecodeLaunchConfig

    kernels = {suffix: kernel for kernel, suffix in DECODE_KERNEL_SUFFIXES.items()}
    match = re.fullmatch(rf"h(\d+)n(\d+)w(\d+)s(\d+)(nolicm)?(tm)?({'|'.join(kernels)})?(?:f(\d+))?(t)?", text)
    if not match:
        raise ValueError(
            f"config {text!r}; accepted: like h16n64w4s2 (BLOCK_H, BLOCK_N, warps, stages), optionally "
            "followed by nolicm (nothing hoisted out of the tile loop), tm (Triton kernel: the cache tokens as the matrix op's M) or ws / rm (the sm_90 warp-specialised kernel, the cache tokens or the query rows as M), then fN after ws / rm (FP8 QK products from N raw FP8 stages), then t after ws / rm (whole tiles by TMA: 16-bit ones, or FP8 bytes into the fN raw stages)"
        )
    return DecodeLaunchConfig(
        *map(int, match.groups()[:4]),
        disable_licm=bool(match.group(5)),
        tokens_as_m=bool(match.group(6)),
        kernel=kernels.get(match.group(7), "triton"),
        raw_stages=int(match.group(8) or 0),
        tma=bool(match.group(9)),
    )


def kernel_times_us(fn, iterations: int = 20) -> dict[str, float]:
    """Mean device time per call of each kernel `fn` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key.startswith("_mla"):
            times[event.key] = device_us / iterations
    return times


def bench_case(batch, seq_len, heads, block_size, cache_dtype, config=None, splits=None, ceilings=None,
               kernel_times=False):
    import triton

    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
    from mla_multi.kernels.launch_config import decode_config
    from mla_multi.kernels import capturing
    from mla_multi.kernels.mla_decode import DecodeKernelPlan, attn_logits_width
    from mla_multi.platforms import current_platform

    platform = current_platform()
    elem = torch.empty((), dtype=cache_dtype).element_size()
    blocks_per_seq = -(-seq_len // block_size)
    cache_bytes = batch * blocks_per_seq * block_size * (KV_LORA_RANK + ROPE_DIM) * elem
    copies = max(1, math.ceil(L2_FLUSH_BYTES / cache_bytes))
    num_blocks = batch * blocks_per_seq * copies
    cache = torch.randn(num_blocks, block_size, KV_LORA_RANK + ROPE_DIM, device="cuda").to(cache_dtype)
    k_scale = torch.tensor([0.05], device="cuda") if elem == 1 else None
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = [
        perm[i * batch * blocks_per_seq : (i + 1) * batch * blocks_per_seq].reshape(batch, blocks_per_seq)
        for i in range(copies)
    ]
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(batch, heads, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_nope)
    lse = torch.empty(batch, heads, device="cuda", dtype=torch.float32)
    reserved = max_num_kv_splits(seq_len, platform)
    if splits is None:
        splits = num_kv_splits(platform, batch, heads, seq_len, reserved, kv_cache_dtype=cache_dtype)
    reserved = max(reserved, splits)
    attn_logits = torch.empty(batch, heads, reserved, attn_logits_width(KV_LORA_RANK), device="cuda",
                              dtype=torch.float32)
    config = config or decode_config(platform, heads, 1, cache_dtype)
    state = {"i": 0}

    kernels = {}  # capturing or not -> the kernels bound once (a captured launch may take TMA)

    def call(table):
        plan = kernels.get(capturing(q_nope))
        if plan is None:
            plan = kernels[capturing(q_nope)] = DecodeKernelPlan(
                q_nope, q_pe, cache, table, seq_lens, k_scale, splits, attn_logits, out, lse, config=config
            )
        plan.launch(q_nope, q_pe, cache, table, seq_lens, k_scale, attn_logits, out, lse, 576**-0.5)

    def run():
        call(block_tables[state["i"] % copies])
        state["i"] += 1

    def run_all():
        for table in block_tables:
            call(table)

    run_all()
    torch.cuda.synchronize()
    # Device time through a CUDA graph (as a serving engine runs decode): the
    # Python launch path (input checks, two Triton launches) costs tens of µs
    # on the host and would otherwise be what an eager loop measures.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    ms = triton.testing.do_bench(graph.replay, warmup=100, rep=300, return_mode="median") / copies
    eager_ms = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
    kv_bytes = batch * seq_len * (KV_LORA_RANK + ROPE_DIM) * elem
    flops = 2 * batch * heads * seq_len * (KV_LORA_RANK + ROPE_DIM + KV_LORA_RANK)
    row = {
        "heads": heads,
        "batch": batch,
        "seq_len": seq_len,
        "kv": str(cache_dtype).replace("torch.", ""),
        "config": config.name,
        "splits": splits,
        "us": ms * 1e3,
        "eager_us": eager_ms * 1e3,
        "tb_s": kv_bytes / (ms * 1e-3) / 1e12,
        "tflop_s": flops / (ms * 1e-3) / 1e12,
    }
    if kernel_times:
        row["kernel_us"] = kernel_times_us(run)
        print(f"  kernels: {row['kernel_us']}", flush=True)
    if ceilings:
        row["hbm_pct"] = 100 * row["tb_s"] / ceilings["hbm_tb_s"]
        row["mma_pct"] = 100 * row["tflop_s"] / ceilings["bf16_tflop_s"]
    del cache
    torch.cuda.empty_cache()
    return row


_PLAN_SLOTS = itertools.count(0, 1 << 16)

# Backends whose decode runs inside a CUDA graph; REFERENCE reads lengths on the host.
GRAPHABLE_EXCLUDED = ("REFERENCE",)


def installed_decode_backends(config) -> tuple[list[str], str | None, dict[str, list[str]]]:
    """(backends that can run `config` here, the registry's choice for it (for its `num_tokens` where the
    config was planned with one), reasons of the others)."""
    from mla_multi import registry

    rows = registry.default_registry.explain("decode", config)
    usable = [r["name"] for r in rows if r["available"] and r["name"] not in GRAPHABLE_EXCLUDED]
    try:
        chosen = registry.default_registry.select("decode", config).name
    except Exception:  # no backend at all: the table says so
        chosen = None
    return usable, chosen, {r["name"]: r["reasons"] for r in rows if not r["available"]}


def bench_backends_case(batch, seq_len, heads, block_size, cache_dtype, q_len=1, backends=None):
    """Every installed decode backend on the same inputs, each timed by CUDA-graph replay over > L2 of caches.

    Returns {"heads", "batch", "seq_len", "q_len", "kv", "us": {backend: µs}, "chosen", "diff": {backend:
    relative difference of its output to the first backend's}, "tflop_s": {backend: ...}}.
    """
    import triton

    from mla_multi import registry
    from mla_multi.dims import MLADims
    from mla_multi.workspace import WorkspaceManager

    dims = MLADims.deepseek_v3(num_heads=heads)
    # planned with its batch, as `ops.mla_decode` and the layer's step plan it: "chosen" is the registry's
    # choice at this batch (a rule may depend on it)
    config = registry.decode_config(dims, torch.bfloat16, cache_dtype, block_size, q_len, num_tokens=batch * q_len)
    usable, chosen, _ = installed_decode_backends(config)
    if backends:
        usable = [b for b in usable if b in backends]
    elem = torch.empty((), dtype=cache_dtype).element_size()
    blocks_per_seq = -(-seq_len // block_size)
    cache_bytes = batch * blocks_per_seq * block_size * (KV_LORA_RANK + ROPE_DIM) * elem
    copies = max(1, math.ceil(L2_FLUSH_BYTES / cache_bytes))
    num_blocks = batch * blocks_per_seq * copies
    cache = torch.randn(num_blocks, block_size, KV_LORA_RANK + ROPE_DIM, device="cuda")
    k_scale = None
    if elem == 1:
        k_scale = torch.tensor([0.05], device="cuda")
        cache = (cache / 0.05).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = [perm[i * batch * blocks_per_seq : (i + 1) * batch * blocks_per_seq].reshape(batch, blocks_per_seq)
              for i in range(copies)]
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    shape = (batch, heads) if q_len == 1 else (batch, q_len, heads)
    q_nope = torch.randn(*shape, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(*shape, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
    scale = 192**-0.5
    flops = 2 * batch * q_len * heads * seq_len * (KV_LORA_RANK + ROPE_DIM + KV_LORA_RANK)
    row = {"heads": heads, "batch": batch, "seq_len": seq_len, "q_len": q_len,
           "kv": str(cache_dtype).replace("torch.", ""), "chosen": chosen, "us": {}, "tflop_s": {}, "diff": {},
           "copies": copies}
    first_out = None
    for name in usable:
        try:
            backend = registry.default_registry.load("decode", name)
            impl = backend.get_decode_impl_cls()(heads, scale, KV_LORA_RANK, ROPE_DIM, cache_dtype, block_size,
                                                 torch.device("cuda"))
            workspace = WorkspaceManager("cuda")
            impl.reserve_workspace(workspace, batch, blocks_per_seq * block_size, q_len)
            plans = [None] * copies
            if getattr(backend, "requires_plan", False):
                # CUDA-graph plans keep fixed buffers sized by their first batch: a
                # fresh slot per case, as an engine reserves one per captured shape
                base = next(_PLAN_SLOTS)
                plans = [impl.plan(seq_lens.cpu(), table, q_len, k_scale=k_scale, cuda_graph=True, slot=base + i)
                         for i, table in enumerate(tables)]
            outs = []
            # each copy's decode bound once (`MLADecodeImpl.bind`), as the layer's step binds it
            launches = [impl.bind(q_nope, q_pe, cache, table, seq_lens, k_scale=k_scale, max_seq_len=seq_len,
                                  **({} if plan is None else {"plan": plan}))
                        for table, plan in zip(tables, plans)]

            def run_all(launches=launches, workspace=workspace, outs=outs):
                for table, launch in zip(tables, launches):
                    out = launch(q_nope, q_pe, cache, table, seq_lens, scale, k_scale=k_scale,
                                 workspace_manager=workspace)[0]
                    if not outs:  # the first copy's output, before a workspace reuse overwrites it
                        outs.append(out.float().clone())

            run_all()
            torch.cuda.synchronize()
            out0 = outs[0]
            if first_out is None:
                first_out = out0
            row["diff"][name] = ((out0 - first_out).norm() / first_out.norm()).item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            ms = triton.testing.do_bench(graph.replay, warmup=50, rep=200, return_mode="median") / copies
            row["us"][name] = ms * 1e3
            row["tflop_s"][name] = flops / (ms * 1e-3) / 1e12
            del graph
            # the eager call as an engine makes it (the plan made outside, the host path included)
            eager = triton.testing.do_bench(
                lambda: launches[0](q_nope, q_pe, cache, tables[0], seq_lens, scale, k_scale=k_scale,
                                    workspace_manager=workspace),
                warmup=25, rep=100, return_mode="median")
            row.setdefault("eager_us", {})[name] = eager * 1e3
        except Exception as error:  # one backend failing must not hide the others
            row.setdefault("errors", {})[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    del cache
    torch.cuda.empty_cache()
    return row


def format_backend_rows(rows) -> str:
    """Markdown: one column per backend (captured µs / eager µs), the registry's choice starred, chosen / best
    speed (captured)."""
    names = sorted({n for r in rows for n in r["us"]})
    header = ("| N | B x S | Q | kv | " + " | ".join(f"{n} µs captured / eager" for n in names)
              + " | chosen | chosen / best speed |")
    lines = [header, "|" + "--:|" * (len(names) + 6)]
    for r in rows:
        best = min(r["us"].values()) if r["us"] else float("nan")
        cells = []
        for n in names:
            value = r["us"].get(n)
            eager = r.get("eager_us", {}).get(n)
            text = "-" if value is None else f"{value:.1f}" + ("" if eager is None else f" / {eager:.1f}")
            cells.append(text + ("*" if n == r["chosen"] else ""))
        chosen_us = r["us"].get(r["chosen"])
        ratio = f"{best / chosen_us:.2f}" if chosen_us else "-"
        lines.append(f"| {r['heads']} | {r['batch']} x {r['seq_len']} | {r['q_len']} | {r['kv']} | "
                     + " | ".join(cells) + f" | {r['chosen']} | {ratio} |")
    return "\n".join(lines)


def format_rows(rows) -> str:
    header = (f"{'N':>4} {'B':>4} {'S':>6} {'kv':>14} {'config':>12} {'splits':>6} {'us':>9} {'TB/s':>6} {'%HBM':>5} "
              f"{'TFLOP/s':>8} {'%MMA':>5} {'eager us':>9}")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['heads']:>4} {r['batch']:>4} {r['seq_len']:>6} {r['kv']:>14} {r['config']:>12} {r['splits']:>6} "
            f"{r['us']:>9.1f} {r['tb_s']:>6.2f} {r.get('hbm_pct', 0):>5.1f} {r['tflop_s']:>8.1f} {r.get('mma_pct', 0):>5.1f}"
            f" {r['eager_us']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma list of BxS")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--kv-dtype", default="bfloat16", help="comma list of bfloat16 | float8_e4m3fn | "
                        "float8_e4m3fnuz (several: measured in one process, each case in each dtype)")
    parser.add_argument("--configs", default="", help="comma list like h16n64w4s2 (default: the package's choice)")
    parser.add_argument("--splits", default="", help="comma list of fixed num_kv_splits (default: heuristic)")
    parser.add_argument("--reduce", default="", help="merge config as BLOCK_DV,BLOCK_SPLITS,WARPS (default: the package's)")
    parser.add_argument("--kernel-times", action="store_true", help="also print per-kernel device times (profiler)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--backends", default="", help="'all': every installed decode backend through the package's "
                        "interface, one column each (or a comma list of names); default: the Triton kernel alone")
    parser.add_argument("--q-len", default="1", help="comma list of query tokens per request (with --backends)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        from mla_multi.benchmarks import needs_gpu

        return needs_gpu("mla-multi bench decode")
    if args.reduce:
        from mla_multi.kernels import mla_decode
        from mla_multi.kernels.launch_config import DecodeReduceLaunchConfig

        block_dv, block_splits, warps = map(int, args.reduce.split(","))
        forced = DecodeReduceLaunchConfig(block_dv=block_dv, block_splits=block_splits, num_warps=warps)
        mla_decode.decode_reduce_config = lambda *args, **kwargs: forced
    ceilings = None if args.no_ceilings else measure_ceilings()
    if ceilings:
        print(f"device: {torch.cuda.get_device_name()}  HBM copy {ceilings['hbm_tb_s']:.2f} TB/s  "
              f"bf16 matmul {ceilings['bf16_tflop_s']:.0f} TFLOP/s", flush=True)
    cache_dtypes = [getattr(torch, name) for name in args.kv_dtype.split(",") if name]
    if args.backends:
        chosen_backends = None if args.backends == "all" else args.backends.upper().split(",")
        backend_rows = []
        for heads in [int(h) for h in args.heads.split(",")]:
            for q_len in [int(q) for q in args.q_len.split(",")]:
                for case, cache_dtype in [(c, d) for c in args.cases.split(",") for d in cache_dtypes]:
                    batch, seq_len = map(int, case.lower().split("x"))
                    row = bench_backends_case(batch, seq_len, heads, args.block_size, cache_dtype, q_len,
                                              chosen_backends)
                    backend_rows.append(row)
                    print(format_backend_rows([row]).splitlines()[-1]
                          + (f"  diff {row['diff']}" if row["diff"] else "")
                          + (f"  errors {row['errors']}" if row.get("errors") else ""), flush=True)
        print(format_backend_rows(backend_rows))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": backend_rows},
                          handle, indent=1)
        return 0
    configs = [parse_config(c) for c in args.configs.split(",") if c] or [None]
    split_choices = [int(s) for s in args.splits.split(",") if s] or [None]
    rows = []
    for heads in [int(h) for h in args.heads.split(",")]:
        for case in args.cases.split(","):
            batch, seq_len = map(int, case.lower().split("x"))
            for cache_dtype, config, splits in [(d, c, s) for d in cache_dtypes for c in configs for s in split_choices]:
                try:
                    row = bench_case(batch, seq_len, heads, args.block_size, cache_dtype, config, splits, ceilings,
                                     kernel_times=args.kernel_times)
                except Exception as error:  # one failing config must not hide the others
                    print(f"N={heads} B={batch} S={seq_len} config={config}: {type(error).__name__}: {error}",
                          flush=True)
                    continue
                rows.append(row)
                print(format_rows([row]).splitlines()[1], flush=True)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
