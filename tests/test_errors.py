"""The device-side error flag (mla_multi.errors): record, report, clear, and the report at the next checked call."""

from __future__ import annotations

import pytest
import torch

import mla_multi as mm
from mla_multi import errors


@pytest.fixture(autouse=True)
def clean_cpu_flag():
    errors.error_flag("cpu").zero_()
    yield
    errors.error_flag("cpu").zero_()


def test_one_flag_per_device_int32():
    flag = errors.error_flag("cpu")
    assert flag.shape == (1,) and flag.dtype == torch.int32 and flag.device.type == "cpu"
    assert errors.error_flag(torch.device("cpu")) is flag
    assert mm.ops.error_flag("cpu") is flag and errors.has_flag("cpu")


def test_bits_are_distinct_and_described():
    bits = [errors.BLOCK_INDEX, errors.SEQ_RANGE, errors.SLOT, errors.CU_SEQLENS, errors.SPARSE_INDEX]
    assert len(set(bits)) == 5 and all(bit & (bit - 1) == 0 for bit in bits)
    assert set(errors.ERROR_KINDS) == set(bits)
    assert errors.describe_bits(errors.SLOT | errors.BLOCK_INDEX) == [
        errors.ERROR_KINDS[errors.BLOCK_INDEX], errors.ERROR_KINDS[errors.SLOT]
    ]


def test_nothing_pending_raises_nothing():
    assert errors.pending_errors("cpu") == 0
    assert mm.ops.raise_pending_errors("cpu") is None
    assert mm.ops.raise_pending_errors() is None


@pytest.mark.parametrize(
    "bits, fragments",
    [
        (errors.BLOCK_INDEX, ["block-table entry", "[0, num_blocks)"]),
        (errors.SEQ_RANGE, ["seq_lens outside"]),
        (errors.SLOT, ["slot_mapping entry past the cache"]),
        (errors.CU_SEQLENS, ["cumulative lengths", "max_seqlen"]),
        (errors.SLOT | errors.CU_SEQLENS, ["slot_mapping", "cumulative lengths"]),
    ],
    ids=["block", "seq-range", "slot", "cu-seqlens", "two-kinds"],
)
def test_raise_names_the_kinds_and_what_is_accepted_then_clears(bits, fragments):
    errors.record("cpu", bits)
    errors.record("cpu", bits)  # recording twice is one report
    assert errors.pending_errors("cpu") == bits
    with pytest.raises(ValueError) as info:
        mm.ops.raise_pending_errors("cpu")
    message = str(info.value)
    assert f"error bits {bits:#x}" in message and "accepted" in message and "MLA_MULTI_CHECK_INPUTS=1" in message
    for fragment in fragments:
        assert fragment in message
    assert errors.pending_errors("cpu") == 0
    mm.ops.raise_pending_errors("cpu")


def test_the_next_checked_call_reports_what_was_recorded():
    # CPU tensors always run the data checks, so an op on the CPU reports first
    errors.record("cpu", errors.SLOT)
    kv_c, k_pe = torch.zeros(1, 32), torch.zeros(1, 8)
    cache = torch.zeros(2, 4, 40)
    with pytest.raises(ValueError, match="since the last report"):
        mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0]))
    assert not cache.any()  # reported before anything ran
    mm.ops.concat_and_cache_mla(kv_c + 1, k_pe, cache, torch.tensor([0]))
    assert cache[0, 0, :32].eq(1).all()


def test_a_device_without_a_flag_reads_nothing(monkeypatch):
    monkeypatch.setattr(errors, "_flags", {})
    assert not errors.has_flag("cpu") and errors.pending_errors() == 0
    mm.ops.raise_pending_errors()
    assert errors._flags == {}


def test_no_flag_is_allocated_during_capture(monkeypatch):
    # a graph would zero a flag allocated inside it on every replay
    monkeypatch.setattr(errors, "_flags", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing"):
        errors.error_flag(torch.device("cuda", 0))
    assert errors._flags == {}


@pytest.mark.gpu
def test_gpu_flag_records_inside_a_replayed_graph():
    device = torch.device("cuda", torch.cuda.current_device())
    flag = errors.error_flag(device)
    mm.ops.raise_pending_errors(device)
    recorded = torch.zeros(1, dtype=torch.int32, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        errors.error_flag(device).bitwise_or_(recorded)
    recorded.fill_(errors.SLOT)
    graph.replay()
    assert errors.pending_errors(device) == errors.SLOT and errors.error_flag(device) is flag
    with pytest.raises(ValueError, match="slot_mapping"):
        mm.ops.raise_pending_errors(device)
