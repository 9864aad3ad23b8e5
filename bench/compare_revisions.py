"""Decode and prefill through the public ops, timed for two or more checkouts of the package in one device run,
so that a change can be checked against the code before it (regressions of a few per cent need the same device and run).

    git archive <rev> mla_multi | tar -x -C /tmp/old     # the older package, any directory
    PYTHONPATH=. python3 bench/compare_revisions.py /tmp/old [. /tmp/variant ...] [--rounds 2]

The first directory is the baseline (one directory alone: it against this checkout). Each round runs one
worker process per checkout, in order, each timing every case with whichever
`mla_multi` its PYTHONPATH names, through APIs both have: `mm.ops.mla_decode(..., backend="TRITON")` (bf16
and FP8 caches, block 64) and `mm.ops.mla_prefill(..., backend="TRITON")` (causal, qk 192 / v 128, bf16).
Captured: a CUDA graph of 10 calls replayed (`triton.testing.do_bench`, median per call); eager:
`do_bench` of the plain call, host path included. Decode reads at least 128 MiB of cache per case (copies
rotated). `mm.ops.mla_sparse_decode(..., backend="TRITON")` over an fp8_ds_mla cache of 256K rows (block 64,
topk 2048, index lists drawn anew for each of the rotated copies). Layer decode steps: `MLAAttention.forward`
of DeepSeek-V3 dims (`mla_multi.benchmarks.layer.v3_case`, the step planned outside), four layers of their
own weights and caches taken in turn, as a model's are. COMPARE_ONLY=decode, =prefill, =sparse or =layer
runs those cases alone. The table keeps each case's best (lowest)
time over the rounds, and each checkout's ratio to the first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

DECODE_CASES = [  # (heads, batch, seq_len, kv dtype)
    (16, 1, 8192, "bf16"), (128, 1, 8192, "bf16"), (16, 64, 8192, "bf16"), (128, 64, 8192, "bf16"),
    (128, 128, 4096, "bf16"), (128, 64, 8192, "fp8"),
]
PREFILL_CASES = [(128, 1, 8192), (128, 4, 2048), (128, 16, 512), (16, 16, 512)]  # (heads, batch, seq_len)
SPARSE_CASES = [(128, 1), (128, 32), (128, 64), (128, 128), (64, 64)]  # (heads, tokens): fp8_ds_mla, topk 2048
LAYER_CASES = [(128, 1, 8192), (128, 2, 8192), (128, 4, 8192), (128, 8, 8192), (16, 1, 8192), (16, 4, 8192),
               (128, 64, 4096)]  # (heads, batch, seq_len): decode steps of one layer, bf16 cache
LAYER_COPIES = 4


def _worker() -> None:
    import torch
    from triton.testing import do_bench

    import mla_multi as mm

    dev = "cuda"

    def graph_time(fn, reps=10):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return do_bench(graph.replay, return_mode="median") * 1000 / reps

    def eager_time(fn):
        fn()
        return do_bench(fn, return_mode="median") * 1000

    def report(name, fn):
        try:
            row = {"case": name, "eager": eager_time(fn), "captured": graph_time(fn)}
        except Exception as error:  # noqa: BLE001
            row = {"case": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
        print(json.dumps(row), flush=True)

    torch.manual_seed(0)
    scale = 192**-0.5
    only = os.environ.get("COMPARE_ONLY", "")
    for heads, batch, seq_len, kv in DECODE_CASES if only in ("", "decode") else ():
        blocks = batch * seq_len // 64
        copies = max(1, min(4, (128 << 20) // (batch * seq_len * 576 * 2)))
        caches = [torch.randn(blocks, 64, 576, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        k_scale = None
        if kv == "fp8":
            caches = [(c / 4).to(torch.float8_e4m3fn) for c in caches]
            k_scale = torch.tensor([0.25], device=dev)
        table = torch.randperm(blocks, device=dev).int().reshape(batch, seq_len // 64)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
        q_nope = torch.randn(batch, heads, 512, device=dev, dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, 64, device=dev, dtype=torch.bfloat16)
        state = [0]

        def decode():
            state[0] = (state[0] + 1) % len(caches)
            return mm.ops.mla_decode(q_nope, q_pe, caches[state[0]], table, lens, scale, k_scale=k_scale,
                                     backend="TRITON")

        report(f"decode {kv} N={heads} {batch}x{seq_len}", decode)

    if only in ("", "sparse"):
        # built here, not by `mla_multi.benchmarks.sparse.random_fp8_ds_mla_cache`: older checkouts lack it
        from mla_multi.ds_mla_cache import quantize_fp8_ds_mla

        rows = 1 << 18
        cache = torch.empty(rows, 656, dtype=torch.uint8, device=dev)
        for start in range(0, rows, 1 << 16):
            cache[start:start + (1 << 16)] = quantize_fp8_ds_mla(torch.randn(1 << 16, 512, device=dev),
                                                                 torch.randn(1 << 16, 64, device=dev))
        cache = cache.view(rows // 64, 64, 656)
        for heads, tokens in SPARSE_CASES:
            copies = max(1, min(64, (128 << 20) // (tokens * 2048 * 656)))
            lists = [torch.stack([torch.randperm(rows, device=dev)[:2048] for _ in range(tokens)]).int()
                     for _ in range(copies)]
            q_nope = torch.randn(tokens, heads, 512, device=dev, dtype=torch.bfloat16)
            q_pe = torch.randn(tokens, heads, 64, device=dev, dtype=torch.bfloat16)
            state = [0]

            def sparse():
                state[0] = (state[0] + 1) % len(lists)
                return mm.ops.mla_sparse_decode(q_nope, q_pe, cache, lists[state[0]], scale, backend="TRITON")

            report(f"sparse fp8_ds_mla N={heads} T={tokens}", sparse)
        del cache
    for heads, batch, seq_len in LAYER_CASES if only in ("", "layer") else ():
        from mla_multi.benchmarks.layer import v3_case

        steps = []
        for _ in range(LAYER_COPIES):
            layer, metadata, step, _ = v3_case(f"decode:{batch}x{seq_len}", heads, None, None, torch.device(dev))
            md = metadata()
            layer.plan(md)
            layer.lock_workspace()
            steps.append((step, md))
        state = [0]

        def layer_step():
            state[0] = (state[0] + 1) % len(steps)
            step, md = steps[state[0]]
            return step(md)

        report(f"layer N={heads} {batch}x{seq_len}", layer_step)
        del steps
    for heads, batch, seq_len in PREFILL_CASES if only in ("", "prefill") else ():
        total = batch * seq_len
        q = torch.randn(total, heads, 192, device=dev, dtype=torch.bfloat16)
        k = torch.randn(total, heads, 192, device=dev, dtype=torch.bfloat16)
        v = torch.randn(total, heads, 128, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(0, total + 1, seq_len, device=dev, dtype=torch.int32)

        def prefill():
            return mm.ops.mla_prefill(q, k, v, cu, cu, seq_len, seq_len, scale, backend="TRITON")

        report(f"prefill N={heads} {batch}x{seq_len}", prefill)
    torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    rounds = 2
    if "--rounds" in argv:
        at = argv.index("--rounds")
        rounds = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    paths = argv if len(argv) > 1 else [argv[0], "."]
    best: dict = {}
    for _ in range(rounds):
        for path in paths:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, cwd=path,
                                  capture_output=True, text=True, timeout=900)
            rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not rows:
                print(f"{path} failed, rc {done.returncode}:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            for row in rows:
                slot = best.setdefault(row["case"], {}).setdefault(path, {})
                if "error" in row:
                    slot["error"] = row["error"]
                    continue
                for what in ("eager", "captured"):
                    slot[what] = min(slot.get(what, float("inf")), row[what])
    base = paths[0]
    print(f"best of {rounds} rounds, µs, captured / eager; each later checkout's ratio to {base} (below 1: faster)")
    print(f"{'case':28s} " + " ".join(f"{path[-24:]:>34s}" for path in paths))
    for case, sides in best.items():
        cells = []
        for path in paths:
            side = sides.get(path, {})
            if "error" in side or not side:
                cells.append(f"{str(side.get('error', 'missing'))[:34]:>34s}")
                continue
            cell = f"{side['captured']:8.1f} / {side['eager']:8.1f}"
            ref = sides.get(base, {})
            if path != base and "captured" in ref:
                cell += f" ({side['captured'] / ref['captured']:5.3f} {side['eager'] / ref['eager']:5.3f})"
            cells.append(f"{cell:>34s}")
        print(f"{case:28s} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        sys.exit(main(sys.argv[1:]))
