"""`mm.ops.mla_prefill` eager and graph-replayed, with the registry's default and with each installed backend,
beside FlashInfer's own ragged prefill (planned once outside the timing) and cuDNN (PyTorch SDPA), on the same
inputs in one process.

    PYTHONPATH=. python3 bench/prefill_op_bench.py [--heads 128,16] [--shapes 16x512,1x1024,4x2048,1x8192]

Causal, qk head dim 192, v head dim 128, bf16. Eager: `triton.testing.do_bench` of the plain call (host path
included), median. Captured: one CUDA graph of 10 calls replayed, median per call. The last column is the
default's time over the fastest other path's, eager and captured.
"""
import argparse

import torch

import mla_multi as mm
from mla_multi.benchmarks.prefill import HEAD_DIM_QK, HEAD_DIM_V, _flashinfer_prefill, _torch_sdpa
from mla_multi.benchmarks import eager_time, graph_time




def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="128,16")
    parser.add_argument("--shapes", default="16x512,1x1024,4x2048,1x8192")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("mm.ops.mla_prefill, causal, bf16: eager / captured us")
    dev = "cuda"
    for heads in map(int, args.heads.split(",")):
        for shape in args.shapes.split(","):
            batch, seqlen = map(int, shape.split("x"))
            torch.manual_seed(0)
            total = batch * seqlen
            q = torch.randn(total, heads, HEAD_DIM_QK, device=dev, dtype=torch.bfloat16)
            k = torch.randn(total, heads, HEAD_DIM_QK, device=dev, dtype=torch.bfloat16)
            v = torch.randn(total, heads, HEAD_DIM_V, device=dev, dtype=torch.bfloat16)
            cu = torch.arange(0, total + 1, seqlen, device=dev, dtype=torch.int32)
            scale = HEAD_DIM_QK**-0.5
            paths = {}
            for name in ("default", "TRITON", "FLASHINFER"):
                backend = None if name == "default" else name

                def op(backend=backend):
                    return mm.ops.mla_prefill(q, k, v, cu, cu, seqlen, seqlen, scale, backend=backend)

                paths[f"op {name}"] = op
            fi_run, reason = _flashinfer_prefill(q, k, v, cu, seqlen, scale, True)
            if fi_run is not None:
                paths["FlashInfer"] = fi_run

            def as4(t):
                return t.view(batch, seqlen, heads, t.shape[-1]).transpose(1, 2)

            cudnn, _, reason = _torch_sdpa("CUDNN_ATTENTION", as4(q), as4(k), as4(v), scale)
            if cudnn is not None:
                paths["cuDNN"] = cudnn
            times = {}
            for name, fn in paths.items():
                try:
                    times[name] = (eager_time(fn), graph_time(fn, reps=10))
                except Exception as error:  # noqa: BLE001
                    print(f"  {name} failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            chosen = mm.ops.plan_mla_prefill(q, k, v, cu, cu, seqlen, seqlen, scale).backend
            line = f"N={heads:3d} {batch:2d}x{seqlen:<5d} (default {chosen}): " + ", ".join(
                f"{name} {e:7.1f} / {c:7.1f}" for name, (e, c) in times.items())
            if "op default" in times:
                others = [t for name, t in times.items() if name != "op default"]
                if others:
                    de, dc = times["op default"]
                    line += (f"  | default / best other: eager {de / min(e for e, _ in others):4.2f}, "
                             f"captured {dc / min(c for _, c in others):4.2f}")
            if "op FLASHINFER" in times and "FlashInfer" in times:
                line += (f"  | op FLASHINFER / FlashInfer: eager {times['op FLASHINFER'][0] / times['FlashInfer'][0]:4.2f}, "
                         f"captured {times['op FLASHINFER'][1] / times['FlashInfer'][1]:4.2f}")
            print(line, flush=True)
            paths = fi_run = cudnn = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
