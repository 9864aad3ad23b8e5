"""One causal prefill shape replayed for seconds at a time, the sm_90 kernel and FlashInfer's fa3 ragged prefill
(where installed) in turn, while `nvidia-smi` samples the SM clock and the power draw: whether a kernel's
speed over a long run is set by the clock its power draw leaves it, or by its cycles.

    PYTHONPATH=. python3 bench/prefill_clocks.py 1,8192,128 [--seconds 4] [--rounds 2]   # B,S,N

Prints, for each kernel and round: µs a call, TFLOP/s, the mean SM clock and power over the window, and
the cycles a call at that clock (µs x MHz). With `--once` it only calls each kernel three times (for
`ncu --clock-control none`, whose cycle counts do not depend on the clock).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import torch

from mla_multi.benchmarks.prefill import HEAD_DIM_QK, HEAD_DIM_V, _flashinfer_prefill, prefill_flops
from mla_multi.kernels.prefill_wgmma import varlen_attention_wgmma
from mla_multi.testing import capture_graph


class Sampler:
    """`nvidia-smi` every 50 ms, each line stamped with the host's clock as it arrives."""

    def __init__(self) -> None:
        self.samples: list = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mhz, watts, temp = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts, temp))

    def between(self, start: float, end: float):
        rows = [s for s in self.samples if start <= s[0] <= end]
        if not rows:
            return float("nan"), float("nan"), float("nan")
        return tuple(statistics.fmean(r[i] for r in rows) for i in (1, 2, 3))

    def stop(self) -> None:
        self.proc.terminate()


def sustained(graph, seconds: float) -> tuple[float, float, float]:
    """Replays for `seconds` (the first second's replays heat the device and are not counted): µs a call,
    and the window's bounds on the host clock."""
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            graph.replay()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    t1 = time.perf_counter()
    return begin.elapsed_time(end) * 1e3 / calls, t0, t1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", help="B,S,N")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args()
    batch, seqlen, heads = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    tokens = batch * seqlen
    q = torch.randn(tokens, heads, HEAD_DIM_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, heads, HEAD_DIM_QK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, heads, HEAD_DIM_V, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, tokens + 1, seqlen, device="cuda", dtype=torch.int32)
    out = torch.empty(tokens, heads, HEAD_DIM_V, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(heads, tokens, device="cuda", dtype=torch.float32)
    scale = HEAD_DIM_QK**-0.5
    runs = {"triton": lambda: varlen_attention_wgmma(q, k, v, cu, cu, seqlen, seqlen, scale, causal=True, out=out,
                                                     lse=lse)}
    fi_run, reason = _flashinfer_prefill(q, k, v, cu, seqlen, scale, True)
    if fi_run is not None:
        runs["flashinfer"] = fi_run
    else:
        print(f"flashinfer: {reason}")
    if args.once:
        for run in runs.values():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        return
    flops = prefill_flops(heads, batch, seqlen)
    graphs = {name: capture_graph(run) for name, run in runs.items()}
    sampler = Sampler()
    time.sleep(0.5)
    print(f"{torch.cuda.get_device_name()}, B={batch} S={seqlen} N={heads}, {args.seconds} s windows")
    print("| round | kernel | µs a call | TFLOP/s | SM MHz | W | °C | M cycles a call |")
    print("|--|--|--:|--:|--:|--:|--:|--:|")
    for rnd in range(args.rounds):
        for name, graph in graphs.items():
            us, t0, t1 = sustained(graph, args.seconds)
            mhz, watts, temp = sampler.between(t0, t1)
            print(f"| {rnd} | {name} | {us:.1f} | {flops / us / 1e6:.1f} | {mhz:.0f} | {watts:.0f} | {temp:.0f} | "
                  f"{us * mhz / 1e6:.3f} |", flush=True)
            time.sleep(1.0)
    sampler.stop()


if __name__ == "__main__":
    main()
