"""Decode context parallelism benchmark: DeepSeek-V3 decode on one GPU against DCP over several.

    mla-multi bench dcp [--cases 8x32768,32x32768,8x131072,32x131072] [--heads 128] [--world-sizes 1,2]
        [--block-size 64] [--interleave 1] [--backend TRITON] [--iterations 50] [--json out.json]

It starts its own processes, one per GPU (`torch.multiprocessing`, a
FileStore rendezvous, NCCL): run it as a plain command, not under torchrun.
``--device cpu`` runs the same code over gloo on the CPU (no graphs, the
REFERENCE backend) to check the plumbing.

Per case (B requests of S tokens, N heads of the layer in total, bf16 cache)
and world size w:
* w = 1: `ops.mla_decode` of the N heads over the whole cache on one GPU;
* w > 1: `DecodeContextParallel.mla_decode` on each of w GPUs, N / w heads per
  rank and the rank's share of the tokens in its cache.
Reported: the step time; the local decode alone (all N heads over the local
tokens); the collectives alone (the query all-gather, the LSE all-gather and
the output reduce-scatter of the step, same sizes); the cache bytes per GPU.

Timing: each measured call is captured in a CUDA graph and the replay timed
with the method of `triton.testing.do_bench` (L2 flushed before each replay,
CUDA events around it, the median), but with the repetition count fixed and
the same on every rank: do_bench picks its count from a per-rank estimate, and
ranks that disagree would desynchronise the collectives. Before each replay a
one-element all-reduce lines the ranks' streams up, so that one rank's
launch delay is not timed as another's wait. The reported time of w > 1 is
the slowest rank's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

DEFAULT_CASES = "8x32768,32x32768,8x131072,32x131072"
KV_LORA_RANK, ROPE_DIM = 512, 64
L2_FLUSH_BYTES = 256 * 1024 * 1024


def time_ms(fn, iterations: int, device: torch.device, align=None, warmup: int = 5) -> float:
    """Median time of `fn` in ms over a fixed number of calls (see the module docstring)."""
    for _ in range(warmup):
        if align is not None:
            align()
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iterations):
            if align is not None:
                align()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
    torch.cuda.synchronize()
    for i in range(iterations):
        flush.zero_()
        if align is not None:
            align()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def captured(fn, device: torch.device):
    """`fn` as a replayable CUDA graph on GPUs (after an eager warm-up), `fn` itself on the CPU."""
    fn()
    if device.type != "cuda":
        return fn
    torch.cuda.synchronize()
    from mla_multi.testing import capture_graph

    # Thread-local capture: the process group's watchdog thread may query events of
    # earlier collectives while this thread captures.
    graph = capture_graph(fn, capture_error_mode="thread_local")
    torch.cuda.synchronize()
    return graph.replay


def random_cache(batch: int, tokens: int, block_size: int, device: torch.device, generator):
    """A bf16 paged cache holding `tokens` rows for each of `batch` requests, blocks in shuffled order."""
    blocks_per_request = max(1, -(-tokens // block_size))
    num_blocks = batch * blocks_per_request
    cache = torch.empty(num_blocks, block_size, KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16, device=device)
    cache.normal_(generator=generator)
    order = torch.randperm(num_blocks, device=device, generator=generator).to(torch.int32)
    return cache, order.view(batch, blocks_per_request)


def bench_single(batch, seq_len, heads, block_size, backend, iterations, device) -> dict:
    """One GPU: N heads over the whole cache."""
    from mla_multi import ops

    generator = torch.Generator(device=device).manual_seed(0)
    cache, table = random_cache(batch, seq_len, block_size, device, generator)
    q_nope = torch.randn(batch, heads, KV_LORA_RANK, device=device, generator=generator).bfloat16()
    q_pe = torch.randn(batch, heads, ROPE_DIM, device=device, generator=generator).bfloat16()
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    scale = (KV_LORA_RANK + ROPE_DIM) ** -0.5
    step = captured(lambda: ops.mla_decode(q_nope, q_pe, cache, table, lens, scale, backend=backend,
                                           return_lse=True), device)
    step_ms = time_ms(step, iterations, device)
    return {"step_us": step_ms * 1e3, "decode_us": step_ms * 1e3, "collectives_us": 0.0,
            "cache_bytes": cache.numel() * cache.element_size(), "local_tokens": seq_len}


def bench_dcp(group, batch, seq_len, heads, block_size, interleave, backend, iterations, device) -> dict:
    """This rank's share of a DCP step over `group`, and its parts."""
    import torch.distributed as dist

    from mla_multi import ops
    from mla_multi.distributed import DecodeContextParallel, _all_gather_flat, _reduce_scatter_flat

    dcp = DecodeContextParallel(group, interleave=interleave)
    world = dcp.world_size
    num_local = heads // world
    local_tokens = dcp.local_num_tokens(seq_len)
    generator = torch.Generator(device=device).manual_seed(1 + dcp.rank)
    cache, table = random_cache(batch, local_tokens, block_size, device, generator)
    q_nope = torch.randn(batch, num_local, KV_LORA_RANK, device=device, generator=generator).bfloat16()
    q_pe = torch.randn(batch, num_local, ROPE_DIM, device=device, generator=generator).bfloat16()
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    scale = (KV_LORA_RANK + ROPE_DIM) ** -0.5
    token = torch.zeros(1, device=device)

    def align():
        dist.all_reduce(token, group=group)

    step = captured(lambda: dcp.mla_decode(q_nope, q_pe, cache, table, lens, scale, backend=backend,
                                           return_lse=True), device)
    step_ms = time_ms(step, iterations, device, align)

    # The local decode alone: every head of the layer over this rank's tokens.
    all_q_nope = torch.randn(batch, heads, KV_LORA_RANK, device=device, generator=generator).bfloat16()
    all_q_pe = torch.randn(batch, heads, ROPE_DIM, device=device, generator=generator).bfloat16()
    local_lens = dcp.local_seq_lens(lens)
    decode = captured(lambda: ops.mla_decode(all_q_nope, all_q_pe, cache, table, local_lens, scale, backend=backend,
                                             return_lse=True), device)
    decode_ms = time_ms(decode, iterations, device, align)

    # The step's collectives alone, at its sizes.
    query = torch.zeros(1, batch, num_local, KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16, device=device)
    gathered_query = torch.empty(world, batch, num_local, KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16,
                                 device=device)
    lse = torch.zeros(1, batch, heads, device=device)
    gathered_lse = torch.empty(world, batch, heads, device=device)
    corrected = torch.zeros(world * batch, num_local, KV_LORA_RANK, dtype=torch.bfloat16, device=device)
    reduced = torch.empty(batch, num_local, KV_LORA_RANK, dtype=torch.bfloat16, device=device)

    def collectives():
        _all_gather_flat(gathered_query, query, group=group)
        _all_gather_flat(gathered_lse, lse, group=group)
        _reduce_scatter_flat(reduced, corrected, group=group)

    collectives_ms = time_ms(captured(collectives, device), iterations, device, align)
    return {"step_us": step_ms * 1e3, "decode_us": decode_ms * 1e3, "collectives_us": collectives_ms * 1e3,
            "cache_bytes": cache.numel() * cache.element_size(), "local_tokens": local_tokens}


def _worker(rank, nprocs, init_file, options, report_dir):
    # NVLink multicast (NVLS) and symmetric-memory multicast stay off.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # The data checks read tensors on the host, which a graph capture forbids.
    os.environ["MLA_MULTI_CHECK_INPUTS"] = "0"
    import torch.distributed as dist

    on_gpu = options["device"] == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=nprocs)
    # Every process creates every group, in the same order (new_group is collective).
    groups = {w: dist.new_group(list(range(w))) for w in options["world_sizes"] if w > 1}
    rows = []
    for batch, seq_len in options["cases"]:
        for world in options["world_sizes"]:
            row = None
            if world == 1 and rank == 0:
                row = bench_single(batch, seq_len, options["heads"], options["block_size"], options["backend"],
                                   options["iterations"], device)
            elif world > 1 and rank < world:
                row = bench_dcp(groups[world], batch, seq_len, options["heads"], options["block_size"],
                                options["interleave"], options["backend"], options["iterations"], device)
            if row is not None:
                row.update(batch=batch, seq_len=seq_len, world=world, rank=rank)
                rows.append(row)
            if on_gpu:
                torch.cuda.empty_cache()
                dist.barrier(device_ids=[rank])
            else:
                dist.barrier()
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(rows, handle)
    dist.destroy_process_group()


def combine_ranks(rows: list[dict], heads: int) -> list[dict]:
    """One row per (case, world size): the slowest rank's times, the largest cache, speed-up against 1 GPU."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row["batch"], row["seq_len"], row["world"])
        current = merged.setdefault(key, {"batch": row["batch"], "seq_len": row["seq_len"], "world": row["world"],
                                          "heads_per_gpu": heads // row["world"]})
        for name in ("step_us", "decode_us", "collectives_us", "cache_bytes", "local_tokens"):
            current[name] = max(current.get(name, 0), row[name])
    result = sorted(merged.values(), key=lambda r: (r["batch"], r["seq_len"], r["world"]))
    for row in result:
        single = merged.get((row["batch"], row["seq_len"], 1))
        row["speedup"] = single["step_us"] / row["step_us"] if single else None
    return result


def format_rows(rows: list[dict]) -> str:
    header = (f"{'B':>4} {'S':>7} {'GPUs':>4} {'heads/GPU':>9} {'tokens/GPU':>10} {'cache GiB/GPU':>13} "
              f"{'step us':>9} {'decode us':>9} {'collect. us':>11} {'speed-up':>8}")
    lines = [header]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(
            f"{r['batch']:>4} {r['seq_len']:>7} {r['world']:>4} {r['heads_per_gpu']:>9} {r['local_tokens']:>10} "
            f"{r['cache_bytes'] / 2**30:>13.2f} {r['step_us']:>9.1f} {r['decode_us']:>9.1f} "
            f"{r['collectives_us']:>11.1f} {speedup:>8}"
        )
    return "\n".join(lines)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"--{name}={text!r}; accepted: a comma list of positive ints")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mla-multi bench dcp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma list of BxS (requests x tokens each)")
    parser.add_argument("--heads", type=int, default=128, help="heads of the layer in total (N)")
    parser.add_argument("--world-sizes", default="1,2", help="GPU counts to compare; 1 is the single-device path")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--backend", default=None, help="decode backend (default: TRITON on GPUs, REFERENCE on the CPU)")
    parser.add_argument("--iterations", type=int, default=50, help="timed replays per measurement")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    world_sizes = sorted(set(_int_list(args.world_sizes, "world-sizes")))
    cases = []
    for case in args.cases.split(","):
        try:
            batch, seq_len = (int(part) for part in case.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--cases entry {case!r}; accepted: BxS like 32x131072") from None
        cases.append((batch, seq_len))
    bad = [w for w in world_sizes if args.heads % w]
    if bad:
        raise SystemExit(f"--heads={args.heads} does not split over world sizes {bad}; accepted: a multiple of each")
    nprocs = max(world_sizes)
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < nprocs:
            from mla_multi.benchmarks import needs_gpu

            return needs_gpu("mla-multi bench dcp", nprocs, hint="--device cpu runs it over gloo")
    backend = args.backend or ("TRITON" if args.device == "cuda" else "REFERENCE")
    options = {"device": args.device, "world_sizes": world_sizes, "cases": cases, "heads": args.heads,
               "block_size": args.block_size, "interleave": args.interleave, "backend": backend,
               "iterations": args.iterations}
    report_dir = tempfile.mkdtemp(prefix="mla_multi_bench_dcp_")
    init_file = os.path.join(report_dir, "rendezvous")
    torch.multiprocessing.start_processes(_worker, args=(nprocs, init_file, options, report_dir), nprocs=nprocs,
                                          join=True, start_method="spawn")
    rows = []
    for rank in range(nprocs):
        with open(os.path.join(report_dir, f"rank{rank}.json")) as handle:
            rows += json.load(handle)
    merged = combine_ranks(rows, args.heads)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    print(f"device: {nprocs} x {device_name}; N = {args.heads} heads in total, bf16 cache, block size "
          f"{args.block_size}, interleave {args.interleave}, decode backend {backend}; "
          f"median of {args.iterations} timed calls (CUDA-graph replays on GPUs)")
    print(format_rows(merged))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device_name, "options": options, "rows": merged, "per_rank": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
