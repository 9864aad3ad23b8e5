"""Bad index data: every Triton kernel stays inside its tensors and gives the documented result.

The documented result (README, "Bad input"): a decode request whose seq_len lies
outside [0, max_blocks * block_size] or that reads a block-table entry outside
[0, num_blocks) gets output and LSE NaN; a prefill sequence whose boundaries are
not non-decreasing from 0 inside the token count, or longer than max_seqlen,
gets NaN in its rows; a slot past the cache is not written; a gathered row
outside its block-table row, in a block outside the cache, or covered by no
range is NaN. Each kind sets its bit of the device's error flag
(`mla_multi.errors`), which `mm.ops.raise_pending_errors()` reports.

* interpreter (CPU, one child process with TRITON_INTERPRET=1): each kernel
  (decode split and split merge, prefill, merge_attn_states, concat_and_cache_mla,
  gather_cache) fed each kind of bad index under `interpreter.memcheck`, which
  checks every load, store and atomic against the tensors of the launch; the
  REFERENCE functions fed the same inputs give the same NaN rows and bits;
* GPU (marked gpu): the public ops with MLA_MULTI_CHECK_INPUTS=0, TRITON and
  REFERENCE, bfloat16, DeepSeek dims; `bench/gpu_check_safety.sh` runs them
  under `compute-sanitizer --tool memcheck`.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from interpreter import memcheck, print_results, run_interpreter_script

from mla_multi import errors

NAN = float("nan")
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _pending(device) -> int:
    """The recorded bits, cleared (the next case starts from nothing)."""
    bits = errors.pending_errors(device)
    errors.error_flag(device).zero_()
    return bits


def _nan_rows(t: torch.Tensor) -> list[bool]:
    """Per leading index: every value NaN."""
    return [bool(torch.isnan(row).all()) for row in t.float().cpu()]


def _close(out: torch.Tensor, ref: torch.Tensor, keep) -> float:
    """Relative norm error over the rows `keep`; inf when a kept row holds NaN."""
    out, ref = out.detach().double().cpu()[keep], ref.detach().double().cpu()[keep]
    if out.numel() == 0:
        return 0.0
    if torch.isnan(out).any():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- decode

# request 1 gets the bad index; requests 0 and 2 must come out right
DECODE_SEQ_LENS = [37, 21, 9]
DECODE_MUTATIONS = {
    # name: (what it does to request 1, bits)
    "block-past-cache": (lambda t, n, cap: t["block_table"].__setitem__((1, 1), n), errors.BLOCK_INDEX),
    "block-far-past-cache": (lambda t, n, cap: t["block_table"].__setitem__((1, 0), 2**31 - 1), errors.BLOCK_INDEX),
    "negative-block": (lambda t, n, cap: t["block_table"].__setitem__((1, 0), -1), errors.BLOCK_INDEX),
    "seq-len-past-table": (lambda t, n, cap: t["seq_lens"].__setitem__(1, cap + 1), errors.SEQ_RANGE),
    "int32-max-seq-len": (lambda t, n, cap: t["seq_lens"].__setitem__(1, 2**31 - 1), errors.SEQ_RANGE),
    "negative-seq-len": (lambda t, n, cap: t["seq_lens"].__setitem__(1, -5), errors.SEQ_RANGE),
    # control: entries past a sequence's blocks are never read, whatever they hold
    "unused-entries-anything": (lambda t, n, cap: t["block_table"][1, 6:].fill_(-7), 0),
}
# (id, mutation, block size, splits, query tokens, cache dtype name)
DECODE_CASES = [
    ("block-past-cache-direct", "block-past-cache", 16, 1, 1, "float16"),
    ("block-past-cache-splits", "block-past-cache", 16, 3, 1, "float16"),
    ("block-far-page4", "block-far-past-cache", 4, 2, 1, "float16"),
    ("negative-block-page1", "negative-block", 1, 1, 1, "float16"),
    ("negative-block-fp8", "negative-block", 16, 2, 1, "float8_e4m3fn"),
    ("block-past-cache-multi-token", "block-past-cache", 16, 2, 3, "float16"),
    ("seq-len-past-table-direct", "seq-len-past-table", 16, 1, 1, "float16"),
    ("seq-len-past-table-splits", "seq-len-past-table", 4, 4, 1, "float16"),
    ("int32-max-seq-len", "int32-max-seq-len", 16, 3, 1, "float16"),
    ("negative-seq-len", "negative-seq-len", 16, 2, 2, "float16"),
    ("unused-entries-anything", "unused-entries-anything", 4, 2, 1, "float16"),
]


def decode_inputs(mutation: str, block_size: int, q_len: int, cache_dtype, q_dtype, device, heads, lora, rope, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch = len(DECODE_SEQ_LENS)
    max_blocks = -(-max(DECODE_SEQ_LENS) // block_size) + 1
    num_blocks = batch * max_blocks + 1
    cache = torch.randn(num_blocks, block_size, lora + rope, generator=generator)
    k_scale = None
    if cache_dtype in FP8:
        k_scale = torch.tensor([0.02])
        cache = (cache / k_scale).clamp(-200, 200)
    shape = (batch, heads) if q_len == 1 else (batch, q_len, heads)
    tensors = dict(
        q_nope=torch.randn(*shape, lora, generator=generator).to(q_dtype),
        q_pe=torch.randn(*shape, rope, generator=generator).to(q_dtype),
        kv_cache=cache.to(cache_dtype),
        block_table=torch.randperm(num_blocks, generator=generator)[: batch * max_blocks].reshape(batch, max_blocks).int(),
        seq_lens=torch.tensor(DECODE_SEQ_LENS, dtype=torch.int32),
        k_scale=k_scale,
    )
    mutate, bits = DECODE_MUTATIONS[mutation]
    mutate(tensors, num_blocks, max_blocks * block_size)
    tensors = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in tensors.items()}
    return tensors, bits


def decode_result(tensors, out, lse, bits, device, scale) -> dict:
    """The kernel's rows against the REFERENCE function's on the same (bad) inputs."""
    from mla_multi.backends.reference import mla_decode_reference

    ref_out, ref_lse = mla_decode_reference(
        tensors["q_nope"].double(), tensors["q_pe"].double(), tensors["kv_cache"], tensors["block_table"],
        tensors["seq_lens"], scale, tensors["k_scale"],
    )
    ref_bits = _pending(device)
    bad = [b == 1 and bits != 0 for b in range(len(DECODE_SEQ_LENS))]
    return {
        "bits": bits,
        "ref_bits": ref_bits,
        "bad_rows_nan": _nan_rows(out) == bad and _nan_rows(lse) == bad,
        "same_nan_rows_as_reference": _nan_rows(ref_out) == bad and _nan_rows(ref_lse) == bad,
        "good_rows_err": _close(out, ref_out, [not b for b in bad]),
        "good_lse_finite": bool(torch.isfinite(lse.float().cpu()[[not b for b in bad]]).all()),
    }


def run_decode_case(case, device="cpu", q_dtype=torch.float16, heads=4, lora=64, rope=16, config=None) -> dict:
    """The kernel directly (interpreter); NaN-poisoned outputs and split workspace; `config` a
    `DecodeLaunchConfig` (default: the platform's table)."""
    from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd

    _, mutation, block_size, splits, q_len, cache_name = case
    tensors, expected_bits = decode_inputs(
        mutation, block_size, q_len, getattr(torch, cache_name), q_dtype, device, heads, lora, rope
    )
    q_nope = tensors["q_nope"]
    out = torch.full_like(q_nope, NAN)
    lse = torch.full(q_nope.shape[:-1], NAN, device=device)
    rows = q_nope.shape[0] * q_len
    attn_logits = torch.full((rows, heads, splits, attn_logits_width(lora)), NAN, device=device)
    scale = (lora + rope) ** -0.5
    _pending(device)
    mla_decode_fwd(
        q_nope, tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        k_scale=tensors["k_scale"], num_kv_splits=splits, attn_logits=attn_logits, out=out, lse=lse, config=config,
    )
    result = decode_result(tensors, out, lse, _pending(device), device, scale)
    result["expected_bits"] = expected_bits
    return result


# --------------------------------------------------------------------------- prefill

PREFILL_Q, PREFILL_K = [3, 7, 5], [4, 9, 5]  # cu_q [0, 3, 10, 15], cu_k [0, 4, 13, 18]
PREFILL_CASES = {
    # name: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    "valid": ([0, 3, 10, 15], [0, 4, 13, 18], 7, 9),
    "cu-q-not-from-zero": ([1, 3, 10, 15], [0, 4, 13, 18], 7, 9),
    "cu-q-decreasing": ([0, 3, 1, 1], [0, 4, 13, 18], 7, 9),
    "cu-q-past-tokens": ([0, 3, 10, 16], [0, 4, 13, 18], 7, 9),
    "cu-q-int32-max": ([0, 3, 10, 2**31 - 1], [0, 4, 13, 18], 7, 9),
    "cu-q-negative": ([0, -3, 10, 15], [0, 4, 13, 18], 7, 9),
    "max-seqlen-q-too-small": ([0, 3, 10, 15], [0, 4, 13, 18], 5, 9),
    "max-seqlen-q-zero": ([0, 3, 10, 15], [0, 4, 13, 18], 0, 9),
    "cu-k-not-from-zero": ([0, 3, 10, 15], [2, 4, 13, 18], 7, 9),
    "cu-k-decreasing": ([0, 3, 10, 15], [0, 4, 3, 18], 7, 15),
    "cu-k-past-tokens": ([0, 3, 10, 15], [0, 4, 13, 19], 7, 9),
    "max-seqlen-k-too-small": ([0, 3, 10, 15], [0, 4, 13, 18], 7, 8),
}


def prefill_inputs(name, dtype, device, heads, qk, v_dim, seed=1):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_k, max_q, max_k = PREFILL_CASES[name]
    return dict(
        q=torch.randn(sum(PREFILL_Q), heads, qk, generator=generator).to(dtype).to(device),
        k=torch.randn(sum(PREFILL_K), heads, qk, generator=generator).to(dtype).to(device),
        v=torch.randn(sum(PREFILL_K), heads, v_dim, generator=generator).to(dtype).to(device),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )


def covered_rows(cu_q: list[int], total: int) -> list[bool]:
    """Rows that some sequence's range covers (rows no range covers are documented as not written)."""
    covered = [False] * total
    for start, end in zip(cu_q[:-1], cu_q[1:]):
        for row in range(max(start, 0), min(end, total)):
            covered[row] = True
    return covered


def prefill_result(args, out, lse, bits, device, scale, causal) -> dict:
    from mla_multi.backends.reference import varlen_attention_reference

    ref_out, ref_lse = varlen_attention_reference(
        args["q"].double(), args["k"].double(), args["v"].double(), args["cu_seqlens_q"], args["cu_seqlens_k"],
        scale, causal, args["max_seqlen_q"], args["max_seqlen_k"],
    )
    ref_bits = _pending(device)
    covered = covered_rows(args["cu_seqlens_q"].tolist(), args["q"].shape[0])
    kernel_nan = [n for n, c in zip(_nan_rows(out), covered) if c]
    ref_nan = [n for n, c in zip(_nan_rows(ref_out), covered) if c]
    kernel_lse_nan = [n for n, c in zip(_nan_rows(lse.t()), covered) if c]
    finite = [c and not n for c, n in zip(covered, _nan_rows(ref_out))]
    return {
        "bits": bits,
        "ref_bits": ref_bits,
        "nan_rows": kernel_nan,
        "same_nan_rows_as_reference": kernel_nan == ref_nan and kernel_lse_nan == ref_nan,
        "some_rows_nan": any(kernel_nan),
        "good_rows_err": _close(out, ref_out, finite),
        "good_lse_err": _close(lse.t().float(), ref_lse.t(), finite),
    }


def run_prefill_case(name, device="cpu", dtype=torch.float32, causal=True, xcds=1) -> dict:
    from mla_multi.kernels.launch_config import PrefillLaunchConfig
    from mla_multi.kernels.prefill import varlen_attention

    args = prefill_inputs(name, dtype, device, heads=2, qk=32, v_dim=16)
    out = torch.full((args["q"].shape[0], 2, 16), NAN, dtype=dtype, device=device)
    lse = torch.full((2, args["q"].shape[0]), NAN, device=device)
    scale = 32**-0.5
    _pending(device)
    # a 4-row tile: a sequence spans several tiles, one past the grid when max_seqlen_q is too small
    # xcds > 1: the one-dimensional launch ordered for that many dies (AMD's XCDs)
    config = PrefillLaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, xcds=xcds)
    varlen_attention(**args, scale=scale, causal=causal, out=out, lse=lse, config=config)
    return prefill_result(args, out, lse, _pending(device), device, scale, causal)


# --------------------------------------------------------------------------- cache ops

CONCAT_SLOTS = [5, -1, 17, 63, 0, 40]  # 4 blocks of 16 slots
CONCAT_CASES = {
    # name: (slot_mapping, bits)
    "valid": (CONCAT_SLOTS, 0),
    "slot-past-cache": ([5, -1, 17, 64, 0, 40], errors.SLOT),
    "slot-far-past-cache": ([5, -1, 17, 2**62, 0, 40], errors.SLOT),
    "negative-slots": ([5, -1, -9, 63, -(2**62), 40], 0),
    "duplicate-slots": ([5, -1, 5, 63, 5, 40], 0),
}


def run_concat_case(name, device="cpu", cache_dtype=torch.float16, lora=64, rope=16, use_ops=False) -> dict:
    """Written slots hold their token's row (a slot named twice: each element from one of its tokens, as
    concurrent writers leave it); no other byte changes."""
    from mla_multi import ops
    from mla_multi.kernels.cache_ops import concat_and_cache_mla

    slots, expected_bits = CONCAT_CASES[name]
    generator = torch.Generator().manual_seed(4)
    kv_c = torch.randn(len(slots), lora, generator=generator).to(device)
    k_pe = torch.randn(len(slots), rope, generator=generator).to(device)
    cache = torch.full((4, 16, lora + rope), NAN, device=device).to(cache_dtype)
    before = cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    scale = torch.tensor([0.05], device=device) if cache_dtype in FP8 else None
    _pending(device)
    if use_ops:
        ops.concat_and_cache_mla(kv_c.to(GPU_DTYPE), k_pe.to(GPU_DTYPE), cache, slot_mapping, scale=scale)
    else:
        concat_and_cache_mla(kv_c, k_pe, cache, slot_mapping, scale)
    bits = _pending(device)
    rows = torch.cat([kv_c, k_pe], -1).cpu().double()
    flat = cache.view(-1, lora + rope).cpu()
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731  (NaN poison compares by bytes)
    num_slots = flat.shape[0]
    written = {s for s in slots if 0 <= s < num_slots}
    tolerance = 6e-2 if cache_dtype in FP8 else 1e-2
    def slot_ok(s):
        stored = flat[s].double() * (0.05 if scale is not None else 1.0)
        writers = rows[[t for t, slot in enumerate(slots) if slot == s]]
        # per element: the nearest writer's value (one writer: the whole row)
        nearest = (stored[None, :] - writers).abs().min(0).values
        return bool((nearest <= tolerance * (1.0 + writers.abs().max(0).values)).all())

    writes_ok = all(slot_ok(s) for s in written)
    untouched = [s for s in range(num_slots) if s not in written]
    return {
        "bits": bits,
        "expected_bits": expected_bits,
        "writes_ok": writes_ok,
        "others_untouched": bool(torch.equal(as_bytes(flat[untouched]), as_bytes(before.view(-1, lora + rope).cpu()[untouched]))),
    }


# block table of 2 requests x 4 blocks of 4 tokens over a cache of 6 blocks
GATHER_TABLE = [[3, 0, 5, 1], [2, 4, 1, 0]]
GATHER_CASES = {
    # name: (block table, seq_starts, seq_lens, rows past the ranges, bits)
    "valid": (GATHER_TABLE, [2, 1], [5, 7], 0, 0),
    "block-past-cache": ([[3, 0, 5, 1], [2, 6, 1, 0]], [2, 1], [5, 7], 0, errors.BLOCK_INDEX),
    "negative-block": ([[-3, 0, 5, 1], [2, 4, 1, 0]], [2, 1], [5, 7], 0, errors.BLOCK_INDEX),
    "start-past-table": (GATHER_TABLE, [2, 12], [5, 7], 0, errors.SEQ_RANGE),
    "negative-start": (GATHER_TABLE, [-2, 1], [5, 7], 0, errors.SEQ_RANGE),
    "int32-max-start": (GATHER_TABLE, [2, 2**31 - 8], [5, 7], 0, errors.SEQ_RANGE),
    "rows-past-the-ranges": (GATHER_TABLE, [2, 1], [5, 7], 3, errors.CU_SEQLENS),
}


def gather_expected(table, starts, lens, cache_rows_fn, width, extra_rows):
    """Expected rows (NaN where the position or its block is bad), from the documented rule."""
    rows = []
    capacity = len(table[0]) * 4
    for request, (start, length) in enumerate(zip(starts, lens)):
        for position in range(start, start + max(length, 0)):
            block = table[request][position // 4] if 0 <= position < capacity else None
            if block is None or not 0 <= block < 6:
                rows.append(torch.full((width,), NAN, dtype=torch.float64))
            else:
                rows.append(cache_rows_fn(block, position % 4))
    rows += [torch.full((width,), NAN, dtype=torch.float64)] * extra_rows
    return torch.stack(rows)


def run_gather_case(name, device="cpu", cache_dtype=torch.float16, lora=64, rope=16) -> dict:
    from mla_multi.backends.reference import gather_cache_reference
    from mla_multi.kernels.cache_ops import gather_cache

    table, starts, lens, extra_rows, expected_bits = GATHER_CASES[name]
    generator = torch.Generator().manual_seed(5)
    cache = torch.randn(6, 4, lora + rope, generator=generator).to(cache_dtype).to(device)
    block_table = torch.tensor(table, dtype=torch.int32, device=device)
    seq_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    cu = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32, device=device)
    out = torch.full((sum(lens) + extra_rows, lora + rope), 7.0, device=device)
    scale = torch.tensor([1.0], device=device) if cache_dtype in FP8 else None
    _pending(device)
    gather_cache(cache, block_table, cu, seq_starts, out, scale, kv_lora_rank=lora)
    bits = _pending(device)
    expected = gather_expected(table, starts, lens, lambda b, o: cache[b, o].double().cpu(), lora + rope, extra_rows)
    ref = gather_cache_reference(
        cache, block_table, seq_starts, torch.tensor(lens, device=device), scale, out_dtype=torch.float64
    )
    ref_bits = _pending(device)
    same = lambda a, b: bool(torch.equal(torch.isnan(a.cpu()), torch.isnan(b)) and torch.equal(a.cpu().double().nan_to_num(1e9), b.nan_to_num(1e9)))  # noqa: E731
    return {
        "bits": bits,
        "expected_bits": expected_bits,
        "rows_as_documented": same(out.double(), expected),
        "reference_rows_as_documented": same(ref, expected[: sum(lens)]),
        "ref_bits": ref_bits,
    }


# --------------------------------------------------------------------------- merge_attn_states (no index data)


def run_merge_case(device="cpu") -> dict:
    """LSE of every kind (finite, +-inf, NaN) in both inputs: the merge indexes by grid position only."""
    from mla_multi.kernels.merge import merge_attn_states

    generator = torch.Generator().manual_seed(6)
    tokens, heads, dim = 5, 3, 16
    prefix, suffix = (torch.randn(tokens, heads, dim, generator=generator).to(device) for _ in range(2))
    values = torch.tensor([0.5, float("inf"), float("-inf"), NAN, -2.0])
    prefix_lse = values[torch.randint(0, 5, (heads, tokens), generator=generator)].to(device)
    suffix_lse = values[torch.randint(0, 5, (heads, tokens), generator=generator)].to(device)
    out, lse = merge_attn_states(prefix, prefix_lse, suffix, suffix_lse)
    return {"shape_ok": out.shape == prefix.shape and lse.shape == prefix_lse.shape}


# --------------------------------------------------------------------------- interpreter run


def _interpreter_main() -> None:
    from mla_multi.kernels.launch_config import DecodeLaunchConfig

    results = {}
    for case in DECODE_CASES:
        with memcheck() as violations:
            result = run_decode_case(case)
        results[f"decode/{case[0]}"] = dict(result, violations=violations)
        # the AMD tables' wide tile: QK as K Q^T, 64-token tiles (several pages a tile at pages 1-16)
        with memcheck() as violations:
            result = run_decode_case(case, config=DecodeLaunchConfig(16, 64, 4, 1, tokens_as_m=True))
        results[f"decode-tokens-as-m/{case[0]}"] = dict(result, violations=violations)
    for name in PREFILL_CASES:
        for causal in (True, False):
            with memcheck() as violations:
                result = run_prefill_case(name, causal=causal)
            results[f"prefill/{name}/{'causal' if causal else 'full'}"] = dict(result, violations=violations)
        with memcheck() as violations:
            result = run_prefill_case(name, causal=True, xcds=3)
        results[f"prefill/{name}/causal-xcd3"] = dict(result, violations=violations)
    for name in CONCAT_CASES:
        for cache_name in ("float16", "float8_e4m3fn"):
            with memcheck() as violations:
                result = run_concat_case(name, cache_dtype=getattr(torch, cache_name))
            results[f"concat/{name}/{cache_name}"] = dict(result, violations=violations)
    for name in GATHER_CASES:
        for cache_name in ("float16", "float8_e4m3fnuz"):
            with memcheck() as violations:
                result = run_gather_case(name, cache_dtype=getattr(torch, cache_name))
            results[f"gather/{name}/{cache_name}"] = dict(result, violations=violations)
    with memcheck() as violations:
        result = run_merge_case()
    results["merge/any-lse"] = dict(result, violations=violations)
    results["memcheck-self-test"] = _memcheck_self_test()
    print_results(results)


def _memcheck_self_test() -> dict:
    """The checker itself must report an access one element past a tensor (or it proves nothing)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(X, Y, shift):
        offs = tl.arange(0, 16)
        tl.store(Y + offs, tl.load(X + offs + shift))

    x, y = torch.zeros(17), torch.zeros(16)
    with memcheck() as inside:
        copy[(1,)](x, y, 1)
    with memcheck() as outside:
        copy[(1,)](x, y, 2)
    return {"inside": inside, "outside": outside}


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__, "--interpreter")


@pytest.mark.interpreter
def test_memcheck_reports_an_access_past_a_tensor(interpreter_results):
    result = interpreter_results["memcheck-self-test"]
    assert result["inside"] == [], result
    assert len(result["outside"]) == 1 and result["outside"][0]["lanes"] == 1, result


@pytest.mark.interpreter
@pytest.mark.parametrize("tile", ["decode", "decode-tokens-as-m"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_bad_indices_interpreter(interpreter_results, case, tile):
    result = interpreter_results[f"{tile}/{case[0]}"]
    assert result["violations"] == [], result
    assert result["bits"] == result["expected_bits"] == result["ref_bits"], result
    assert result["bad_rows_nan"] and result["same_nan_rows_as_reference"], result
    assert result["good_rows_err"] <= 3e-3 and result["good_lse_finite"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", ["causal", "full", "causal-xcd3"])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_bad_boundaries_interpreter(interpreter_results, name, causal):
    result = interpreter_results[f"prefill/{name}/{causal}"]
    assert result["violations"] == [], result
    expected_bits = 0 if name == "valid" else errors.CU_SEQLENS
    assert result["bits"] == expected_bits == result["ref_bits"], result
    assert result["same_nan_rows_as_reference"], result
    assert result["some_rows_nan"] == (name not in ("valid", "cu-q-decreasing")), result
    assert result["good_rows_err"] <= 1e-5 and result["good_lse_err"] <= 1e-5, result


@pytest.mark.interpreter
@pytest.mark.parametrize("cache_name", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("name", list(CONCAT_CASES))
def test_concat_bad_slots_interpreter(interpreter_results, name, cache_name):
    result = interpreter_results[f"concat/{name}/{cache_name}"]
    assert result["violations"] == [], result
    assert result["bits"] == result["expected_bits"], result
    assert result["writes_ok"] and result["others_untouched"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("cache_name", ["float16", "float8_e4m3fnuz"])
@pytest.mark.parametrize("name", list(GATHER_CASES))
def test_gather_bad_indices_interpreter(interpreter_results, name, cache_name):
    result = interpreter_results[f"gather/{name}/{cache_name}"]
    assert result["violations"] == [], result
    assert result["bits"] == result["expected_bits"], result
    assert result["rows_as_documented"], result
    if name != "rows-past-the-ranges":  # the reference computes its own ranges
        assert result["reference_rows_as_documented"] and result["ref_bits"] == result["expected_bits"], result


@pytest.mark.interpreter
def test_merge_any_lse_interpreter(interpreter_results):
    result = interpreter_results["merge/any-lse"]
    assert result["violations"] == [] and result["shape_ok"], result


# --------------------------------------------------------------------------- the reference, in process


def test_reference_gather_negative_length_gives_no_rows_and_is_recorded():
    from mla_multi.backends.reference import gather_cache_reference

    cache = torch.randn(6, 4, 80)
    block_table = torch.tensor(GATHER_TABLE, dtype=torch.int32)
    _pending("cpu")
    out = gather_cache_reference(cache, block_table, torch.tensor([2, 1]), torch.tensor([-3, 2]))
    assert _pending("cpu") == errors.SEQ_RANGE
    assert torch.equal(out, cache[[2, 2], [1, 2]])


# --------------------------------------------------------------------------- GPU: the public ops, checks off

gpu = pytest.mark.gpu
GPU_DTYPE = torch.bfloat16


def _gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def checks_off(monkeypatch):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")
    yield
    # what a test left recorded must not leak into the next one
    _pending(_gpu())


def _gpu_cache_dtype(name: str):
    from mla_multi.platforms import current_platform

    return (current_platform().fp8_dtype or torch.float8_e4m3fn) if name.startswith("float8") else GPU_DTYPE


@gpu
@pytest.mark.parametrize("backend", ["TRITON", "REFERENCE"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_bad_indices_gpu(checks_off, case, backend):
    import mla_multi as mm

    device = _gpu()
    _, mutation, block_size, splits, q_len, cache_name = case
    tensors, expected_bits = decode_inputs(
        mutation, block_size, q_len, _gpu_cache_dtype(cache_name), GPU_DTYPE, device, 16, 512, 64
    )
    _pending(device)
    out, lse = mm.ops.mla_decode(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"],
        576**-0.5, k_scale=tensors["k_scale"], num_kv_splits=splits, backend=backend, return_lse=True,
    )
    bits = _pending(device)
    result = decode_result(tensors, out, lse, bits, device, 576**-0.5)
    assert bits == expected_bits == result["ref_bits"], result
    assert result["bad_rows_nan"] and result["same_nan_rows_as_reference"], result
    assert result["good_rows_err"] <= (1e-2 if cache_name == "float16" else 6e-2), result
    assert result["good_lse_finite"], result


@gpu
@pytest.mark.parametrize("backend", ["TRITON", "REFERENCE"])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_bad_boundaries_gpu(checks_off, name, backend):
    import mla_multi as mm

    device = _gpu()
    args = prefill_inputs(name, GPU_DTYPE, device, heads=2, qk=192, v_dim=128)
    _pending(device)
    out, lse = mm.ops.mla_prefill(**args, scale=192**-0.5, causal=True, return_lse=True, backend=backend)
    result = prefill_result(args, out, lse, _pending(device), device, 192**-0.5, True)
    assert result["bits"] == (0 if name == "valid" else errors.CU_SEQLENS) == result["ref_bits"], result
    assert result["same_nan_rows_as_reference"], result
    assert result["good_rows_err"] <= 1e-2, result


@gpu
@pytest.mark.parametrize("cache_name", ["bfloat16", "float8"])
@pytest.mark.parametrize("name", list(CONCAT_CASES))
def test_concat_bad_slots_gpu(checks_off, name, cache_name):
    result = run_concat_case(name, _gpu(), _gpu_cache_dtype(cache_name), 512, 64, use_ops=True)
    assert result["bits"] == result["expected_bits"], result
    assert result["writes_ok"] and result["others_untouched"], result


@gpu
@pytest.mark.parametrize("name", list(GATHER_CASES)[:-1] + ["negative-length"])
def test_gather_bad_indices_gpu(checks_off, name):
    """Through mm.ops.gather_cache: the TRITON kernel and (out_dtype float64) the PyTorch version agree."""
    import mla_multi as mm

    device = _gpu()
    table, starts, lens, _, expected_bits = GATHER_CASES["valid" if name == "negative-length" else name]
    if name == "negative-length":
        lens, expected_bits = [-3, 7], errors.SEQ_RANGE
    cache = torch.randn(6, 4, 576, device=device).to(GPU_DTYPE)
    args = (cache, torch.tensor(table, dtype=torch.int32, device=device), torch.tensor(starts, device=device),
            torch.tensor(lens, device=device))
    _pending(device)
    out = mm.ops.gather_cache(*args)
    bits = _pending(device)
    ref = mm.ops.gather_cache(*args, out_dtype=torch.float64)
    ref_bits = _pending(device)
    expected = gather_expected(table, starts, lens, lambda b, o: cache[b, o].double().cpu(), 576, 0)
    assert bits == ref_bits == expected_bits
    for rows in (out.double().cpu(), ref.cpu()):
        assert torch.equal(torch.isnan(rows), torch.isnan(expected))
        assert torch.equal(rows.nan_to_num(1e9), expected.nan_to_num(1e9))


@gpu
def test_bad_block_in_a_replayed_decode_graph_gpu(checks_off):
    """A captured decode replayed with a bad block: that request NaN, the flag set, the next replay right again."""
    from mla_multi.backends.triton import TritonDecodeImpl
    from mla_multi.workspace import WorkspaceManager

    device = _gpu()
    tensors, _ = decode_inputs("unused-entries-anything", 16, 1, torch.bfloat16, torch.bfloat16, device, 16, 512, 64)
    impl = TritonDecodeImpl(16, 576**-0.5, 512, 64, torch.bfloat16, 16)
    workspace = WorkspaceManager(device)
    impl.reserve_workspace(workspace, max_num_seqs=4, max_model_len=64)
    workspace.lock()
    static = {}

    def step():
        static["out"], static["lse"] = impl.forward_mqa(
            tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"],
            workspace_manager=workspace, max_seq_len=64, num_kv_splits=2,
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    good_table = tensors["block_table"].clone()
    tensors["block_table"][1, 0] = tensors["kv_cache"].shape[0] + 5
    graph.replay()
    torch.cuda.synchronize()
    assert _nan_rows(static["out"]) == [False, True, False] and _nan_rows(static["lse"]) == [False, True, False]
    assert _pending(device) == errors.BLOCK_INDEX
    tensors["block_table"].copy_(good_table)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(static["out"]).any() and _pending(device) == 0


@gpu
def test_checks_on_raise_before_any_kernel_gpu(monkeypatch):
    import mla_multi as mm

    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "1")
    device = _gpu()
    tensors, _ = decode_inputs("block-past-cache", 16, 1, GPU_DTYPE, GPU_DTYPE, device, 16, 512, 64)
    with pytest.raises(ValueError, match=r"block_table\[1\].*accepted"):
        mm.ops.mla_decode(
            tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"],
            0.05, backend="TRITON",
        )
    # an error recorded earlier is reported by the next checked call
    errors.record(device, errors.SLOT)
    tensors["block_table"][1, 1] = 0
    with pytest.raises(ValueError, match="since the last report"):
        mm.ops.mla_decode(
            tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"],
            0.05, backend="TRITON",
        )
    assert errors.pending_errors(device) == 0


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
