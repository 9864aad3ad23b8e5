"""One conformance table: every public op's edge cases, each with its documented result, on every backend.

Rows (`CASES`) are the edge cases of the dense and sparse decode, prefill, sparse prefill, merge_attn_states,
the cache write / gather in every cache format (16-bit, FP8 e4m3fn with a per-tensor scale, the uint8
fp8_ds_mla layout) and the layer (`MLAAttention`); columns are the backends. Each row builds its inputs for a
column (dtype, device), runs the op, and checks the result row by row against float64 math written here (the
oracle), following the README's "Non-finite input and edge cases": a row with no valid token is exactly 0 with
LSE -inf, a NaN (or a score of +inf) that reaches a row's softmax makes that row and its LSE NaN, bad scales
and arguments are a ValueError naming the argument and what is accepted.

Columns:
* on the CPU, in process: REFERENCE (float32; the cache ops and the merge: their PyTorch versions);
* on the CPU, under Triton's interpreter (one child process, float16): TRITON (the Triton kernels);
* on the GPU (marked ``gpu``): every backend registered for the row's phase (bfloat16); one that is not
  installed, or does not take the row's configuration, must refuse it with its reasons (`NoBackendError` with
  reasons for it, or a ValueError saying what is accepted), which the table counts as "rejected".

A new cache format or backend joins by adding rows (or registering the backend), not files.
`python tests/test_conformance.py --table` prints the table (TRITON_INTERPRET=1 for the TRITON column).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import traceback
from collections.abc import Callable

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interpreter import print_results, run_interpreter_script  # noqa: E402

import mla_multi as mm  # noqa: E402
from mla_multi.registry import NoBackendError, names  # noqa: E402

NAN, INF = float("nan"), float("inf")
HEADS, LKV, ROPE, WIDTH = 2, 512, 64, 576
FP8 = torch.float8_e4m3fn
FP8_TOL = 6e-2  # an FP8 cache (and, on sm_90, the query rounded to e4m3 for the FP8 QK products)


class Rejected(Exception):
    """A backend refused a row's configuration with its reasons (the table's 'rejected')."""


@dataclasses.dataclass
class Column:
    backend: str  # a registered backend name, or for the ops outside the registry the implementation's name
    dtype: torch.dtype
    device: torch.device

    @property
    def tol(self) -> float:
        return 1e-4 if self.dtype in (torch.float32, torch.float64) else 2.5e-2

    def kernel_dtype(self) -> torch.dtype:
        """The dtype that selects the implementation of the ops outside the registry (merge, cache ops): their
        PyTorch version takes float64 on a GPU, the Triton kernels the column's dtype."""
        if self.backend == "REFERENCE" and self.device.type != "cpu":
            return torch.float64
        return self.dtype


@dataclasses.dataclass
class Case:
    name: str
    phase: str  # decode, sparse_decode, prefill, sparse_prefill, merge, cache, layer
    run: Callable[[Column], None]
    documented: str  # the documented result, in words (the table prints it)


CASES: list[Case] = []


def case(phase: str, documented: str):
    def register(fn):
        CASES.append(Case(fn.__name__.removeprefix("case_"), phase, fn, documented))
        return fn

    return register


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64) * scale


# --------------------------------------------------------------------------- float64 oracle and row checks


def attend64(q, keys, values, visible, scale, sink=None):
    """The oracle: q [M, N, D], keys [M, S, D], values [M, S, Dv], visible [M, S] (a position may repeat: it then
    counts twice) -> out [M, N, Dv], lse [M, N] in float64, by the policy: no visible key -> 0 and -inf; a NaN
    or +inf score among the visible -> NaN row and LSE; a sink s scales out by 1 / (1 + exp(s - lse))."""
    q, keys, values = q.double(), keys.double(), values.double()
    rows, heads = q.shape[0], q.shape[1]
    out = torch.zeros(rows, heads, values.shape[-1], dtype=torch.float64)
    lse = torch.full((rows, heads), -INF, dtype=torch.float64)
    for m in range(rows):
        seen = visible[m].nonzero().flatten()
        if seen.numel() == 0:
            continue
        for h in range(heads):
            scores = (keys[m, seen] @ q[m, h]) * scale
            if bool(torch.isnan(scores).any()) or bool((scores == INF).any()):
                out[m, h], lse[m, h] = NAN, NAN
                continue
            top = scores.max()
            if top == -INF:
                continue
            weights = torch.exp(scores - top)
            total = weights.sum()
            out[m, h] = (weights / total) @ values[m, seen]
            lse[m, h] = top + torch.log(total)
            if sink is not None:
                out[m, h] = out[m, h] * torch.sigmoid(lse[m, h] - float(sink[h]))
    return out, lse


def check_rows(out, lse, ref_out, ref_lse, tol, what=""):
    """Row by row: NaN where the oracle is NaN (out and LSE), exactly 0 and -inf where it has no token, else a
    relative error under `tol` and the LSE within `tol` (absolute) -- NaN never passes there."""
    assert out.shape == ref_out.shape, f"{what}out shape {tuple(out.shape)}, documented {tuple(ref_out.shape)}"
    if lse is not None:
        assert lse.shape == ref_lse.shape, f"{what}lse shape {tuple(lse.shape)}, documented {tuple(ref_lse.shape)}"
        assert lse.dtype == torch.float32, f"{what}lse dtype {lse.dtype}"
    out = out.detach().double().cpu().reshape(-1, out.shape[-1])
    ref_out = ref_out.reshape(-1, ref_out.shape[-1])
    ref_lse = ref_lse.reshape(-1)
    lse = None if lse is None else lse.detach().double().cpu().reshape(-1)
    for r in range(out.shape[0]):
        where = f"{what}row {r}"
        if bool(torch.isnan(ref_lse[r])):
            assert bool(torch.isnan(out[r]).all()), f"{where}: documented NaN, got {out[r, :4].tolist()}"
            if lse is not None:
                assert bool(torch.isnan(lse[r])), f"{where}: documented LSE NaN, got {float(lse[r])}"
        elif ref_lse[r] == -INF:
            assert bool((out[r] == 0).all()), f"{where}: documented 0 (no token), got {out[r, :4].tolist()}"
            if lse is not None:
                assert lse[r] == -INF, f"{where}: documented LSE -inf, got {float(lse[r])}"
        else:
            assert bool(torch.isfinite(out[r]).all()), f"{where}: documented finite, got {out[r, :4].tolist()}"
            norm = float(ref_out[r].norm())
            err = float((out[r] - ref_out[r]).norm()) / (norm if norm > 0 else 1.0)
            assert err < tol, f"{where}: relative error {err:.3g} >= {tol}"
            if lse is not None:
                assert abs(float(lse[r] - ref_lse[r])) < tol * max(1.0, abs(float(ref_lse[r]))), (
                    f"{where}: LSE {float(lse[r])}, documented {float(ref_lse[r])}")


def expect_error(fn, *needles: str, kind=ValueError):
    """`fn()` raises `kind` whose message names every one of `needles` (the argument, what is accepted)."""
    try:
        fn()
    except kind as error:
        message = str(error)
        for needle in needles:
            assert needle in message, f"the error does not name {needle!r}: {message}"
        return
    raise AssertionError(f"no {kind.__name__} naming {needles}")


def run_op(fn):
    """Call an op forced to a backend: a refusal of the configuration (NoBackendError with reasons for it, or a
    ValueError saying what the backend supports) becomes `Rejected`."""
    try:
        return fn()
    except NoBackendError as error:
        forced_reasons = error.reasons.get(error.forced, []) if error.forced else sum(error.reasons.values(), [])
        assert forced_reasons and all(reason.strip() for reason in forced_reasons), f"refused without reasons: {error}"
        raise Rejected(forced_reasons[0]) from error
    except ValueError as error:  # a backend's own refusal of a configuration must say what it supports
        message = str(error)
        assert "supported" in message or "accepted" in message, f"refused without saying what is accepted: {message}"
        raise Rejected(message.splitlines()[0]) from error


def poisoned(*shape, dtype, device):
    """An output-sized tensor of NaN: what a backend did not write stays visible."""
    return torch.full(shape, NAN, dtype=dtype, device=device)


# --------------------------------------------------------------------------- paged dense decode


def paged_cache(seq_lens, block_size, dtype, device, *, seed=0, k_scale=None, poison_tail=True):
    """A paged cache holding each request's rows; the positions past every seq_len are NaN (never read).
    Returns (cache, block_table, rows64 per request: the float64 values the cache holds, dequantised)."""
    blocks_per = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per) + 1
    storage = torch.float32 if dtype == FP8 else dtype
    cache = torch.full((num_blocks, block_size, WIDTH), NAN if poison_tail else 0.0, dtype=torch.float32)
    table = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    rows64 = []
    next_block = 1  # block 0 stays poisoned
    for b, n in enumerate(seq_lens):
        values = randn(n, WIDTH, seed=seed + b)
        if dtype == FP8:
            stored = (values / k_scale).clamp(-448, 448).to(FP8)
            rows64.append(stored.double() * k_scale)
        else:
            stored = values.to(storage)
            rows64.append(stored.double())
        for j in range(blocks_per[b]):
            table[b, j] = next_block + j
        flat = cache[next_block: next_block + blocks_per[b]].reshape(-1, WIDTH)
        flat[:n] = stored.float() if dtype != FP8 else stored.float()
        next_block += blocks_per[b]
    if dtype == FP8:
        cache = cache.nan_to_num(0.0).to(FP8)  # FP8 e4m3fn holds NaN, but a real cache's tail is stale data
    else:
        cache = cache.to(dtype)
    return cache.to(device), table.to(device), rows64


def decode_oracle(q_nope, q_pe, rows64, scale):
    """q [B, (Q,) N, *] -> out [B, (Q,) N, 512], lse, by `attend64` over each request's rows (causal for Q > 1)."""
    single = q_nope.dim() == 3
    qn, qp = (q_nope.unsqueeze(1), q_pe.unsqueeze(1)) if single else (q_nope, q_pe)
    q = torch.cat([qn, qp], -1).double().cpu()
    batch, q_len = q.shape[0], q.shape[1]
    outs, lses = [], []
    for b in range(batch):
        rows = rows64[b]
        n = rows.shape[0]
        keys = rows.unsqueeze(0).expand(q_len, n, WIDTH) if n else torch.zeros(q_len, 0, WIDTH, dtype=torch.float64)
        visible = torch.arange(n).unsqueeze(0) < (n - q_len + 1 + torch.arange(q_len)).unsqueeze(1)
        out, lse = attend64(q[b], keys, keys[..., :LKV], visible, scale)
        outs.append(out)
        lses.append(lse)
    if batch == 0:
        out = torch.zeros(0, q_len, HEADS, LKV, dtype=torch.float64)
        lse = torch.zeros(0, q_len, HEADS, dtype=torch.float64)
    else:
        out, lse = torch.stack(outs), torch.stack(lses)
    return (out.squeeze(1), lse.squeeze(1)) if single else (out, lse)


def decode_inputs(col, seq_lens, *, q_len=None, cache_dtype=None, k_scale=None, seed=0, block_size=16):
    cache, table, rows64 = paged_cache(seq_lens, block_size, cache_dtype or col.dtype, col.device, seed=seed,
                                       k_scale=k_scale)
    lead = (len(seq_lens),) if q_len is None else (len(seq_lens), q_len)
    q_nope = randn(*lead, HEADS, LKV, seed=seed + 100).to(col.dtype).to(col.device)
    q_pe = randn(*lead, HEADS, ROPE, seed=seed + 101).to(col.dtype).to(col.device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=col.device)
    return q_nope, q_pe, cache, table, seq, rows64


def dense_decode(col, q_nope, q_pe, cache, table, seq, scale, **kw):
    return run_op(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, scale, backend=col.backend,
                                            return_lse=True, **kw))


SCALE = WIDTH**-0.5


@case("decode", "each request over its seq_len rows (positions past it poisoned, never read); seq_len 0 -> 0, -inf")
def case_decode_basic(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [5, 0, 17])
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE)
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), col.tol)


@case("decode", "Q = 2 query tokens a request, causal bottom-right")
def case_decode_multi_token(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [3, 1, 9], q_len=2, seed=3)
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE)
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), col.tol)


@case("decode", "seq_lens int64 taken as int32")
def case_decode_int64_lengths(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [4, 11], seed=5)
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq.long(), SCALE)
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), col.tol)


@case("decode", "an empty batch [0, N, 512] -> empty out and lse")
def case_decode_empty_batch(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4])
    out, lse = dense_decode(col, q_nope[:0], q_pe[:0], cache, table[:0], seq[:0], SCALE)
    assert tuple(out.shape) == (0, HEADS, LKV) and tuple(lse.shape) == (0, HEADS)


@case("decode", "an empty batch of a 4-dim query [0, Q, N, 512] -> empty out [0, Q, N, 512] and lse [0, Q, N]")
def case_decode_empty_batch_4d(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4], q_len=3)
    out, lse = dense_decode(col, q_nope[:0], q_pe[:0], cache, table[:0], seq[:0], SCALE)
    assert tuple(out.shape) == (0, 3, HEADS, LKV) and tuple(lse.shape) == (0, 3, HEADS)


@case("decode", "NaN in one query row -> that row (and its LSE) NaN, the others exact")
def case_decode_nan_query(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [6, 9], seed=7)
    q_nope[1, 0, 3] = NAN
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE)
    ref_out, ref_lse = decode_oracle(q_nope, q_pe, rows64, SCALE)
    assert bool(torch.isnan(ref_lse[1, 0])) and bool(torch.isfinite(ref_lse[0]).all())
    check_rows(out, lse, ref_out, ref_lse, col.tol)


@case("decode", "NaN in a cache row a request reads -> that request's rows NaN; other requests exact")
def case_decode_nan_cache_row(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [6, 9], seed=9)
    block = int(table[1, 0])
    cache[block, 2, 10] = NAN
    rows64[1][2, 10] = NAN
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE)
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), col.tol)


@case("decode", "FP8 e4m3fn cache, float k_scale, then a tensor k_scale: dequantised values")
def case_decode_fp8(col):
    q_nope, q_pe, cache, table, seq, rows64 = decode_inputs(col, [7, 20], cache_dtype=FP8, k_scale=0.05, seed=11)
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE, k_scale=0.05)
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), max(col.tol, FP8_TOL))
    out, lse = dense_decode(col, q_nope, q_pe, cache, table, seq, SCALE,
                            k_scale=torch.tensor([0.05], device=col.device))
    check_rows(out, lse, *decode_oracle(q_nope, q_pe, rows64, SCALE), max(col.tol, FP8_TOL))


@case("decode", "scale inf / NaN / 0 / -1 -> ValueError naming scale")
def case_decode_bad_scale(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4])
    for bad in (INF, NAN, 0.0, -1.0):
        expect_error(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, bad, backend=col.backend),
                     "scale=", "finite positive")


@case("decode", "k_scale inf / 0 / 'x' / 2-element -> ValueError naming k_scale; a tensor k_scale turned negative "
                "after a first call (the cached plan) -> ValueError naming k_scale")
def case_decode_bad_k_scale(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4, 9], cache_dtype=FP8, k_scale=0.1)
    for bad in (INF, 0.0, "x", torch.tensor([0.1, 0.1]), torch.tensor([INF])):
        expect_error(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, SCALE, k_scale=bad,
                                               backend=col.backend), "k_scale=", "accepted")
    k_scale = torch.tensor([0.1], device=col.device)
    run_op(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, SCALE, k_scale=k_scale, backend=col.backend))
    k_scale.fill_(-0.1)  # same layout: the plan is reused, the value checked again
    if col.device.type == "cpu" or mm.checks.data_checks_enabled(col.device):
        expect_error(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, SCALE, k_scale=k_scale,
                                               backend=col.backend), "k_scale=", "-0.1")
        # a planned decode (plan_mla_decode / run) checks the value on every run too
        k_scale.fill_(0.1)
        plan = run_op(lambda: mm.ops.plan_mla_decode(q_nope, q_pe, cache, table, seq, SCALE, k_scale=k_scale,
                                                     backend=col.backend))
        plan.run(q_nope, q_pe, cache, table, seq, k_scale=k_scale)
        k_scale.fill_(INF)
        expect_error(lambda: plan.run(q_nope, q_pe, cache, table, seq, k_scale=k_scale), "k_scale=", "inf")


@case("decode", "k_scale with a cache that is not FP8 -> ValueError naming k_scale (refused, never applied)")
def case_decode_k_scale_on_16bit_cache(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4])
    for k_scale in (2.0, torch.tensor([2.0], device=col.device)):
        expect_error(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, SCALE, k_scale=k_scale,
                                               backend=col.backend), "k_scale=", "not FP8")


@case("decode", "backend=['TRITON'] or 3 -> ValueError naming backend and listing the names")
def case_decode_bad_backend_argument(col):
    q_nope, q_pe, cache, table, seq, _ = decode_inputs(col, [4])
    for bad in ([col.backend], 3):
        expect_error(lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, seq, SCALE, backend=bad),
                     "backend=", "REFERENCE", "TRITON")


# --------------------------------------------------------------------------- sparse decode


def sparse_cache(col, fmt, seed=0, num_blocks=3, block_size=16):
    """(cache, rows64 [slots, 576] float64 as the backends read them, k_scale) in format `fmt`."""
    values = randn(num_blocks * block_size, WIDTH, seed=seed)
    if fmt == "fp8_ds_mla":
        from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla

        cache = torch.zeros(num_blocks, block_size, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=col.device)
        slots = torch.arange(num_blocks * block_size, device=col.device)
        mm.ops.concat_and_cache_mla(values[:, :LKV].to(torch.bfloat16).to(col.device),
                                    values[:, LKV:].to(torch.bfloat16).to(col.device), cache, slots)
        return cache, dequantize_fp8_ds_mla(cache.reshape(-1, FP8_DS_MLA_BYTES).cpu(), torch.float64), None
    if fmt == "fp8":
        stored = (values / 0.05).clamp(-448, 448).to(FP8)
        return stored.reshape(num_blocks, block_size, WIDTH).to(col.device), stored.double() * 0.05, 0.05
    stored = values.to(col.dtype)
    return stored.reshape(num_blocks, block_size, WIDTH).to(col.device), stored.double(), None


def sparse_indices(tokens, topk, num_slots, seed=0, pad_every=3, duplicate=True):
    """int32 [tokens, topk]: slots with -1 padding and, with `duplicate`, a repeated slot in each row."""
    g = gen(seed)
    idx = torch.randint(0, num_slots, (tokens, topk), generator=g, dtype=torch.int64)
    if duplicate and topk > 2:
        idx[:, 1] = idx[:, 0]
    if pad_every:
        idx[:, ::pad_every] = -1
    return idx.to(torch.int32)


def sparse_oracle(q_nope, q_pe, rows64, idx, scale, lengths=None, sink=None, out_of_range_is_none=False):
    q = torch.cat([q_nope, q_pe], -1).double().cpu()
    idx = idx.cpu().long()
    tokens, topk = idx.shape
    valid = (idx >= 0) & (idx < rows64.shape[0])
    if lengths is not None:
        valid &= torch.arange(topk).unsqueeze(0) < lengths.cpu().long().unsqueeze(1)
    gathered = rows64[idx.clamp(0, max(rows64.shape[0] - 1, 0))] if rows64.shape[0] else torch.zeros(
        tokens, topk, WIDTH, dtype=torch.float64)
    return attend64(q, gathered, gathered[..., :LKV], valid, scale, None if sink is None else sink.cpu().double())


def sparse_decode(col, *args, **kw):
    return run_op(lambda: mm.ops.mla_sparse_decode(*args, backend=col.backend, return_lse=True, **kw))


def sparse_queries(col, tokens, seed=0, lead=None):
    shape = lead if lead is not None else (tokens,)
    return (randn(*shape, HEADS, LKV, seed=seed).to(col.dtype).to(col.device),
            randn(*shape, HEADS, ROPE, seed=seed + 1).to(col.dtype).to(col.device))


def _sparse_format_case(fmt):
    def run(col):
        cache, rows64, k_scale = sparse_cache(col, fmt, seed=21)
        q_nope, q_pe = sparse_queries(col, 4, seed=22)
        idx = sparse_indices(4, 8, rows64.shape[0], seed=23)
        idx[2] = -1  # a token with no valid index
        out, lse = sparse_decode(col, q_nope, q_pe, cache, idx.to(col.device), SCALE, k_scale=k_scale)
        tol = col.tol if fmt == "16bit" else max(col.tol, FP8_TOL)
        check_rows(out, lse, *sparse_oracle(q_nope, q_pe, rows64, idx, SCALE), tol)

    return run


for _fmt, _words in (("16bit", "the model dtype"), ("fp8", "FP8 e4m3fn with k_scale 0.05"),
                     ("fp8_ds_mla", "uint8 fp8_ds_mla, written by concat_and_cache_mla")):
    CASES.append(Case(f"sparse_decode_{_fmt}", "sparse_decode", _sparse_format_case(_fmt),
                      f"{_words} cache; -1 padding, a duplicate (counts twice), a token of only -1 -> 0, -inf"))


@case("sparse_decode", "[B, Q, N, 512] queries with [B, Q, topk] indices and topk_length [B] (0 for one request)")
def case_sparse_decode_4d_lengths(col):
    cache, rows64, _ = sparse_cache(col, "16bit", seed=31)
    q_nope, q_pe = sparse_queries(col, 0, seed=32, lead=(2, 2))
    idx = sparse_indices(4, 8, rows64.shape[0], seed=33).reshape(2, 2, 8)
    lengths = torch.tensor([5, 0], dtype=torch.int32)
    out, lse = sparse_decode(col, q_nope, q_pe, cache, idx.to(col.device), SCALE, topk_length=lengths.to(col.device))
    ref_out, ref_lse = sparse_oracle(q_nope.reshape(4, HEADS, LKV), q_pe.reshape(4, HEADS, ROPE), rows64,
                                     idx.reshape(4, 8), SCALE, lengths.repeat_interleave(2))
    check_rows(out, lse, ref_out.reshape(2, 2, HEADS, LKV), ref_lse.reshape(2, 2, HEADS), col.tol)


@case("sparse_decode", "empty batches: [0, N, 512] and [0, Q, N, 512], every cache format -> empty outputs of the query's lead shape")
def case_sparse_decode_empty(col):
    for fmt in ("16bit", "fp8", "fp8_ds_mla"):
        cache, _, k_scale = sparse_cache(col, fmt)
        for lead in ((0,), (0, 4)):
            q_nope, q_pe = sparse_queries(col, 0, lead=lead)
            idx = torch.zeros(*lead, 8, dtype=torch.int32, device=col.device)
            out, lse = sparse_decode(col, q_nope, q_pe, cache, idx, SCALE, k_scale=k_scale)
            assert tuple(out.shape) == (*lead, HEADS, LKV) and tuple(lse.shape) == (*lead, HEADS), fmt


@case("sparse_decode", "attn_sink [+inf, -inf]: head 0 all 0 (LSE unchanged), head 1 as without a sink; "
                       "a NaN sink -> NaN rows of that head (a token of no index keeps 0, -inf)")
def case_sparse_decode_sinks(col):
    cache, rows64, _ = sparse_cache(col, "16bit", seed=41)
    q_nope, q_pe = sparse_queries(col, 3, seed=42)
    idx = sparse_indices(3, 8, rows64.shape[0], seed=43)
    idx[1] = -1
    for sink in (torch.tensor([INF, -INF]), torch.tensor([NAN, 0.5])):
        out, lse = sparse_decode(col, q_nope, q_pe, cache, idx.to(col.device), SCALE,
                                 attn_sink=sink.to(col.device))
        ref_out, ref_lse = sparse_oracle(q_nope, q_pe, rows64, idx, SCALE, sink=sink)
        # the sink leaves the LSE as it is: the documented LSE is the one without it
        _, plain_lse = sparse_oracle(q_nope, q_pe, rows64, idx, SCALE)
        if bool(torch.isnan(sink[0])):
            assert bool(torch.isnan(ref_out[0, 0]).all())
            ref_lse = ref_lse.clone()
            ref_lse[:, 0] = torch.where(plain_lse[:, 0] == -INF, -INF, NAN)
            check_rows(out, None, ref_out, ref_lse, col.tol)
            finite = torch.isfinite(plain_lse)
            assert torch.allclose(lse.double().cpu()[finite], plain_lse[finite], atol=col.tol)
        else:
            check_rows(out[:, 1:], lse[:, 1:], ref_out[:, 1:], ref_lse[:, 1:], col.tol)
            assert bool((out[:, 0] == 0).all()), "a sink of +inf takes all the mass: 0"
            finite = torch.isfinite(plain_lse[:, 0])
            assert torch.allclose(lse[:, 0].double().cpu()[finite], plain_lse[finite, 0], atol=col.tol)


@case("sparse_decode", "NaN / inf in a query row -> that row NaN (LSE NaN); NaN in a cache row no index names -> "
                       "nothing")
def case_sparse_decode_non_finite(col):
    cache, rows64, _ = sparse_cache(col, "16bit", seed=51)
    q_nope, q_pe = sparse_queries(col, 3, seed=52)
    idx = sparse_indices(3, 8, rows64.shape[0] - 1, seed=53)  # the last slot is never named
    cache.reshape(-1, WIDTH)[-1] = NAN
    q_nope[0, 1, 7] = NAN
    q_pe[2, 0, 1] = INF
    out, lse = sparse_decode(col, q_nope, q_pe, cache, idx.to(col.device), SCALE)
    ref_out, ref_lse = sparse_oracle(q_nope, q_pe, rows64, idx, SCALE)
    assert bool(torch.isnan(ref_lse[0, 1])) and bool(torch.isfinite(ref_lse[1]).all())
    check_rows(out, lse, ref_out, ref_lse, col.tol)


@case("sparse_decode", "scale 1e30 with a duplicated top index: all the mass on the top row, 2 copies -> its value")
def case_sparse_decode_huge_scale_duplicate(col):
    cache, rows64, _ = sparse_cache(col, "16bit", seed=61)
    q_nope, q_pe = sparse_queries(col, 2, seed=62)
    idx = sparse_indices(2, 6, rows64.shape[0], seed=63, pad_every=0, duplicate=False)
    q = torch.cat([q_nope, q_pe], -1).double().cpu()
    for t in range(2):  # put the top-scoring index (of head 0 and 1 alike: pick by head 0) twice
        scores = rows64[idx[t].long()] @ q[t, 0]
        idx[t, 1] = idx[t, int(scores.argmax())]
    out, lse = sparse_decode(col, q_nope, q_pe, cache, idx.to(col.device), 1e30)
    ref_out, _ = sparse_oracle(q_nope, q_pe, rows64, idx, 1e30)
    # LSE ~ 1e30 * score: compare the outputs only, and that the LSE is finite
    check_rows(out, None, ref_out, torch.zeros(ref_out.shape[:-1], dtype=torch.float64), col.tol)
    assert bool(torch.isfinite(lse).all())


@case("sparse_decode", "bad scale / k_scale / backend -> ValueError naming it; a tensor k_scale made negative "
                       "after a first call (the cached plan) -> ValueError; k_scale with a 16-bit or fp8_ds_mla "
                       "cache -> ValueError naming k_scale")
def case_sparse_decode_bad_arguments(col):
    cache, rows64, _ = sparse_cache(col, "fp8")
    q_nope, q_pe = sparse_queries(col, 2)
    idx = sparse_indices(2, 8, rows64.shape[0]).to(col.device)

    def call(scale=SCALE, cache=cache, backend=col.backend, **kw):
        return mm.ops.mla_sparse_decode(q_nope, q_pe, cache, idx, scale, backend=backend, **kw)

    for bad in (INF, NAN, 0.0, -2.0, "x"):
        expect_error(lambda: call(scale=bad, k_scale=0.05), "scale=", "finite positive")
    for bad in (INF, -1.0, "x", torch.tensor([NAN])):
        expect_error(lambda: call(k_scale=bad), "k_scale=", "accepted")
    expect_error(lambda: call(k_scale=0.05, backend=["TRITON"]), "backend=", "REFERENCE", "TRITON")
    k_scale = torch.tensor([0.05], device=col.device)
    run_op(lambda: call(k_scale=k_scale))
    k_scale.fill_(-0.05)
    if col.device.type == "cpu" or mm.checks.data_checks_enabled(col.device):
        expect_error(lambda: call(k_scale=k_scale), "k_scale=", "-0.05")
    cache16, _, _ = sparse_cache(col, "16bit")
    expect_error(lambda: call(cache=cache16, k_scale=2.0), "k_scale=", "not FP8")
    ds, _, _ = sparse_cache(col, "fp8_ds_mla")
    expect_error(lambda: call(cache=ds, k_scale=2.0), "k_scale=", "fp8_ds_mla")


# --------------------------------------------------------------------------- sparse prefill


def sparse_prefill(col, *args, **kw):
    return run_op(lambda: mm.ops.mla_sparse_prefill(*args, backend=col.backend, return_lse=True, **kw))


@case("sparse_prefill", "rows of kv named by the indices; -1 and >= S_kv name none; a token of none -> 0, -inf; "
                        "topk_length")
def case_sparse_prefill_basic(col):
    kv64 = randn(20, WIDTH, seed=71)
    kv = kv64.to(col.dtype).to(col.device)
    q_nope, q_pe = sparse_queries(col, 4, seed=72)
    idx = sparse_indices(4, 8, 24, seed=73)  # some >= 20: none
    idx[3] = -1
    lengths = torch.tensor([8, 3, 0, 8], dtype=torch.int32)
    out, lse = sparse_prefill(col, q_nope, q_pe, kv, idx.to(col.device), SCALE, topk_length=lengths.to(col.device))
    check_rows(out, lse, *sparse_oracle(q_nope, q_pe, kv.double().cpu(), idx, SCALE, lengths), col.tol)


@case("sparse_prefill", "kv [0, 576] (no rows) -> every token 0, -inf; T = 0 -> empty; indices [T, 0] -> ValueError naming topk")
def case_sparse_prefill_empty(col):
    q_nope, q_pe = sparse_queries(col, 3, seed=81)
    out, lse = sparse_prefill(col, q_nope, q_pe, torch.zeros(0, WIDTH, dtype=col.dtype, device=col.device),
                              sparse_indices(3, 8, 4).to(col.device), SCALE)
    check_rows(out, lse, torch.zeros(3, HEADS, LKV, dtype=torch.float64), torch.full((3, HEADS), -INF), col.tol)
    kv = randn(5, WIDTH).to(col.dtype).to(col.device)
    expect_error(lambda: mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, torch.zeros(3, 0, dtype=torch.int32,
                                                                                 device=col.device), SCALE,
                                                   backend=col.backend), "topk=0", "positive")
    out, lse = sparse_prefill(col, q_nope[:0], q_pe[:0], kv, torch.zeros(0, 8, dtype=torch.int32, device=col.device),
                              SCALE)
    assert tuple(out.shape) == (0, HEADS, LKV) and tuple(lse.shape) == (0, HEADS)


@case("sparse_prefill", "NaN in a query row -> that row NaN; a sink of +inf -> 0; bad scale / backend -> ValueError")
def case_sparse_prefill_edges(col):
    kv64 = randn(16, WIDTH, seed=91)
    kv = kv64.to(col.dtype).to(col.device)
    q_nope, q_pe = sparse_queries(col, 3, seed=92)
    q_nope[1, 0, 0] = NAN
    idx = sparse_indices(3, 8, 16, seed=93)
    sink = torch.tensor([INF, -INF])
    out, lse = sparse_prefill(col, q_nope, q_pe, kv, idx.to(col.device), SCALE, attn_sink=sink.to(col.device))
    ref_out, ref_lse = sparse_oracle(q_nope, q_pe, kv.double().cpu(), idx, SCALE, sink=sink)
    assert bool((out[[0, 2], 0] == 0).all())
    check_rows(out[:, 1:], lse[:, 1:], ref_out[:, 1:], ref_lse[:, 1:], col.tol)
    assert bool(torch.isnan(out[1, 0]).all()) and bool(torch.isnan(lse[1, 0])), "a NaN query: NaN row and LSE"
    for bad in (INF, NAN, -1.0):
        expect_error(lambda: mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, idx.to(col.device), bad,
                                                       backend=col.backend), "scale=", "finite positive")
    expect_error(lambda: mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, idx.to(col.device), SCALE, backend=("TRITON",)),
                 "backend=", "REFERENCE")


# --------------------------------------------------------------------------- dense prefill

QK, V = 192, 128


def prefill_oracle(q, k, v, cu_q, cu_k, scale, causal):
    q64, k64, v64 = q.double().cpu(), k.double().cpu(), v.double().cpu()
    out = torch.zeros(q.shape[0], q.shape[1], V, dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), -INF, dtype=torch.float64)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        for h in range(q.shape[1]):
            keys = k64[k0:k1, h].unsqueeze(0).expand(lq, lk, QK)
            values = v64[k0:k1, h].unsqueeze(0).expand(lq, lk, V)
            visible = torch.ones(lq, lk, dtype=torch.bool)
            if causal:
                visible = torch.arange(lk).unsqueeze(0) <= (torch.arange(lq) + lk - lq).unsqueeze(1)
            o, l = attend64(q64[q0:q1, h:h + 1], keys, values, visible, scale)
            out[q0:q1, h], lse[q0:q1, h] = o[:, 0], l[:, 0]
    return out, lse


def prefill_inputs(col, lens_q, lens_k, seed=0):
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = randn(int(cu_q[-1]), HEADS, QK, seed=seed).to(col.dtype).to(col.device)
    k = randn(int(cu_k[-1]), HEADS, QK, seed=seed + 1).to(col.dtype).to(col.device)
    v = randn(int(cu_k[-1]), HEADS, V, seed=seed + 2).to(col.dtype).to(col.device)
    return q, k, v, cu_q, cu_k, max(lens_q + [0]), max(lens_k + [0])


def dense_prefill(col, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    out, lse = run_op(lambda: mm.ops.mla_prefill(q, k, v, cu_q.to(col.device), cu_k.to(col.device), max_q, max_k,
                                                 scale, causal=causal, return_lse=True, backend=col.backend))
    return out, lse.transpose(0, 1)  # [N, Tq] -> [Tq, N], row by row


@case("prefill", "causal bottom-right; a sequence without queries, one with fewer queries than keys")
def case_prefill_causal(col):
    q, k, v, cu_q, cu_k, mq, mk = prefill_inputs(col, [3, 0, 2], [3, 4, 5], seed=101)
    out, lse = dense_prefill(col, q, k, v, cu_q, cu_k, mq, mk, QK**-0.5, True)
    check_rows(out, lse, *prefill_oracle(q, k, v, cu_q, cu_k, QK**-0.5, True), col.tol)


@case("prefill", "non-causal; a sequence without keys -> its rows 0, -inf; cu_seqlens int64 taken alike")
def case_prefill_no_keys_int64(col):
    q, k, v, cu_q, cu_k, mq, mk = prefill_inputs(col, [2, 3], [4, 0], seed=111)
    for cu_dtype in (torch.int32, torch.int64):
        out, lse = dense_prefill(col, q, k, v, cu_q.to(cu_dtype), cu_k.to(cu_dtype), mq, mk, QK**-0.5, False)
        check_rows(out, lse, *prefill_oracle(q, k, v, cu_q, cu_k, QK**-0.5, False), col.tol)


@case("prefill", "no tokens at all -> empty out [0, N, V] and lse [N, 0]")
def case_prefill_empty(col):
    q, k, v, cu_q, cu_k, _, _ = prefill_inputs(col, [0], [0])
    out, lse = dense_prefill(col, q, k, v, cu_q, cu_k, 0, 0, QK**-0.5, True)
    assert tuple(out.shape) == (0, HEADS, V) and tuple(lse.shape) == (0, HEADS)


@case("prefill", "NaN in a query row -> that row NaN; bad scale / backend -> ValueError naming it")
def case_prefill_edges(col):
    q, k, v, cu_q, cu_k, mq, mk = prefill_inputs(col, [3, 2], [3, 4], seed=121)
    q[1, 1, 5] = NAN
    out, lse = dense_prefill(col, q, k, v, cu_q, cu_k, mq, mk, QK**-0.5, True)
    check_rows(out, lse, *prefill_oracle(q, k, v, cu_q, cu_k, QK**-0.5, True), col.tol)
    for bad in (INF, NAN, 0.0):
        expect_error(lambda: mm.ops.mla_prefill(q, k, v, cu_q.to(col.device), cu_k.to(col.device), mq, mk, bad,
                                                backend=col.backend), "scale=", "finite positive")
    expect_error(lambda: mm.ops.mla_prefill(q, k, v, cu_q.to(col.device), cu_k.to(col.device), mq, mk, 0.1,
                                            backend={"TRITON"}), "backend=", "REFERENCE")


# --------------------------------------------------------------------------- merge_attn_states


def merge_oracle(p_out, p_lse, s_out, s_lse):
    """Per row: LSE +inf counts as -inf, a NaN LSE makes the row NaN, both -inf -> 0 and -inf."""
    p_out, s_out = p_out.double().cpu(), s_out.double().cpu()
    p_lse, s_lse = p_lse.double().cpu().t(), s_lse.double().cpu().t()  # [T, N]
    p_lse = p_lse.masked_fill(p_lse == INF, -INF)
    s_lse = s_lse.masked_fill(s_lse == INF, -INF)
    out = torch.zeros_like(p_out)
    lse = torch.full_like(p_lse, -INF)
    for t in range(p_out.shape[0]):
        for h in range(p_out.shape[1]):
            a, b = float(p_lse[t, h]), float(s_lse[t, h])
            if math.isnan(a) or math.isnan(b):
                out[t, h], lse[t, h] = NAN, NAN
                continue
            top = max(a, b)
            if top == -INF:
                continue
            wa, wb = math.exp(a - top), math.exp(b - top)
            out[t, h] = (wa * p_out[t, h] if wa else 0) + (wb * s_out[t, h] if wb else 0)
            out[t, h] /= wa + wb
            lse[t, h] = top + math.log(wa + wb)
    return out, lse


@case("merge", "LSE +inf counts as -inf; both -inf -> 0, -inf (whatever the outputs hold); a NaN LSE -> NaN row; "
               "T = 0 -> empty")
def case_merge(col):
    dtype = col.kernel_dtype()
    p_out = randn(4, HEADS, 32, seed=131).to(dtype).to(col.device)
    s_out = randn(4, HEADS, 32, seed=132).to(dtype).to(col.device)
    p_lse = randn(HEADS, 4, seed=133).float()
    s_lse = randn(HEADS, 4, seed=134).float()
    p_lse[0, 1], s_lse[0, 1] = -INF, -INF  # no keys on either side
    p_out[1, 0] = NAN  # garbage on the side without keys
    p_lse[1, 1], s_lse[1, 1] = INF, -INF
    p_lse[0, 2] = NAN
    s_lse[1, 3] = -INF
    p_lse, s_lse = p_lse.to(col.device), s_lse.to(col.device)
    out, lse = mm.ops.merge_attn_states(p_out, p_lse, s_out, s_lse)
    ref_out, ref_lse = merge_oracle(p_out, p_lse, s_out, s_lse)
    check_rows(out, lse.t(), ref_out, ref_lse, col.tol)
    out, lse = mm.ops.merge_attn_states(p_out[:0], p_lse[:, :0], s_out[:0], s_lse[:, :0])
    assert tuple(out.shape) == (0, HEADS, 32) and tuple(lse.shape) == (HEADS, 0)


# --------------------------------------------------------------------------- cache write / gather


def _cache_format_case(fmt):
    def run(col):
        dtype = col.kernel_dtype()
        tokens = 6
        kv_c = randn(tokens, LKV, seed=141).to(dtype).to(col.device)
        k_pe = randn(tokens, ROPE, seed=142).to(dtype).to(col.device)
        slots = torch.tensor([3, -1, 17, 40, -5, 8], device=col.device)
        if fmt == "fp8_ds_mla":
            from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla

            cache = torch.full((3, 16, FP8_DS_MLA_BYTES), 0xAB, dtype=torch.uint8, device=col.device)
            before = cache.clone()
            mm.ops.concat_and_cache_mla(kv_c[:0], k_pe[:0], cache, slots[:0])  # zero tokens: a no-op
            assert torch.equal(cache, before)
            mm.ops.concat_and_cache_mla(kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16), cache, slots)
            flat = cache.reshape(-1, FP8_DS_MLA_BYTES).cpu()
            written = slots.cpu() >= 0
            rows = dequantize_fp8_ds_mla(flat[slots.cpu()[written]], torch.float64)
            expected = torch.cat([kv_c, k_pe], -1).double().cpu()[written]
            err = float((rows - expected).norm() / expected.norm())
            assert err < 6e-2, f"fp8_ds_mla round trip relative error {err:.3g}"
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[slots.cpu()[written]] = False
            assert bool((flat[untouched] == 0xAB).all()), "a skipped (negative) slot or another row was written"
            expect_error(lambda: mm.ops.concat_and_cache_mla(kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16), cache,
                                                             slots, scale=0.5), "scale=")
            return
        cache_dtype = FP8 if fmt == "fp8" else dtype
        scale = 0.05 if fmt == "fp8" else None
        cache = torch.zeros(3, 16, WIDTH, dtype=torch.float32, device=col.device).to(cache_dtype)
        before = cache.clone()
        mm.ops.concat_and_cache_mla(kv_c[:0], k_pe[:0], cache, slots[:0], scale=scale)  # zero tokens: a no-op
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
        mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale=scale)
        table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=col.device)
        gathered = mm.ops.gather_cache(cache, table, torch.tensor([0], device=col.device),
                                       torch.tensor([48], device=col.device), scale=scale,
                                       out_dtype=torch.float32 if fmt == "fp8" else None)
        expected = torch.zeros(48, WIDTH, dtype=torch.float64)
        written = slots.cpu() >= 0
        expected[slots.cpu()[written]] = torch.cat([kv_c, k_pe], -1).double().cpu()[written]
        tol = 6e-2 if fmt == "fp8" else col.tol
        err = float((gathered.double().cpu() - expected).norm() / expected.norm())
        assert err < tol, f"write + gather relative error {err:.3g}"
        empty = mm.ops.gather_cache(cache, table[:0], table.new_zeros(0), table.new_zeros(0), scale=scale)
        assert tuple(empty.shape) == (0, WIDTH)
        if fmt == "fp8":
            for bad in (INF, 0.0, NAN, "x"):
                expect_error(lambda: mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale=bad), "scale=")
                expect_error(lambda: mm.ops.gather_cache(cache, table, table.new_zeros(1), table.new_full((1,), 4),
                                                         scale=bad), "scale=")
        else:
            expect_error(lambda: mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale=2.0), "scale=", "not FP8")
            expect_error(lambda: mm.ops.gather_cache(cache, table, table.new_zeros(1), table.new_full((1,), 4),
                                                     scale=2.0), "scale=", "not FP8")

    return run


for _fmt, _words in (("16bit", "a cache of the model dtype"), ("fp8", "an FP8 e4m3fn cache with scale 0.05"),
                     ("fp8_ds_mla", "a uint8 fp8_ds_mla cache")):
    CASES.append(Case(f"cache_{_fmt}", "cache", _cache_format_case(_fmt),
                      f"{_words}: zero tokens a no-op; negative slots skipped; rows read back (gather_cache, or the "
                      "format's dequantiser); a scale not finite positive, or on a cache that is not FP8 -> ValueError"))


# --------------------------------------------------------------------------- the layer


@case("layer", "MLAAttention: prefills, then decodes with a padding row of seq_len 0, against naive float64 MLA; "
               "kv_cache_scale inf -> ValueError naming it")
def case_layer(col):
    from mla_multi.testing import PagedScenario, relative_error

    dims = mm.MLADims.deepseek_v3(num_heads=HEADS)
    weight = (randn(HEADS * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, seed=151)
              / dims.kv_lora_rank**0.5).to(col.dtype).to(col.device)
    scale = dims.qk_head_dim**-0.5
    prefill_backend = col.backend if col.backend in names("prefill") else None

    def make(**kw):
        return mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=256, max_num_seqs=4,
                               workspace_tokens=64, prefill_backend=prefill_backend, decode_backend=col.backend, **kw)

    layer = run_op(make)
    scenario = PagedScenario(dims, 16, 16, col.device, col.dtype, seed=152)
    cache = torch.full((16, 16, dims.kv_cache_width), NAN, dtype=col.dtype, device=col.device)
    for requests in ([(0, 5), (1, 3)], [(0, 1), (5, 0), (1, 1)]):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        out = run_op(lambda: layer.forward(q, kv_c, k_pe, cache, metadata))
        ref = scenario.reference(requests, q, scale, weight)
        assert out.shape == ref.shape
        for r in range(out.shape[0]):
            err = relative_error(out[r], ref[r])
            assert err < col.tol * 2, f"layer step {requests} row {r}: relative error {err:.3g}"
    expect_error(lambda: make(kv_cache_dtype=FP8, kv_cache_scale=INF), "kv_cache_scale=")


# --------------------------------------------------------------------------- running the table


def backends_for(phase: str, device: torch.device) -> list[str]:
    """The table's columns for a phase: on the CPU REFERENCE (in process) or TRITON (interpreter child); on a GPU
    every registered backend of the phase (the ops outside the registry: their Triton and PyTorch versions)."""
    registry_phase = {"layer": "decode"}.get(phase, phase)
    if device.type == "cpu":
        from mla_multi.kernels import interpreter_active

        return ["TRITON"] if interpreter_active() else ["REFERENCE"]
    if registry_phase in ("merge", "cache"):
        return ["TRITON", "REFERENCE"]
    return list(names(registry_phase))


def run_cell(item: Case, column: Column) -> str:
    """'pass', 'rejected: <reason>' or 'FAIL: <traceback>' for one case on one backend."""
    try:
        item.run(column)
    except Rejected as reason:
        return f"rejected: {reason}"
    except Exception:
        return "FAIL: " + traceback.format_exc()[-3000:]
    return "pass"


def cpu_column() -> Column:
    from mla_multi.kernels import interpreter_active

    if interpreter_active():
        return Column("TRITON", torch.float16, torch.device("cpu"))
    return Column("REFERENCE", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("item", CASES, ids=[c.name for c in CASES])
def test_conformance_reference(item):
    result = run_cell(item, cpu_column())
    assert result == "pass", result


@pytest.fixture(scope="module")
def interpreter_table():
    return run_interpreter_script(__file__, "--child", timeout=1500)


@pytest.mark.interpreter
@pytest.mark.parametrize("item", CASES, ids=[c.name for c in CASES])
def test_conformance_triton_interpreter(interpreter_table, item):
    """TRITON under the interpreter, float16: every row passes (TRITON takes every configuration of the table
    there; a row it could not take would be listed here with the reason it must give)."""
    result = interpreter_table[item.name]
    assert result == "pass", result


@pytest.mark.interpreter
def test_conformance_table_size(interpreter_table, record_property):
    """The table on the CPU: cases x backends (REFERENCE in process, TRITON under the interpreter)."""
    passed = sum(1 for c in CASES if interpreter_table[c.name] == "pass")
    size = f"{len(CASES)} cases x 2 backends (REFERENCE, TRITON interpreted) = {2 * len(CASES)} cells; " \
           f"TRITON passes {passed}, rejects {len(CASES) - passed}"
    record_property("conformance_table", size)
    print("\nconformance table (CPU):", size)
    phases = {c.phase for c in CASES}
    assert phases == {"decode", "sparse_decode", "prefill", "sparse_prefill", "merge", "cache", "layer"}
    assert len(CASES) >= 30


GPU_CELLS = [(c, b) for c in CASES for b in (backends_for(c.phase, torch.device("cuda"))
                                            if c.phase not in ("merge", "cache") else ["TRITON", "REFERENCE"])]


@pytest.mark.gpu
@pytest.mark.parametrize("item, backend", GPU_CELLS, ids=[f"{c.name}-{b}" for c, b in GPU_CELLS])
def test_conformance_gpu(item, backend, record_property):
    """Every registered backend on the GPU, bfloat16: passes, or rejects with its reasons."""
    result = run_cell(item, Column(backend, torch.bfloat16, torch.device("cuda")))
    record_property("cell", f"{item.name} x {backend}: {result.splitlines()[0]}")
    assert not result.startswith("FAIL"), result


def _child_main() -> None:
    column = cpu_column()
    print_results({c.name: run_cell(c, column) for c in CASES})


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child_main()
    else:  # the table, readable
        column = cpu_column()
        for c in CASES:
            print(f"{c.phase:15s} {c.name:40s} {column.backend:10s} {run_cell(c, column).splitlines()[0]}")
        print(f"{len(CASES)} cases on {column.backend}")
