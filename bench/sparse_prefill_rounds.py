"""FLASHMLA's sparse prefill beside FlashMLA's own call, timed in rounds in one process (every other round in reverse order), with the
adapter's index copy (its sanitize launch) timed alone:
`PYTHONPATH=. python3 bench/sparse_prefill_rounds.py [N T S_kv] [--rounds R]` (FlashMLA from `sgl-flash-mla`,
carried as a wheel)."""
import argparse

import torch
import triton

import mla_multi as mm
from mla_multi.backends import flashmla as fm
from mla_multi.benchmarks import in_turn
from mla_multi.testing import capture_graph

parser = argparse.ArgumentParser()
parser.add_argument("case", nargs="*", type=int, default=[128, 8192, 65536])
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--topk", type=int, default=2048)
args = parser.parse_args()
heads, tokens, s_kv = args.case
device = torch.device("cuda")
torch.manual_seed(0)
kv = torch.randn(s_kv, 576, device=device, dtype=torch.bfloat16)
indices = torch.stack([torch.randperm(s_kv, device=device)[:args.topk] for _ in range(tokens)]).to(torch.int32)
q = torch.randn(tokens, heads, 576, device=device, dtype=torch.bfloat16)
q_nope, q_pe = q[..., :512], q[..., 512:]
scale = 192**-0.5
module = fm._module()
call = fm._sparse_call(module, q_nope, indices, None, s_kv, decode=False)


def raw():
    return module.flash_mla_sparse_fwd(q, kv.unsqueeze(1), indices.unsqueeze(1), scale, 512, use_legacy=True)[0]


def ours():
    return mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, indices, scale, backend="FLASHMLA")


def sanitize():
    return call.index_plan.sanitize(indices, s_kv, None)[0]


runs = {"FlashMLA": raw, "FLASHMLA": ours, "sanitize": sanitize}
graphs = {name: capture_graph(fn) for name, fn in runs.items()}
flops = 2 * tokens * heads * args.topk * (576 + 512)
print(f"{torch.cuda.get_device_name()}: N={heads} T={tokens} S_kv={s_kv} topk={args.topk}, captured µs (TFLOP/s) "
      f"per round, then eager")
for r in range(args.rounds):
    times = {name: triton.testing.do_bench(graphs[name].replay, warmup=25, rep=200, return_mode="median") * 1e3
             for name in in_turn(list(graphs), r)}  # every other round in reverse order
    cells = [f"{name} {us:.1f}" + (f" ({flops / us / 1e6:.0f})" if name != "sanitize" else "")
             for name, us in sorted(times.items(), key=lambda item: list(graphs).index(item[0]))]
    print(f"round {r}: " + ", ".join(cells), flush=True)
for name, fn in runs.items():
    us = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
    print(f"eager {name} {us:.1f}", flush=True)
