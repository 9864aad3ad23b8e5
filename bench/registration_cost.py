"""Host cost of calling the functional ops through their torch.library registration.

    PYTHONPATH=. python3 bench/registration_cost.py [--calls 20000] [--repeats 7] [--device cpu|cuda]

Times, per call, `mla_multi.ops.merge_attn_states` (the plain Python op) against
``torch.ops.mla_multi.merge_attn_states`` (the registered op, whose kernel calls
the plain op) on tiny tensors, and for scale the same function registered with
``torch.library.custom_op``.  A second block isolates the registration itself
with an op that only copies its input, called as a Python function and
registered both ways.  Each row is the best of `--repeats` loops of `--calls`
calls (the rows take turns), under grad mode and under
``torch.inference_mode()`` (where the dispatcher skips the Autograd key).
On a GPU the loops end with a synchronisation; the kernels are tiny, so the
host cost still dominates.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import mla_multi as mm  # noqa: E402

BENCH_NS = "mla_multi_bench"


def register_bench_ops():
    """A do-nothing op (returns a copy of its input) via Library(define + impl) and via custom_op;
    merge_attn_states via custom_op."""
    lib = torch.library.Library(BENCH_NS, "DEF")
    lib.define("copy(Tensor x) -> Tensor")
    lib.impl("copy", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{BENCH_NS}::copy", lambda x: torch.empty_like(x), lib=lib)

    @torch.library.custom_op(f"{BENCH_NS}::copy_custom", mutates_args=())
    def copy_custom(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @torch.library.custom_op(f"{BENCH_NS}::merge_custom", mutates_args=())
    def merge_custom(
        prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor, suffix_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mm.ops.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse)

    return lib, copy_custom, merge_custom


def loop_us(fn, args, calls: int, device: torch.device) -> float:
    """Mean µs per call over `calls` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter_ns() - start) / calls / 1e3


def best_us(rows, calls: int, repeats: int, device: torch.device) -> list[float]:
    """Best over `repeats` of each row's loop; the rows take turns, so drift hits them alike."""
    for _, fn, args in rows:
        loop_us(fn, args, min(calls, 200), device)
    best = [float("inf")] * len(rows)
    for _ in range(repeats):
        for i, (_, fn, args) in enumerate(rows):
            best[i] = min(best[i], loop_us(fn, args, calls, device))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    _lib, copy_custom, merge_custom = register_bench_ops()
    # One token: the PyTorch merge (CPU) returns its output in [N, T, D] memory order, which the
    # registered op copies to the contiguous layout its fake promises; with T = 1 both agree and
    # no copy is timed. The Triton merge (GPU) writes a contiguous output at any T.
    tokens, heads, dim = 1, 2, 8
    merge_args = (
        torch.randn(tokens, heads, dim, device=device),
        torch.randn(heads, tokens, device=device),
        torch.randn(tokens, heads, dim, device=device),
        torch.randn(heads, tokens, device=device),
    )
    x = torch.randn(4, device=device)

    def plain_copy(x):
        return x.clone()

    merge_rows = [
        ("mla_multi.ops.merge_attn_states (plain Python)", mm.ops.merge_attn_states, merge_args),
        ("torch.ops.mla_multi.merge_attn_states (Library)", torch.ops.mla_multi.merge_attn_states, merge_args),
        ("the same function via torch.library.custom_op", merge_custom, merge_args),
    ]
    copy_rows = [
        ("plain Python function: x.clone()", plain_copy, (x,)),
        ("Library define + impl (CompositeExplicitAutograd)", getattr(torch.ops, BENCH_NS).copy.default, (x,)),
        ("torch.library.custom_op", copy_custom, (x,)),
    ]

    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", {args.calls} calls x best of {args.repeats}")
    for mode_name, mode in (("grad mode", torch.enable_grad), ("inference_mode", torch.inference_mode)):
        with mode():
            for title, rows in ((f"merge_attn_states [{tokens}, {heads}, {dim}]", merge_rows), ("copy of a [4] tensor", copy_rows)):
                print(f"\n{title}, {mode_name}:")
                print(f"  {'call':52s} {'us/call':>8s} {'added us':>9s}")
                times = best_us(rows, args.calls, args.repeats, device)
                for i, ((name, _, _), us) in enumerate(zip(rows, times)):
                    added = f"{us - times[0]:+9.2f}" if i else ""
                    print(f"  {name:52s} {us:8.2f} {added:>9s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
