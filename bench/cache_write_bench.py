"""The cache writers into the byte formats (`mm.ops.concat_and_cache_mla_v4`, and `mm.ops.concat_and_cache_mla`
for fp8_ds_mla): per format and token count, the call replayed from a CUDA graph (µs of device time a call)
and called eagerly (µs of host time a call, the best of 40 batches of 10 calls), over a cache of 4096 blocks
of 64 tokens, the tokens' slots random and distinct. Where the writer cannot be captured (a host
synchronisation), the captured column says so.

    PYTHONPATH=. python3 bench/cache_write_bench.py [--formats fp8_ds_mla_v4,...] [--tokens 1,64,4096]
"""
import argparse

import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi.benchmarks import best_host_time, graph_time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(cf.FORMATS))
    parser.add_argument("--tokens", default="1,64,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    t = torch.zeros(16, device="cuda")
    print(f"host: t.add_ {best_host_time(lambda: t.add_(1)):.1f} µs a call", flush=True)
    print("| format | tokens | captured µs | eager µs of host |")
    print("|--|--:|--:|--:|")
    for name in args.formats.split(","):
        fmt = cf.get_format(name)
        latent = fmt.width - fmt.rope_dims
        cache = fmt.allocate(4096, 64, "cuda")
        writer = mm.ops.concat_and_cache_mla if name == "fp8_ds_mla" else mm.ops.concat_and_cache_mla_v4
        for tokens in map(int, args.tokens.split(",")):
            rows = torch.randn(tokens, fmt.width, device="cuda").to(torch.bfloat16)
            slots = torch.randperm(4096 * 64, device="cuda")[:tokens]
            kv_c, k_pe = rows[:, :latent], rows[:, latent:]

            def call():
                writer(kv_c, k_pe, cache, slots)

            eager = best_host_time(call)
            try:
                captured = f"{graph_time(call):.1f}"
            except Exception as error:  # a writer that synchronises cannot be captured: say so
                captured = f"not capturable ({type(error).__name__})"
                torch.cuda.synchronize()
            print(f"| {name} | {tokens} | {captured} | {eager:.1f} |", flush=True)


if __name__ == "__main__":
    main()
