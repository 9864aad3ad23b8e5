"""`mla-multi bench sparse-decode / sparse-prefill` on the CPU: case parsing (a case's own topk), the argument
errors (one line, status 2, before any device is needed), and the V4 columns' inputs and calls: every usable
backend through `mm.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4` and FlashMLA's own V4 call on the same
inputs, run once each through the stand-in of FlashMLA (tests/fake_flash_mla, which checks the call's
arguments) instead of timed."""

from __future__ import annotations

import pytest
import torch

from mla_multi.benchmarks import sparse
from mla_multi.platforms import override


def test_cases_parse_with_their_own_topk():
    assert sparse._parse_cases("128x64x16384x512,64x1x300", 2048) == [(128, 64, 16384, 512), (64, 1, 300, 2048)]
    assert sparse._parse_cases("128x64x16384") == [(128, 64, 16384)]
    for text in ("128x64", "128xax5", "128x0x5", "1x2x3x4x5", "128x64x16384x0"):
        with pytest.raises(ValueError, match=f"case '{text}'; accepted: NxBxS"):
            sparse._parse_cases(text, 2048)
    with pytest.raises(ValueError, match="case '1x2x3x4'"):  # without a default topk: three numbers
        sparse._parse_cases("1x2x3x4")
    # the default cases of both formats parse
    for text in (sparse.DECODE_CASES, sparse.PREFILL_CASES, sparse.V4_DECODE_CASES, sparse.V4_PREFILL_CASES):
        assert sparse._parse_cases(text, 2048)
    assert [c[3] for c in sparse._parse_cases(sparse.V4_DECODE_CASES, 2048)] == [512, 512, 512, 2048, 2048]
    assert [(c[0], c[1]) for c in sparse._parse_cases(sparse.V4_DECODE_CASES, 2048)] == [
        (128, 1), (128, 64), (128, 128), (64, 64), (64, 128)]
    assert [(c[0], c[1], c[3]) for c in sparse._parse_cases(sparse.V4_PREFILL_CASES, 1)] == [
        (128, 4096, 2048), (64, 4096, 2048)]


ERRORS = [
    ("sparse_decode", ["--format", "v5"], "argument --format: invalid choice: 'v5'"),
    ("sparse_decode", ["--format", "v4", "--kv", "bf16"], "--kv 'bf16' with --format v4"),
    ("sparse_decode", ["--window", "64"], "--window 64 with --format v32"),
    ("sparse_decode", ["--format", "v4", "--window", "0"], "--window 0; accepted: 1 or more"),
    ("sparse_decode", ["--kv", "fp8"], "--kv 'fp8'; accepted: fp8_ds_mla, bf16"),
    ("sparse_decode", ["--cases", "128x64"], "--cases: case '128x64'; accepted"),
    ("sparse_prefill", ["--format", "v4", "--cases", "64x4096x0x2048"], "--cases: case '64x4096x0x2048'"),
    ("sparse_prefill", ["--topk", "0"], "--topk 0; accepted: 1 or more"),
    ("sparse_prefill", ["--window", "128"], "unrecognized arguments: --window 128"),
]


@pytest.mark.parametrize("phase,argv,words", ERRORS, ids=[" ".join(e[1]) for e in ERRORS])
def test_argument_errors_are_one_line_before_any_device(phase, argv, words, capsys):
    with pytest.raises(SystemExit) as raised:
        sparse.main(argv, phase=phase)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert words in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the benchmark would run")
@pytest.mark.parametrize("phase", ["sparse_decode", "sparse_prefill"])
def test_valid_v4_arguments_reach_the_device_check(phase, capsys):
    argv = ["--format", "v4", "--cases", "64x2x300x128"] + (["--window", "64"] if phase == "sparse_decode" else [])
    assert sparse.main(argv, phase=phase) == 2
    assert "error: needs a CUDA or ROCm GPU" in capsys.readouterr().err


def _run_once(monkeypatch):
    """`_measure` replaced by one call of each column; returns what it saw."""
    seen = {}

    def once(row, runs, copies, flops, rounds=3):
        seen.update(runs={name: run(0) for name, run in runs.items()}, copies=copies, flops=flops)

    monkeypatch.setattr(sparse, "_measure", once)
    monkeypatch.setattr(sparse, "L2_FLUSH_BYTES", 1)  # one copy of the inputs
    return seen


def test_v4_decode_columns_run_the_same_inputs(fake_flash_mla, monkeypatch):
    seen = _run_once(monkeypatch)
    heads, batch, seq_len, topk, window = 64, 3, 300, 64, 128
    with override("H200"):
        row = sparse.bench_v4_decode_case(heads, batch, seq_len, topk, window, wanted=["FLASHMLA", "REFERENCE"],
                                          device="cpu")
    # 64 heads on sm_90: TRITON ahead of FLASHMLA at every batch (`nvidia-sm90-v4-sparse-decode-64-heads`)
    assert row["chosen"] == "TRITON" and row["kv"] == "fp8_ds_mla_v4 + window 128" and row["format"] == "v4"
    assert seen["flops"] == 2 * batch * heads * (512 + 512) * (topk + window)
    outs = seen["runs"]
    assert list(outs) == ["FlashMLA", "FLASHMLA", "REFERENCE"]
    for name in ("FLASHMLA", "REFERENCE"):
        assert outs[name].shape == (batch, heads, 512)
        diff = ((outs[name].double() - outs["FlashMLA"].double()).norm() / outs["FlashMLA"].double().norm()).item()
        assert diff < 1e-2, (name, diff)
    calls = [c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_with_kvcache"]
    peer = calls[1]  # the schedule made outside the timing, then the column's call reusing it
    assert calls[0]["scheduled"] and not peer["scheduled"] and peer["use_legacy"] and peer["kv_format"] == "V4"
    assert peer["attn_sink"] and peer["extra_topk"] == window and bool((peer["extra_topk_length"] == window).all())
    assert bool((peer["topk_length"] == topk).all())
    # a window FlashMLA's own call cannot take (not whole tiles of 64): no peer column, the adapter pads
    fake_flash_mla.CALLS.clear()
    with override("H200"):
        sparse.bench_v4_decode_case(heads, batch, seq_len, topk, 40, wanted=["FLASHMLA"], device="cpu")
    assert list(seen["runs"]) == ["FLASHMLA"] and seen["runs"]["FLASHMLA"].shape == (batch, heads, 512)
    assert [c["extra_topk"] for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_with_kvcache"] == [64]


def test_v4_prefill_columns_run_the_same_inputs(fake_flash_mla, monkeypatch):
    seen = _run_once(monkeypatch)
    heads, tokens, s_kv, topk = 128, 4, 300, 128
    with override("H200"):
        row = sparse.bench_v4_prefill_case(heads, tokens, s_kv, topk, wanted=["FLASHMLA", "REFERENCE"], device="cpu")
    assert row["chosen"] == "FLASHMLA" and row["phase"] == "sparse_prefill"
    assert seen["flops"] == 2 * tokens * heads * (512 + 512) * topk
    outs = seen["runs"]
    assert list(outs) == ["FlashMLA", "FLASHMLA", "REFERENCE"]
    for name in ("FLASHMLA", "REFERENCE"):
        diff = ((outs[name].double() - outs["FlashMLA"].double()).norm() / outs["FlashMLA"].double().norm()).item()
        assert diff < 1e-2, (name, diff)
    calls = [c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_sparse_fwd"]
    assert all(c["width"] == 512 and c["attn_sink"] for c in calls) and len(calls) == 2


def test_rows_format_with_the_v4_columns():
    row = {"phase": "sparse_decode", "format": "v4", "heads": 128, "batch": 64, "seq_len": 16384,
           "kv": "fp8_ds_mla_v4 + window 128", "topk": 512, "chosen": "FLASHMLA",
           "us": {"FlashMLA": 50.0, "FLASHMLA": 55.0}, "eager_us": {"FlashMLA": 80.0, "FLASHMLA": 90.0},
           "tflop_s": {"FlashMLA": 110.0, "FLASHMLA": 100.0}}
    table = sparse.format_rows([row]).splitlines()
    assert "FLASHMLA µs captured / eager (TFLOP/s)" in table[0] and "| chosen |" in table[0]
    assert "| 128 | 64 x 16384 | fp8_ds_mla_v4 + window 128 | 512 | 50.0 / 80.0 (110) | 55.0 / 90.0 (100)* |" in table[2]
    assert table[2].endswith("| FLASHMLA | 0.91 | FLASHMLA 0.91 |")
