"""Prefill attention benchmark: the Triton varlen kernel against PyTorch's own kernels.

MLA prefill shapes (qk head dim 192, v head dim 128, bf16, causal), measured in one
run, each call replayed from a CUDA graph (``triton.testing.do_bench`` of the replay,
median, L2 flushed before each; the TFLOP/s) and called eagerly (the same, host path
included: the second table):

* ``triton``: ``mla_multi.kernels.prefill.varlen_attention``'s default launch on packed
  tokens (``[B*S, N, D]`` with ``cu_seqlens``), output and LSE: on sm_90 the Gluon kernel
  of ``prefill_wgmma``, elsewhere the Triton kernel; ``--configs m128n64w8s3`` names the
  Triton kernel's configuration, ``--configs wgmma[n<block_n>s<stages>][p|g][d<band>|f]`` the Gluon one (p: persistent, g: a program per item;
  d[<band>]: a persistent launch's items taken dynamically, in bands of <band> pairs, f: in a fixed order);
* ``cudnn``: ``scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION`` on
  the batched ``[B, N, S, D]`` view of the same tensors (192/128 natively when cuDNN
  takes it, else V padded to 192);
* ``flash``: ``SDPBackend.FLASH_ATTENTION`` (FlashAttention-2 inside PyTorch) with V
  zero-padded to 192 (it needs one head dim); the padding is done outside the timing.

FLOPs = 2 * N * (causal pairs) * (192 + 128), causal pairs = S * (S + 1) / 2 per
sequence. With ``--rounds R`` every kernel is timed R times, in turn (one round times each once, every
other round in reverse order), and each
figure is the median of its rounds: a drift of the device's clocks during the run then reaches every
kernel alike; the ratios of each round are printed too. With ``--sustained SECONDS`` every captured kernel
is then replayed back to back for that long, in turn, while ``nvidia-smi`` samples the SM clock and the
power draw: the steady state of a busy server, where a long prefill runs at the clock its power draw leaves
it (a third table: µs a call, MHz, W). Usage::

    mla-multi bench prefill [--heads 16,128] [--shapes 1x8192,4x2048,1x16384]
        [--configs m128n64w8s3,m128n64w8s3tma] [--rounds 5] [--sustained 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import torch

from mla_multi.benchmarks import in_turn

HEAD_DIM_QK = 192
HEAD_DIM_V = 128


class WgmmaConfig:
    """'wgmma[n<block_n>s<stages>][p|g][d<band>|f]': the sm_90 kernel of `mla_multi.kernels.prefill_wgmma`; p
    launched persistent, g one program per work item, neither: its default for the shape; d<band> a persistent
    launch's items taken dynamically in bands of <band> (sequence, head) pairs (d alone: `prefill_wgmma.band_of`'s
    bands), f in a fixed order, neither: the default (`prefill_wgmma.takes_dynamic`)."""

    def __init__(self, block_n: int, stages: int, persistent: bool | None = None, band: int | None = None,
                 dynamic: bool | None = None) -> None:
        self.block_n, self.stages, self.persistent = block_n, stages, persistent
        self.dynamic, self.band = dynamic, band
        self.name = (f"wgmma_n{block_n}s{stages}" + {None: "", True: "p", False: "g"}[persistent]
                     + {None: "", True: "d", False: "f"}[dynamic] + ("" if band is None else str(band)))


def parse_config(text: str):
    """'m128n64w8s3[tma]' -> PrefillLaunchConfig (NVIDIA options only); 'wgmma[n128s2][p|g]' -> the sm_90 kernel."""
    from mla_multi.kernels.launch_config import PrefillLaunchConfig

    wgmma = re.fullmatch(r"wgmma(?:n(\d+)s(\d+))?([pg])?(?:d(\d*)|(f))?", text)
    if wgmma is not None:
        from mla_multi.kernels.prefill_wgmma import BLOCK_N, STAGES

        persistent = None if wgmma.group(3) is None else wgmma.group(3) == "p"
        band = int(wgmma.group(4)) if wgmma.group(4) else None
        dynamic = True if wgmma.group(4) is not None else False if wgmma.group(5) else None
        return WgmmaConfig(int(wgmma.group(1) or BLOCK_N), int(wgmma.group(2) or STAGES), persistent, band,
                           dynamic=dynamic)

    match = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)(tma)?(ws)?", text)
    if match is None:
        raise ValueError(f"config {text!r}; accepted: m<block_m>n<block_n>w<warps>s<stages>[tma][ws], e.g. m128n64w8s3 "
                         "(tma: K/V tiles by TMA; ws: Triton's warp specialisation of the unmasked key loop)")
    block_m, block_n, warps, stages = (int(x) for x in match.groups()[:4])
    return PrefillLaunchConfig(block_m, block_n, warps, stages, use_tma=match.group(5) is not None,
                               warp_specialize=match.group(6) is not None)


def prefill_flops(num_heads: int, batch: int, seqlen: int, causal: bool = True) -> float:
    pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
    return 2.0 * num_heads * batch * pairs * (HEAD_DIM_QK + HEAD_DIM_V)


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _enter(row: dict, name: str, run, reason: str) -> None:
    """Enter `run` for timing (`_time_rows`) under `name`, or note why it is missing."""
    if run is None:
        row["notes"].append(f"{name} unavailable: {reason}")
        return
    row.setdefault("_runs", []).append((name, run))


class ClockSampler:
    """`nvidia-smi` every 50 ms in a thread, each sample (SM MHz, W) stamped with the host's clock as it arrives;
    without `nvidia-smi` it samples nothing (the means are then NaN)."""

    def __init__(self) -> None:
        self.samples: list = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "50"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def means(self, start: float, end: float) -> tuple[float, float]:
        """The mean SM clock (MHz) and power (W) of the samples taken between two `time.perf_counter` readings."""
        rows = [s for s in self.samples if start <= s[0] <= end]
        if not rows:
            return float("nan"), float("nan")
        return statistics.fmean(r[1] for r in rows), statistics.fmean(r[2] for r in rows)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


def sustained_replay(replay, seconds: float, sampler: ClockSampler) -> tuple[float, float, float]:
    """`replay` called back to back for `seconds` after one second that brings the device to its steady state
    (not counted): (ms a call, mean SM MHz, mean W over the counted calls)."""
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            replay()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    mhz, watts = sampler.means(t0, time.perf_counter())
    return begin.elapsed_time(end) / calls, mhz, watts


def _time_rows(row: dict, flops: float, rounds: int, sustained: float = 0.0) -> None:
    """Time each entered run into row["ms"][name] / row["tflops"][name] (replayed from a CUDA graph) and
    row["eager_ms"][name] (called eagerly): in `rounds` rounds that each time every run once, in turn
    (`in_turn`: every other round in reverse), so that a drift of the device's clocks reaches every run
    alike; each figure is the median of its rounds, and
    row["ms_rounds"] keeps them all. A call that cannot be captured is timed eagerly in both, with a note.
    sustained > 0: then each captured run replayed for that many seconds, in turn, `rounds` times, in the
    same orders (`sustained_replay`): row["sustained"][name] = (median ms, its round's MHz, W)."""
    from mla_multi.testing import capture_graph

    graphs = {}
    for name, run in row["_runs"]:
        try:
            graphs[name] = capture_graph(run)
            torch.cuda.synchronize()
        except Exception as error:
            row["notes"].append(f"{name} not captured ({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
                                "eager time")
            graphs[name] = None
    captured: dict = {name: [] for name, _ in row["_runs"]}
    eager: dict = {name: [] for name, _ in row["_runs"]}
    for index in range(rounds):
        for name, run in in_turn(row["_runs"], index):
            eager[name].append(_bench(run))
            captured[name].append(_bench(graphs[name].replay) if graphs[name] is not None else eager[name][-1])
    if sustained > 0:
        sampler = ClockSampler()
        # FlashAttention-2 (V padded) is no peer of a 192 / 128 kernel: left out of the longest part of the run
        steady: dict = {name: [] for name in graphs if graphs[name] is not None and name != "flash"}
        for index in range(rounds):
            for name in in_turn(list(steady), index):
                steady[name].append(sustained_replay(graphs[name].replay, sustained, sampler))
        sampler.stop()
        row["sustained"] = {name: sorted(values)[(len(values) - 1) // 2] for name, values in steady.items()}
    for name, _ in row["_runs"]:
        row["ms"][name] = statistics.median(captured[name])
        row.setdefault("eager_ms", {})[name] = statistics.median(eager[name])
        row.setdefault("ms_rounds", {})[name] = captured[name]
        row["tflops"][name] = flops / row["ms"][name] / 1e9
    del row["_runs"], graphs


def _torch_sdpa(backend_name: str, q4, k4, v4, scale: float, causal: bool = True):
    """A closure running SDPA with one backend, or (None, reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale)

    try:
        out = run()
        torch.cuda.synchronize()
    except Exception as error:  # backend refuses the shape
        return None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return run, out, None


def _flashinfer_prefill(q, k, v, cu, seqlen, scale, causal):
    """The FLASHINFER backend's ragged prefill, planned once outside the timing; (run, None) or (None, reason)."""
    from mla_multi import registry
    from mla_multi.dims import MLADims

    dims = MLADims.deepseek_v3(num_heads=q.shape[1])
    config = registry.prefill_config(dims, q.dtype)
    reasons = registry.default_registry.reasons("prefill", "FLASHINFER", registry.current_platform(), config)
    if reasons:
        return None, "; ".join(reasons)
    backend = registry.default_registry.load("prefill", "FLASHINFER")
    impl = backend.get_prefill_impl_cls()(q.shape[1], scale, dims.kv_lora_rank, dims.qk_nope_head_dim,
                                          dims.qk_rope_head_dim, dims.v_head_dim, q.device)
    (wrapper,) = impl._wrappers(1, q.device)
    impl._plan_one(wrapper, cu.cpu(), cu.cpu(), causal, q.dtype)
    return (lambda: impl._run(wrapper, q, k, v, True)), None


def bench_case(
    num_heads: int, batch: int, seqlen: int, configs, results: list, check: bool = True, causal: bool = True,
    rounds: int = 1, sustained: float = 0.0,
) -> None:
    from mla_multi.kernels.prefill import varlen_attention

    device = "cuda"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    total = batch * seqlen
    q = torch.randn(total, num_heads, HEAD_DIM_QK, device=device, dtype=dtype)
    k = torch.randn(total, num_heads, HEAD_DIM_QK, device=device, dtype=dtype)
    v = torch.randn(total, num_heads, HEAD_DIM_V, device=device, dtype=dtype)
    cu = torch.arange(0, total + 1, seqlen, device=device, dtype=torch.int32)
    scale = HEAD_DIM_QK**-0.5
    flops = prefill_flops(num_heads, batch, seqlen, causal)
    row = {
        "num_heads": num_heads, "batch": batch, "seqlen": seqlen, "causal": causal,
        "tflops": {}, "ms": {}, "notes": [],
    }  # fmt: skip

    # Batched views [B, N, S, D] of the packed tensors for PyTorch.
    def as4(t):
        return t.view(batch, seqlen, num_heads, t.shape[-1]).transpose(1, 2)

    q4, k4, v4 = as4(q), as4(k), as4(v)
    cudnn_run, cudnn_out, reason = _torch_sdpa("CUDNN_ATTENTION", q4, k4, v4, scale, causal)
    v_pad = torch.nn.functional.pad(v, (0, HEAD_DIM_QK - HEAD_DIM_V))
    if cudnn_run is None:
        row["notes"].append(f"cudnn 192/128 refused ({reason}); V padded to 192")
        cudnn_run, cudnn_out, reason = _torch_sdpa("CUDNN_ATTENTION", q4, k4, as4(v_pad), scale, causal)
    _enter(row, "cudnn", cudnn_run, reason)
    flash_run, flash_out, reason = _torch_sdpa("FLASH_ATTENTION", q4, k4, as4(v_pad), scale, causal)
    _enter(row, "flash", flash_run, reason)
    reference = cudnn_out if cudnn_out is not None else flash_out
    del flash_out, cudnn_out

    flashinfer_run, reason = _flashinfer_prefill(q, k, v, cu, seqlen, scale, causal)
    if flashinfer_run is not None and check and reference is not None:
        fi_out = flashinfer_run()[0].float()
        ref = reference[..., :HEAD_DIM_V].transpose(1, 2).reshape(total, num_heads, HEAD_DIM_V).float()
        row.setdefault("rel_err_vs_torch", {})["flashinfer"] = ((fi_out - ref).norm() / ref.norm()).item()
        del fi_out
    _enter(row, "flashinfer", flashinfer_run, reason)

    out = torch.empty(total, num_heads, HEAD_DIM_V, device=device, dtype=dtype)
    lse = torch.empty(num_heads, total, device=device, dtype=torch.float32)
    for config in configs:
        name = "triton" if config is None else f"triton[{config.name}]"

        def run(config=config):
            if isinstance(config, WgmmaConfig):
                from mla_multi.kernels.prefill_wgmma import varlen_attention_wgmma

                return varlen_attention_wgmma(q, k, v, cu, cu, seqlen, seqlen, scale, causal=causal, out=out, lse=lse,
                                              block_n=config.block_n, stages=config.stages,
                                              persistent=config.persistent, dynamic=config.dynamic,
                                              band=config.band)
            return varlen_attention(
                q, k, v, cu, cu, seqlen, seqlen, scale, causal=causal, out=out, lse=lse, config=config
            )

        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
        except Exception as error:
            row["notes"].append(f"{name} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        if check and reference is not None:
            ref = reference[..., :HEAD_DIM_V].transpose(1, 2).reshape(total, num_heads, HEAD_DIM_V).float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row.setdefault("rel_err_vs_torch", {})[name] = err
            if not err < 2e-2:
                row["notes"].append(f"{name}: rel err {err:.3g} vs PyTorch output")
        _enter(row, name, run, "")
    if row.get("_runs"):
        _time_rows(row, flops, rounds, sustained)
    results.append(row)


def bench_varlen_mixed(num_heads: int, lengths: list[int]) -> dict:
    """Ours on one ragged causal batch (no batched PyTorch equivalent): TFLOP/s."""
    from mla_multi.kernels.prefill import varlen_attention

    device, dtype = "cuda", torch.bfloat16
    total = sum(lengths)
    q = torch.randn(total, num_heads, HEAD_DIM_QK, device=device, dtype=dtype)
    k = torch.randn(total, num_heads, HEAD_DIM_QK, device=device, dtype=dtype)
    v = torch.randn(total, num_heads, HEAD_DIM_V, device=device, dtype=dtype)
    cu = torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    flops = 2.0 * num_heads * pairs * (HEAD_DIM_QK + HEAD_DIM_V)

    def run():
        return varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), HEAD_DIM_QK**-0.5, causal=True)

    ms = _bench(run)
    return {"num_heads": num_heads, "lengths": lengths, "ms": ms, "tflops": flops / ms / 1e9}


def bench_merge(num_tokens: int, num_heads: int, head_dim: int) -> dict:
    """merge_attn_states bandwidth (bf16 outputs, float32 LSE) beside the PyTorch formula."""
    from mla_multi.backends.reference import merge_attn_states_reference
    from mla_multi.kernels.merge import merge_attn_states

    device, dtype = "cuda", torch.bfloat16
    p_out = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype)
    s_out = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype)
    p_lse = torch.randn(num_heads, num_tokens, device=device)
    s_lse = torch.randn(num_heads, num_tokens, device=device)
    out = torch.empty_like(p_out)
    out_lse = torch.empty_like(p_lse)
    moved = 3 * p_out.numel() * p_out.element_size() + 3 * p_lse.numel() * 4
    ms = _bench(lambda: merge_attn_states(p_out, p_lse, s_out, s_lse, output=out, output_lse=out_lse))
    ms_torch = _bench(lambda: merge_attn_states_reference(p_out, p_lse, s_out, s_lse))
    return {
        "shape": [num_tokens, num_heads, head_dim], "ms": ms, "gb_per_s": moved / ms / 1e6,
        "ms_torch": ms_torch, "gb_per_s_torch": moved / ms_torch / 1e6,
    }  # fmt: skip


def format_table(results: list) -> str:
    lines = []
    for row in results:
        tf = row["tflops"]
        ours = {k: v for k, v in tf.items() if k.startswith("triton")}
        best_name = max(ours, key=ours.get) if ours else None
        best = ours.get(best_name, float("nan")) if best_name else float("nan")
        cudnn = tf.get("cudnn", float("nan"))
        flash = tf.get("flash", float("nan"))
        flashinfer = tf.get("flashinfer", float("nan"))
        shape = f"{row['batch']} x {row['seqlen']:>5}" + ("" if row.get("causal", True) else " full")
        lines.append(
            f"| {row['num_heads']:>3} | {shape} | {best:7.1f} ({best_name}) | {flashinfer:7.1f} | "
            f"{cudnn:7.1f} | {flash:7.1f} | {best / flashinfer:5.2f} | {best / cudnn:5.2f} | {best / flash:5.2f} |"
        )
        for name, value in sorted(ours.items()):
            if name != best_name:
                lines.append(f"|     |              | {value:7.1f} ({name}) | | | | {value / flashinfer:5.2f} | "
                             f"{value / cudnn:5.2f} | {value / flash:5.2f} |")
    header = (
        "| N | B x S | TRITON TFLOP/s (config) | FLASHINFER | cuDNN | flash (V pad) | TRITON/FLASHINFER | TRITON/cuDNN | "
        "TRITON/flash |\n|---|---|---|---|---|---|---|---|---|"
    )
    eager = ["Eager calls (host path included), µs:", "",
             "| N | B x S | TRITON (default) | FLASHINFER | cuDNN | TRITON/FLASHINFER time | TRITON/cuDNN time |",
             "|---|---|--:|--:|--:|--:|--:|"]
    for row in results:
        times = {name: ms * 1e3 for name, ms in row.get("eager_ms", {}).items()}
        ours, fi, cudnn = (times.get(name, float("nan")) for name in ("triton", "flashinfer", "cudnn"))
        shape = f"{row['batch']} x {row['seqlen']:>5}" + ("" if row.get("causal", True) else " full")
        eager.append(f"| {row['num_heads']:>3} | {shape} | {ours:8.1f} | {fi:8.1f} | {cudnn:8.1f} | {ours / fi:5.2f} | "
                     f"{ours / cudnn:5.2f} |")
    spread = []
    for row in results:
        rounds = row.get("ms_rounds", {})
        ours = rounds.get("triton")
        if not ours or len(ours) < 2:
            continue
        shape = f"{row['batch']} x {row['seqlen']:>5}" + ("" if row.get("causal", True) else " full")
        cells = []
        for peer in ("flashinfer", "cudnn"):
            ratios = [theirs / mine for theirs, mine in zip(rounds.get(peer, []), ours)]
            cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-")
        spread.append(f"| {row['num_heads']:>3} | {shape} | {len(ours)} | {cells[0]} | {cells[1]} |")
    if spread:
        spread = ["", "TRITON's speed over each round (captured, same round):", "",
                  "| N | B x S | rounds | TRITON/FLASHINFER | TRITON/cuDNN |", "|---|---|--:|--|--|"] + spread
    steady = ["", "Sustained replay (each kernel back to back, in turn; µs a call, SM MHz, W; the median round):", "",
              "| N | B x S | TRITON (default) | FLASHINFER | cuDNN | TRITON/FLASHINFER speed | TRITON/cuDNN speed |",
              "|---|---|--|--|--|--:|--:|"]
    for row in results:
        runs = row.get("sustained")
        if not runs:
            continue
        cells = [f"{runs[n][0] * 1e3:.1f} ({runs[n][1]:.0f}, {runs[n][2]:.0f})" if n in runs else "-"
                 for n in ("triton", "flashinfer", "cudnn")]
        ratios = [runs[n][0] / runs["triton"][0] if n in runs and "triton" in runs else float("nan")
                  for n in ("flashinfer", "cudnn")]
        shape = f"{row['batch']} x {row['seqlen']:>5}" + ("" if row.get("causal", True) else " full")
        steady.append(f"| {row['num_heads']:>3} | {shape} | {cells[0]} | {cells[1]} | {cells[2]} | {ratios[0]:.3f} | "
                      f"{ratios[1]:.3f} |")
    steady = steady if len(steady) > 5 else []
    return (header + "\n" + "\n".join(lines) + "\n\n" + "\n".join(eager) + "\n".join([""] + spread)
            + "\n".join([""] + steady))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--shapes", default="1x8192,4x2048,1x16384", help="BxS list")
    parser.add_argument(
        "--configs", default="", help="comma list of m<M>n<N>w<W>s<S>[tma]; empty = the platform's default"
    )
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every kernel this many times, in turn, and report each one's median")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="then replay every captured kernel back to back for this long, in turn, each round, "
                        "with the SM clock and power sampled (the steady state of a busy device)")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with PyTorch's output")
    parser.add_argument(
        "--extra",
        action="store_true",
        help="also: non-causal 128 x 8192 (a context chunk), a ragged causal batch, merge_attn_states bandwidth",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        from mla_multi.benchmarks import needs_gpu

        return needs_gpu("mla-multi bench prefill")
    configs = [None] + [parse_config(c) for c in args.configs.split(",") if c]
    heads = [int(h) for h in args.heads.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    results: list = []
    for num_heads in heads:
        for batch, seqlen in shapes:
            bench_case(num_heads, batch, seqlen, configs, results, check=not args.no_check, rounds=args.rounds,
                       sustained=args.sustained)
            torch.cuda.empty_cache()  # the case's tensors, freed as it returned
            row = results[-1]
            print(
                f"N={num_heads} B={batch} S={seqlen}: "
                + ", ".join(f"{k} {v:.1f}" for k, v in row["tflops"].items())
                + (f" | errs {row.get('rel_err_vs_torch')}" if row.get("rel_err_vs_torch") else "")
                + (f" | notes {row['notes']}" if row["notes"] else ""),
                flush=True,
            )
    extras = {}
    if args.extra:
        bench_case(128, 1, 8192, configs[:1], results, check=not args.no_check, causal=False)
        row = results[-1]
        print("non-causal N=128 S=8192: " + ", ".join(f"{k} {v:.1f}" for k, v in row["tflops"].items()), flush=True)
        extras["varlen"] = bench_varlen_mixed(128, [8192, 4096, 2048, 1024, 512, 300, 128, 77, 17, 1])
        print(f"ragged causal batch N=128: {extras['varlen']['tflops']:.1f} TFLOP/s", flush=True)
        extras["merge"] = bench_merge(16384, 128, 128)
        print(
            f"merge_attn_states 16384 x 128 x 128 bf16: {extras['merge']['gb_per_s']:.0f} GB/s "
            f"(PyTorch formula {extras['merge']['gb_per_s_torch']:.0f} GB/s)",
            flush=True,
        )
    device = torch.cuda.get_device_name()
    import triton

    print(f"\ndevice: {device}, torch {torch.__version__}, triton {triton.__version__}")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"device": device, "torch": torch.__version__, "results": results, "extras": extras}, handle, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
