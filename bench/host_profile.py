"""Where an eager call's host time goes: eager vs graph-replayed time of the functional ops, and a
Python profile of repeated calls.

    PYTHONPATH=. python3 bench/host_profile.py [OUTDIR]

Writes profile_*.txt under OUTDIR (default .) and prints a table.
"""
import cProfile
import inspect
import io
import os
import pstats
import sys

import torch
import triton
from triton.testing import do_bench

import mla_multi as mm
from mla_multi.benchmarks import graph_time

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
torch.manual_seed(0)
dev = "cuda"
BS = 64



def profile(fn, name, calls=300):
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
        f.write(buf.getvalue())


def decode_inputs(n, b, s):
    nb = b * s // BS + 8
    cache = torch.randn(nb, BS, 576, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev)[: b * (s // BS)].int().reshape(b, s // BS)
    sl = torch.full((b,), s, dtype=torch.int32, device=dev)
    qn = torch.randn(b, n, 512, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(b, n, 64, device=dev, dtype=torch.bfloat16)
    return qn, qp, cache, bt, sl


rows = []
for n, b, s in ((16, 1, 8192), (128, 1, 8192), (128, 8, 8192), (128, 64, 8192)):
    qn, qp, cache, bt, sl = decode_inputs(n, b, s)
    call = lambda: mm.ops.mla_decode(qn, qp, cache, bt, sl, 0.1147)
    call()
    eager = do_bench(call, return_mode="median") * 1000
    kernel = graph_time(call)
    rows.append(("mla_decode", n, f"{b}x{s}", kernel, eager))
    if (n, b) == (128, 1):
        profile(call, "decode_n128_b1")
        import time
        from mla_multi import ops
        plan = next(iter(ops._DECODE_PLANS.values()))
        kp = plan.kernel_plan
        print("bound:", kp.split._run is not None, None if kp.reduce is None else kp.reduce._run is not None,
              "tma", kp.tma, "splits", kp.num_kv_splits)
        from mla_multi.kernels.launch import direct_launch_reason
        print("direct_launch_reason:", repr(direct_launch_reason()))
        def per_call(fn, n=2000):
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(n):
                fn()
            dt = (time.perf_counter() - t) / n * 1e6; torch.cuda.synchronize(); return dt
        key = lambda: ops._decode_plan_key(qn, qp, cache, bt, sl, None, None, None)
        print("host us: key %.1f  op %.1f" % (per_call(key), per_call(call)))
        out = torch.empty_like(qn); lse = torch.empty(qn.shape[:-1], device=dev)
        al = torch.empty(plan.logits_shape, device=dev)
        print("host us: kernel_plan.launch %.1f" % per_call(lambda: kp.launch(qn, qp, cache, bt, sl, None, al, out, lse, 0.1)))
        print("host us: split only %.1f" % per_call(lambda: kp.split(qn, qp, cache, bt, sl, sl, al, out, lse, kp.error_flag, 0.1, *kp.int_args)))
        print("host us: torch.empty x3 %.1f" % per_call(lambda: (torch.empty_like(qn), torch.empty(qn.shape[:-1], device=dev), torch.empty(plan.logits_shape, device=dev))))

dims = mm.MLADims.deepseek_v3(num_heads=128)
weight = (torch.randn(128 * 256, 512, device=dev) / 512**0.5).to(torch.bfloat16)
layer = mm.MLAAttention(dims, 0.1, weight, block_size=BS, max_model_len=8192, max_num_seqs=128)
qn, qp, cache, bt, sl = decode_inputs(128, 1, 8192)
md = mm.CommonAttentionMetadata.from_lengths([1], [8192], bt, BS)
qq = torch.randn(1, 128, 192, device=dev, dtype=torch.bfloat16)
kv = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)
kpe = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
o = torch.empty(1, 128 * 128, device=dev, dtype=torch.bfloat16)
layer.plan(md)
profile(lambda: layer.forward(qq, kv, kpe, cache, md, output=o), "layer_decode_b1")

t = 1024
q = torch.randn(t, 128, 192, device=dev, dtype=torch.bfloat16)
k = torch.randn(t, 128, 192, device=dev, dtype=torch.bfloat16)
v = torch.randn(t, 128, 128, device=dev, dtype=torch.bfloat16)
cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
for backend in ("TRITON",):
    call = lambda: mm.ops.mla_prefill(q, k, v, cu, cu, t, t, 0.1147, backend=backend)
    call()
    eager = do_bench(call, return_mode="median") * 1000
    kernel = graph_time(call, reps=5)
    rows.append((f"mla_prefill {backend}", 128, f"1x{t}", kernel, eager))
    profile(call, "prefill_triton")

with open(os.path.join(out_dir, "jit_run_source.txt"), "w") as f:
    from triton.runtime import jit

    f.write(triton.__version__ + "\n" + inspect.getsourcefile(jit) + "\n")
    f.write(inspect.getsource(jit.JITFunction.run))
    try:
        from triton.compiler import compiler

        f.write("\n\n" + inspect.getsource(compiler.CompiledKernel))
    except Exception as e:  # noqa: BLE001
        f.write(repr(e))

print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
print(f"{'call':22} {'N':>4} {'BxS':>9} {'kernel us':>10} {'eager us':>10}")
for name, n, shape, kernel, eager in rows:
    print(f"{name:22} {n:4d} {shape:>9} {kernel:10.1f} {eager:10.1f}")
