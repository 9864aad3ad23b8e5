"""TRITON's DeepSeek-V4 sparse MLA (`mla_sparse_decode_v4` / `mla_sparse_prefill_v4` through
`mla_multi.kernels.sparse_v4` and the dense decode kernels) against REFERENCE in float64, under Triton's
interpreter on the CPU (a child process): every format pair, the sink (finite, +inf, -inf), both segments,
empty and all -1 rows, duplicates, topk_length 0, the window empty, the [B, Q, N, 512] layout, 4 / 64 / 128
heads, bad indices (NaN rows and the flag), poisoned scratch, every format's last slot read inside its tensor
(`interpreter.memcheck`); and, without the interpreter, selection and
its reasons on impersonated devices."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from interpreter import memcheck, print_results, run_interpreter_script

import mla_multi as mm
from mla_multi import registry
from mla_multi.dims import MLADims
from mla_multi.platforms import override

SCALE = 512 ** -0.5
PAIRS = [("fp8_ds_mla_v4", None), ("fp8_ds_mla_v4", "fp8_ds_mla_v4"), ("fp8_ds_mla_v41", None),
         ("fp8_ds_mla_v41", "fp8_ds_mla_v41"), ("fp8_ds_mla_v41", "fp4_ds_mla_v41"), ("rows", None),
         ("rows", "rows")]
# float16 query and rows against float64: the output's and the LSE's rounding
OUT_TOL, LSE_TOL = 3e-3, 2e-3


# --------------------------------------------------------------------------- the child process


def _cache(fmt_name: str, blocks: int, block_size: int, gen):
    import mla_multi as mm
    from mla_multi import cache_formats as cf

    rows = torch.randn(blocks * block_size, 512, generator=gen, dtype=torch.float64)
    if fmt_name == "rows":
        return rows.reshape(blocks, block_size, 512)
    fmt = cf.get_format(fmt_name)
    cache = fmt.allocate(blocks, block_size, fill=0xFF)  # padding and unwritten bytes poisoned
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, torch.arange(blocks * block_size))
    return cache


def _indices(gen, tokens, topk, slots):
    idx = torch.randint(0, slots, (tokens, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(tokens, topk, generator=gen) < 0.2] = -1
    if topk > 1:
        idx[0, 1] = idx[0, 0]  # a duplicate counts twice
    return idx


def _compare(out, lse, want_out, want_lse) -> dict:
    """Relative error of the output, worst LSE difference where finite, and whether the non-finite LSEs match
    (-inf for -inf, NaN for NaN) and the rows of a non-finite LSE are 0 / NaN as REFERENCE's."""
    out, lse = out.double(), lse.double()
    finite = torch.isfinite(want_lse)
    scale = float(want_out.nan_to_num(0.0).norm()) or 1.0
    nan_rows = want_out.isnan()
    return {
        "out": float((out - want_out).nan_to_num(0.0, 0.0, 0.0).norm()) / scale,
        "lse": float((lse[finite] - want_lse[finite]).abs().max()) if bool(finite.any()) else 0.0,
        "same_nonfinite": bool(torch.equal(lse.isnan(), want_lse.isnan())
                               and torch.equal(lse == -math.inf, want_lse == -math.inf)
                               and torch.equal(out.isnan(), nan_rows)
                               and not bool(out[~nan_rows].isinf().any())),
        "empty_zero": bool((out[want_lse == -math.inf] == 0).all()),
    }


def _decode_pair(main, extra, heads=4, tokens=5, seed=1) -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(seed)
    cache = _cache(main, 3, 8, gen)
    q = torch.randn(tokens, heads, 512, generator=gen).half()
    indices = _indices(gen, tokens, 16, 24)
    if tokens > 3:
        indices[3] = -1  # all -1: only the window, if any
    lengths = torch.tensor([16, 3, 0, 16, 9][:tokens], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, math.inf, -2.0] * (heads // 4), dtype=torch.float32)
    kwargs = dict(topk_length=lengths, attn_sink=sink)
    if extra is not None:
        kwargs.update(extra_kv_cache=_cache(extra, 2, 5, gen),  # its own block size
                      extra_indices=_indices(gen, tokens, 6, 10),
                      extra_topk_length=torch.tensor([6, 0, 0, 2, 6][:tokens], dtype=torch.int32))  # 1: no window
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache, indices, SCALE, backend="REFERENCE",
                                                     return_lse=True, **kwargs)
    result = _compare(out, lse, want_out, want_lse)
    result["dtype"] = str(out.dtype)
    result["sink_inf_zero"] = bool((out[:, 2::4] == 0).all())
    # token 2: topk_length 0 and no window: nothing to attend
    result["nothing"] = bool((lse[2] == -math.inf).all() and not bool(out[2].any()))
    return result


def _mtp_layout() -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(2)
    cache = _cache("fp8_ds_mla_v4", 2, 64, gen)
    extra_cache = _cache("fp8_ds_mla_v4", 2, 64, gen)
    batch, q_len, heads = 2, 2, 4
    q = torch.randn(batch, q_len, heads, 512, generator=gen).half()
    indices = _indices(gen, batch * q_len, 8, 128).reshape(batch, q_len, 8)
    extra_indices = _indices(gen, batch * q_len, 4, 128).reshape(batch, q_len, 4)
    kwargs = dict(topk_length=torch.tensor([5, 8], dtype=torch.int32), extra_kv_cache=extra_cache,
                  extra_indices=extra_indices, extra_topk_length=torch.tensor([4, 1], dtype=torch.int32),
                  attn_sink=torch.tensor([0.1, 0.2, -0.3, 1.0]))
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache, indices, SCALE, backend="REFERENCE",
                                                     return_lse=True, **kwargs)
    result = _compare(out, lse, want_out, want_lse)
    result["shapes"] = [list(out.shape), list(lse.shape)]
    return result


def _empty_lists() -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(3)
    cache = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(2, 4, 512, generator=gen).half()
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, torch.zeros(2, 0, dtype=torch.int32), SCALE, backend="TRITON",
                                           return_lse=True)
    topk_zero = bool(not out.any() and (lse == -math.inf).all())
    # no top-k entries, the window alone
    window = torch.tensor([[1, 2], [-1, -1]], dtype=torch.int32)
    kwargs = dict(extra_kv_cache=cache, extra_indices=window)
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, torch.zeros(2, 0, dtype=torch.int32), SCALE, backend="TRITON",
                                           return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache, torch.zeros(2, 0, dtype=torch.int32), SCALE,
                                                     backend="REFERENCE", return_lse=True, **kwargs)
    window_only = _compare(out, lse, want_out, want_lse)
    zero_tokens = mm.ops.mla_sparse_decode_v4(torch.zeros(0, 4, 512).half(), cache,
                                              torch.zeros(0, 3, dtype=torch.int32), SCALE, backend="TRITON")
    prefill_zero = mm.ops.mla_sparse_prefill_v4(torch.zeros(0, 4, 512).half(), torch.zeros(0, 512).half(),
                                                torch.zeros(0, 3, dtype=torch.int32), SCALE, backend="TRITON")
    return {"topk_zero": topk_zero, "window_only": window_only,
            "zero_tokens": [list(zero_tokens.shape), list(prefill_zero.shape)]}


def _prefill(heads=4) -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(4)
    tokens = 6
    kv = torch.randn(20, 512, generator=gen)  # float32 rows
    extra_kv = torch.randn(7, 512, generator=gen).half()
    q = torch.randn(tokens, heads, 512, generator=gen).half()
    indices = torch.randint(-3, 25, (tokens, 12), generator=gen, dtype=torch.int32)  # out of range: no token
    indices[0, 1] = indices[0, 0] = 5
    indices[4] = -1  # all -1, and no window below
    extra_indices = torch.randint(-2, 9, (tokens, 5), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([12, 3, 0, 9, 12, 5], dtype=torch.int32)
    extra_lengths = torch.tensor([5, 0, 0, 2, 0, 1], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, math.inf, -2.0] * (heads // 4), dtype=torch.float32)
    kwargs = dict(topk_length=lengths, attn_sink=sink, extra_kv=extra_kv, extra_indices=extra_indices,
                  extra_topk_length=extra_lengths)
    out, lse = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE, backend="TRITON", return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_prefill_v4(q.double(), kv, indices, SCALE, backend="REFERENCE",
                                                      return_lse=True, **kwargs)
    result = _compare(out, lse, want_out, want_lse)
    result["nothing"] = bool((lse[[2, 4]] == -math.inf).all() and not bool(out[[2, 4]].any()))
    # one segment, no lengths, no sink
    out, lse = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE, backend="TRITON", return_lse=True)
    want_out, want_lse = mm.ops.mla_sparse_prefill_v4(q.double(), kv, indices, SCALE, backend="REFERENCE",
                                                      return_lse=True)
    result["one_segment"] = _compare(out, lse, want_out, want_lse)
    return result


def _bad_indices() -> dict:
    """What a GPU call without the data checks gets (the CPU always checks, so the impl is called directly)."""
    from mla_multi import errors
    from mla_multi.backends.reference import ReferenceSparseDecodeImpl
    from mla_multi.backends.triton import TritonSparseDecodeImpl

    gen = torch.Generator().manual_seed(8)
    cache = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(4, 4, 512, generator=gen).half()
    indices = torch.tensor([[0, 1], [2, -1], [3, 4], [-7, 1]], dtype=torch.int32)  # token 3: -7
    extra_indices = torch.tensor([[0], [-2], [8], [0]], dtype=torch.int32)  # token 1: -2, token 2: past the cache
    kwargs = dict(kv_format="fp8_ds_mla_v4", extra_kv=cache, extra_indices=extra_indices,
                  extra_kv_format="fp8_ds_mla_v4")
    errors.error_flag(q.device).zero_()
    out, lse = TritonSparseDecodeImpl(4, 448, 64, q.device).forward_v4(q, cache, indices, SCALE, **kwargs)
    flag = int(errors.error_flag(q.device))
    errors.error_flag(q.device).zero_()
    want_out, want_lse = ReferenceSparseDecodeImpl(4, 448, 64, q.device).forward_v4(q.double(), cache, indices, SCALE,
                                                                                   **kwargs)
    errors.error_flag(q.device).zero_()
    result = _compare(out, lse, want_out, want_lse)
    result["nan_rows"] = bool(out[1:].isnan().all() and lse[1:].isnan().all())
    result["flag"] = bool(flag & errors.SPARSE_INDEX)
    return result


def _poisoned_scratch() -> dict:
    """A second call of the same layout reuses the scratch: poisoned, nothing of it is read but what the call
    writes (fewer rows named, shorter lengths)."""
    import mla_multi as mm
    from mla_multi import ops

    gen = torch.Generator().manual_seed(5)
    cache = _cache("fp8_ds_mla_v41", 2, 16, gen)
    q = torch.randn(3, 4, 512, generator=gen).half()
    kwargs = dict(topk_length=torch.tensor([8, 8, 8], dtype=torch.int32))
    indices = _indices(gen, 3, 8, 32)
    mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", **kwargs)
    poisoned = 0
    for plan in list(ops._PLANS.values()):
        scratch = getattr(getattr(plan, "impl", None), "_scratch", None)
        if scratch is not None:
            for name, buffer in scratch._buffers.items():
                if name in ("v4 rows", "v4 table", "v4 lens"):
                    buffer.fill_(float("nan") if buffer.is_floating_point() else 1 << 20)
                    poisoned += 1
    kwargs = dict(topk_length=torch.tensor([2, 0, 5], dtype=torch.int32))
    indices = _indices(gen, 3, 8, 32)
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache, indices, SCALE, backend="REFERENCE",
                                                     return_lse=True, **kwargs)
    return dict(_compare(out, lse, want_out, want_lse), poisoned=poisoned)


def _errors() -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(6)
    cache = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(2, 4, 512, generator=gen)
    found = {}
    for name, call in {
        "bf16": lambda: mm.ops.mla_sparse_decode_v4(q.bfloat16(), cache, torch.zeros(2, 1, dtype=torch.int32), SCALE,
                                                    backend="TRITON"),
        "out_of_range": lambda: mm.ops.mla_sparse_decode_v4(q.half(), cache, torch.tensor([[0], [8]], dtype=torch.int32),
                                                            SCALE, backend="TRITON"),
        "extra_out_of_range": lambda: mm.ops.mla_sparse_decode_v4(
            q.half(), cache, torch.tensor([[0], [1]], dtype=torch.int32), SCALE, backend="TRITON",
            extra_kv_cache=cache, extra_indices=torch.tensor([[0], [-3]], dtype=torch.int32)),
        "width": lambda: mm.ops.mla_sparse_decode_v4(q[..., :448].half(), cache, torch.zeros(2, 1, dtype=torch.int32),
                                                     SCALE, backend="TRITON"),
        "fp4_main": lambda: mm.ops.mla_sparse_decode_v4(q.half(), cache, torch.zeros(2, 1, dtype=torch.int32), SCALE,
                                                        kv_format="fp4_ds_mla_v41", backend="TRITON"),
    }.items():
        try:
            call()
            found[name] = "no error"
        except (ValueError, mm.NoBackendError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _last_slots() -> dict:
    """Every format's last slot (the 584-byte format's scales at the end of the last block's tail) and the
    prefill's last rows, read under `interpreter.memcheck`."""
    import mla_multi as mm

    gen = torch.Generator().manual_seed(13)
    found = {}
    for main, extra in PAIRS:
        cache = _cache(main, 2, 4, gen)
        extra_cache = None if extra is None else _cache(extra, 1, 2, gen)
        q = torch.randn(2, 4, 512, generator=gen).half()
        indices = torch.tensor([[7, 0], [6, 7]], dtype=torch.int32)
        kwargs = {} if extra is None else dict(extra_kv_cache=extra_cache,
                                              extra_indices=torch.tensor([[1], [0]], dtype=torch.int32))
        with memcheck() as violations:
            out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", return_lse=True,
                                                   attn_sink=torch.zeros(4), **kwargs)
        want_out, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache, indices, SCALE, backend="REFERENCE",
                                                         return_lse=True, attn_sink=torch.zeros(4), **kwargs)
        found[f"{main}+{extra}"] = dict(_compare(out, lse, want_out, want_lse), violations=violations)
    kv = torch.randn(5, 512, generator=gen).half()
    q = torch.randn(2, 4, 512, generator=gen).half()
    indices = torch.tensor([[4, 5], [-1, 4]], dtype=torch.int32)
    kwargs = dict(extra_kv=kv[:2], extra_indices=torch.tensor([[1], [2]], dtype=torch.int32))
    with memcheck() as violations:
        out, lse = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE, backend="TRITON", return_lse=True, **kwargs)
    want_out, want_lse = mm.ops.mla_sparse_prefill_v4(q.double(), kv, indices, SCALE, backend="REFERENCE",
                                                      return_lse=True, **kwargs)
    found["prefill"] = dict(_compare(out, lse, want_out, want_lse), violations=violations)
    return found


def _in_parts() -> dict:
    """A gathered decode of more entries than `base.V4_ROWS_AT_ONCE`: run two tokens at a time (16 + 6 entries a
    token), the same rows as one call; then into a given buffer (`ops.sparse_decode_v4_into`), in parts too."""
    from mla_multi.backends import base
    from mla_multi.backends import triton as triton_backend

    impl, saved = triton_backend.TritonSparseDecodeImpl, base.V4_ROWS_AT_ONCE
    original, parts = impl._v4_scratch, []

    def counted(self, q, tokens, width, rows):
        parts.append(tokens)
        return original(self, q, tokens, width, rows)

    base.V4_ROWS_AT_ONCE, impl._v4_scratch = 44, counted
    try:
        result = _decode_pair("fp8_ds_mla_v41", "fp4_ds_mla_v41", seed=5)
        result["parts"] = list(parts)
        parts.clear()
        result["into"] = _into_a_buffer()
        result["into parts"] = parts
    finally:
        base.V4_ROWS_AT_ONCE, impl._v4_scratch = saved, original
    return result


def _into_a_buffer() -> dict:
    """TRITON (`v4_takes_out`) writes the decode into the caller's NaN-poisoned buffer, which it returns: the rows
    of the op's own call."""
    import mla_multi as mm

    gen = torch.Generator().manual_seed(6)
    cache, extra = _cache("fp8_ds_mla_v41", 3, 8, gen), _cache("fp4_ds_mla_v41", 2, 5, gen)
    q = torch.randn(5, 4, 512, generator=gen).half()
    kwargs = dict(topk_length=torch.tensor([16, 3, 0, 16, 9], dtype=torch.int32),
                  attn_sink=torch.tensor([0.5, -math.inf, 1.0, -2.0]), extra_kv_cache=extra,
                  extra_indices=_indices(gen, 5, 6, 10), extra_topk_length=torch.tensor([6, 0, 0, 2, 6], dtype=torch.int32))
    indices = _indices(gen, 5, 16, 24)
    out = torch.full((5, 4, 512), math.nan, dtype=torch.float16)
    result = mm.ops.sparse_decode_v4_into(out, q, cache, indices, SCALE, backend="TRITON", **kwargs)
    want = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, backend="TRITON", **kwargs)
    return {"same_buffer": result.data_ptr() == out.data_ptr(), "equal": bool(torch.equal(out, want)),
            "takes_out": mm.backends.triton.TritonSparseDecodeImpl.v4_takes_out}


def _interpreter_main() -> None:
    results = {}
    for main, extra in PAIRS:
        results[f"decode {main}+{extra}"] = _decode_pair(main, extra)
    results["last slots"] = _last_slots()
    results["decode heads 64"] = _decode_pair("fp8_ds_mla_v4", "fp8_ds_mla_v4", heads=64, tokens=3, seed=11)
    results["decode heads 128"] = _decode_pair("fp8_ds_mla_v41", "fp4_ds_mla_v41", heads=128, tokens=3, seed=12)
    results["mtp"] = _mtp_layout()
    results["in parts"] = _in_parts()
    results["empty"] = _empty_lists()
    results["prefill"] = _prefill()
    results["prefill heads 64"] = _prefill(heads=64)
    results["bad"] = _bad_indices()
    results["poisoned"] = _poisoned_scratch()
    results["errors"] = _errors()
    print_results(results)


@pytest.fixture(scope="module")
def results():
    return run_interpreter_script(__file__, "--interpreter")


def _close(result: dict) -> None:
    assert result["out"] <= OUT_TOL and result["lse"] <= LSE_TOL, result
    assert result["same_nonfinite"] and result["empty_zero"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("main,extra", PAIRS, ids=lambda v: str(v))
def test_decode_matches_reference_on_every_format(results, main, extra):
    result = results[f"decode {main}+{extra}"]
    _close(result)
    assert result["dtype"] == "torch.float16"
    assert result["sink_inf_zero"], result  # a sink of +inf takes every row's mass
    if extra is None:
        assert result["nothing"], result


@pytest.mark.interpreter
def test_a_gathered_decode_of_many_entries_runs_in_parts(results):
    result = results["in parts"]
    _close(result)
    assert result["parts"] == [2, 2, 1], result
    assert result["into"] == {"same_buffer": True, "equal": True, "takes_out": True}, result
    assert result["into parts"] == [2, 2, 1] * 2, result  # the buffer's call and the op's own
    assert result["sink_inf_zero"] and result["nothing"], result


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["decode heads 64", "decode heads 128"])
def test_decode_at_64_and_128_heads(results, name):
    _close(results[name])


@pytest.mark.interpreter
def test_decode_batch_and_query_length_layout(results):
    result = results["mtp"]
    _close(result)
    assert result["shapes"] == [[2, 2, 4, 512], [2, 2, 4]]


@pytest.mark.interpreter
def test_empty_lists_the_window_alone_and_zero_tokens(results):
    result = results["empty"]
    assert result["topk_zero"]
    _close(result["window_only"])
    assert result["zero_tokens"] == [[0, 4, 512], [0, 4, 512]]


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["prefill", "prefill heads 64"])
def test_prefill_matches_reference(results, name):
    result = results[name]
    _close(result)
    assert result["nothing"], result
    _close(result["one_segment"])


@pytest.mark.interpreter
def test_bad_indices_without_the_data_checks_give_nan_rows_and_the_flag(results):
    result = results["bad"]
    _close(result)
    assert result["nan_rows"] and result["flag"], result


@pytest.mark.interpreter
def test_the_last_slots_are_read_inside_the_tensors(results):
    found = results["last slots"]
    assert set(found) == {f"{main}+{extra}" for main, extra in PAIRS} | {"prefill"}
    for name, result in found.items():
        assert result["violations"] == [], (name, result["violations"])
        _close(result)


@pytest.mark.interpreter
def test_reused_scratch_is_rewritten_before_it_is_read(results):
    assert results["poisoned"]["poisoned"] >= 3, results["poisoned"]
    _close(results["poisoned"])


@pytest.mark.interpreter
def test_bad_input_errors_name_the_argument(results):
    found = results["errors"]
    assert "which computes bfloat16 tl.dot wrongly" in found["bf16"], found["bf16"]
    assert found["out_of_range"].startswith("ValueError") and "indices" in found["out_of_range"], found
    assert found["extra_out_of_range"].startswith("ValueError") and "extra_indices" in found["extra_out_of_range"], found
    assert found["width"].startswith("ValueError") and "q=" in found["width"], found
    assert found["fp4_main"].startswith("ValueError") and "fp4_ds_mla_v41" in found["fp4_main"], found


# --------------------------------------------------------------------------- selection (no interpreter)


def test_triton_serves_v4_on_gpus_without_flashmla_with_reasons_elsewhere():
    dims = MLADims(128, kv_lora_rank=448, qk_rope_head_dim=64)
    for device in ("MI300X", "MI355X", "H100", "H200"):
        with override(device):
            for phase, fmt, extra in (("sparse_decode", "fp8_ds_mla_v4", "fp8_ds_mla_v4"),
                                      ("sparse_decode", "fp8_ds_mla_v41", "fp4_ds_mla_v41"),
                                      ("sparse_decode", "rows", "rows"), ("sparse_prefill", "rows", "rows")):
                kv_dtype = torch.bfloat16 if fmt == "rows" else torch.uint8
                chosen = registry.select_sparse_backend(phase, dims, torch.bfloat16, kv_dtype, 640, kv_format=fmt,
                                                        extra_kv_format=extra, with_sink=True)
                assert chosen.name == "TRITON", (device, phase, fmt)
    with override("A100"):  # no float8_e4m3fn conversion in Triton before sm_89
        config = registry.sparse_config(dims, torch.bfloat16, torch.uint8, 640, kv_format="fp8_ds_mla_v41",
                                        extra_kv_format="fp4_ds_mla_v41")
        rows = {row["name"]: row for row in registry.default_registry.explain("sparse_decode", config)}
        assert any("sm_89" in reason and "fp8_ds_mla_v41 and fp4_ds_mla_v41 caches need it" in reason
                   for reason in rows["TRITON"]["reasons"]), rows["TRITON"]
        assert registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.bfloat16, 640,
                                              kv_format="rows").name == "TRITON"
        assert registry.select_sparse_backend("sparse_prefill", dims, torch.bfloat16, torch.bfloat16, 640,
                                              kv_format="rows").name == "TRITON"
    from mla_multi.backends.triton import TritonSparseDecodeBackend, TritonSparsePrefillBackend

    assert TritonSparseDecodeBackend.info()["v4_formats"] == ["fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41",
                                                              "rows"]
    assert TritonSparsePrefillBackend.info()["v4_formats"] == ["rows"]
    # prefill reads float rows only
    with override("H100"):
        config = registry.sparse_config(dims, torch.bfloat16, torch.uint8, 640, kv_format="fp8_ds_mla_v4")
        reasons = TritonSparsePrefillBackend.validate_configuration(registry.current_platform(), config)
        assert any("V4 contract" in reason and "fp8_ds_mla_v4" in reason for reason in reasons), reasons


def test_the_kernels_are_in_the_compile_check():
    from mla_multi import compile_check
    from mla_multi.kernels import sparse_v4
    from mla_multi.platforms import SPECS

    assert "mla_multi.kernels.sparse_v4" in compile_check.KERNEL_MODULES
    names = {spec.name for spec in sparse_v4.compile_specs(SPECS["H100"])}
    assert {"v4_gather_rows[fp8_ds_mla_v4+fp8_ds_mla_v4,bf16]", "v4_gather_rows[fp8_ds_mla_v41+fp4_ds_mla_v41,bf16]",
            "v4_compact_lists[prefill]", "v4_pad_rows[bf16]"} <= names
    a100 = {spec.name for spec in sparse_v4.compile_specs(SPECS["A100"])}
    assert "v4_gather_rows[rows+rows,bf16]" in a100 and not any("fp8" in name for name in a100)


def test_forced_triton_on_the_cpu_without_the_interpreter_says_why():
    with pytest.raises(mm.NoBackendError, match="TRITON"):
        mm.ops.mla_sparse_prefill_v4(torch.zeros(1, 4, 512), torch.zeros(2, 512), torch.zeros(1, 1, dtype=torch.int32),
                                     SCALE, backend="TRITON")


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
