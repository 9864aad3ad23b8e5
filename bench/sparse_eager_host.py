"""Host time of one eager sparse decode call through the public ops (`mm.ops.mla_sparse_decode` over the
fp8_ds_mla and bf16 caches, topk 2048; `mm.ops.mla_sparse_decode_v4` over the 584-byte cache, top-k 512 + a
128-token window, the sink), 128 heads (and 64 for V4), per backend (the registry's default, TRITON,
FLASHMLA) beside FlashMLA's own call on the same inputs where it is installed: the best of 40 batches of 10
calls (a noisy host's spikes left out; the device keeps up, so this is the host's time), best again of three
such measurements taken in turn over the columns, and the call's time replayed from a CUDA graph. `t.add_` (one PyTorch launch) gives the host's speed.

    PYTHONPATH=. python3 bench/sparse_eager_host.py [--backends default,TRITON,FLASHMLA] [--v4-only]
"""
import argparse

import torch

import mla_multi as mm
from mla_multi.benchmarks import best_host_time, graph_time
from mla_multi.benchmarks.sparse import random_v4_cache
from mla_multi.ds_mla_cache import quantize_fp8_ds_mla


def flash_mla():
    try:
        import flash_mla

        return flash_mla if flash_mla.has_legacy() else None
    except Exception:  # not installed: no column
        return None


def report(label: str, columns: dict, rounds: int = 3) -> None:
    """Each column's host time (the best of `rounds` measurements taken in turn, so that a host's slow spell
    falls on every column) and captured time."""
    runnable = {}
    for name, call in columns.items():
        try:
            call()
            runnable[name] = call
        except Exception as error:  # a backend that cannot run this case: say so, go on
            print(f"{label} {name}: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    best = dict.fromkeys(runnable, float("inf"))
    for _ in range(rounds):
        for name, call in runnable.items():
            best[name] = min(best[name], best_host_time(call))
    for name, call in runnable.items():
        print(f"{label} {name}: host {best[name]:.1f} µs a call, captured {graph_time(call):.1f} µs", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="default,TRITON,FLASHMLA")
    parser.add_argument("--v4-only", action="store_true")
    args = parser.parse_args()
    backends = [None if b == "default" else b for b in args.backends.split(",")]
    module = flash_mla()
    torch.manual_seed(0)
    t = torch.zeros(16, device="cuda")
    print(f"host: t.add_ {best_host_time(lambda: t.add_(1)):.1f} µs a call", flush=True)
    if not args.v4_only:
        latent = torch.randn(4096 * 64, 512, device="cuda")
        rope = torch.randn(4096 * 64, 64, device="cuda")
        caches = {"fp8_ds_mla": quantize_fp8_ds_mla(latent, rope).view(4096, 64, 656),
                  "bf16": torch.cat([latent, rope], -1).to(torch.bfloat16).view(4096, 64, 576)}
        for kv, cache in caches.items():
            for tokens in (1, 32):
                q = torch.randn(tokens, 128, 576, device="cuda", dtype=torch.bfloat16)
                indices = torch.stack([torch.randperm(4096 * 64, device="cuda")[:2048]
                                       for _ in range(tokens)]).to(torch.int32)
                columns = {}
                if module is not None and kv == "fp8_ds_mla":
                    sched, _ = module.get_mla_metadata()
                    columns["FlashMLA's own"] = (lambda q=q, indices=indices, sched=sched: module.flash_mla_with_kvcache(
                        q.unsqueeze(1), cache.unsqueeze(2), None, None, 512, sched, softmax_scale=0.07,
                        is_fp8_kvcache=True, indices=indices.unsqueeze(1), use_legacy=True))
                for backend in backends:
                    columns[backend or "default"] = (lambda q=q, indices=indices, backend=backend: mm.ops.mla_sparse_decode(
                        q[..., :512], q[..., 512:], cache, indices, 0.07, backend=backend))
                report(f"{kv} N=128 B={tokens}", columns)
    cache = random_v4_cache(4096, "cuda")
    window = random_v4_cache(64, "cuda")
    for heads, tokens in ((128, 1), (128, 32), (64, 1)):
        q = torch.randn(tokens, heads, 512, device="cuda", dtype=torch.bfloat16)
        indices = torch.stack([torch.randperm(4096 * 64, device="cuda")[:512] for _ in range(tokens)]).to(torch.int32)
        window_indices = torch.stack([torch.randperm(64 * 64, device="cuda")[:128]
                                      for _ in range(tokens)]).to(torch.int32)
        sink = torch.randn(heads, device="cuda")
        lengths = torch.full((tokens,), 512, dtype=torch.int32, device="cuda")
        window_lengths = torch.full((tokens,), 128, dtype=torch.int32, device="cuda")
        columns = {}
        if module is not None:
            sched, _ = module.get_mla_metadata()
            columns["FlashMLA's own"] = (lambda q=q, indices=indices, window_indices=window_indices, sink=sink, lengths=lengths,
                   window_lengths=window_lengths, sched=sched: module.flash_mla_with_kvcache(
                       q.unsqueeze(1), cache.unsqueeze(2), None, None, 512, sched, softmax_scale=0.05,
                       is_fp8_kvcache=True, indices=indices.unsqueeze(1), attn_sink=sink,
                       extra_k_cache=window.unsqueeze(2), extra_indices_in_kvcache=window_indices.unsqueeze(1),
                       topk_length=lengths, extra_topk_length=window_lengths, use_legacy=True, kv_format="V4"))
        for backend in backends:
            columns[backend or "default"] = (lambda q=q, indices=indices, window_indices=window_indices, sink=sink,
                   lengths=lengths, window_lengths=window_lengths, backend=backend: mm.ops.mla_sparse_decode_v4(
                       q, cache, indices, 0.05, topk_length=lengths, attn_sink=sink, extra_kv_cache=window,
                       extra_indices=window_indices, extra_topk_length=window_lengths, backend=backend))
        report(f"V4 fp8_ds_mla_v4 + window N={heads} B={tokens}", columns)


if __name__ == "__main__":
    main()
