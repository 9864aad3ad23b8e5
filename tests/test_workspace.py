"""WorkspaceManager: non-overlapping views, growth by reservation, and the lock that forbids allocation."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi.workspace import WorkspaceLockedError, WorkspaceManager

ALIGNMENT = 256


def byte_range(view: torch.Tensor) -> tuple[int, int]:
    return view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()


SPEC_SETS = [
    [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3, 4), torch.int32)],
    [((1,), torch.uint8), ((1,), torch.float64), ((0, 4), torch.float16), ((9, 9), torch.int64)],
    [((4, 16, 8, 65), torch.float32), ((4, 16, 8), torch.float32), ((4, 16, 64), torch.bfloat16)],
    [((5,), torch.float8_e4m3fn), ((5,), torch.float8_e4m3fnuz), ((3, 3), torch.bool)],
]


@pytest.mark.parametrize("specs", SPEC_SETS, ids=[f"set{i}" for i in range(len(SPEC_SETS))])
def test_get_simultaneous_views(specs):
    workspace = WorkspaceManager("cpu")
    views = workspace.get_simultaneous(*specs)
    assert len(views) == len(specs)
    base = workspace._buffer.data_ptr()
    end = base + workspace.size_bytes
    for view, (shape, dtype) in zip(views, specs):
        assert tuple(view.shape) == tuple(shape)
        assert view.dtype == dtype
        assert view.device == torch.device("cpu")
        assert view.is_contiguous()
        if view.numel() == 0:
            continue  # an empty tensor reports data_ptr 0
        start, stop = byte_range(view)
        assert base <= start and stop <= end
        assert (start - base) % ALIGNMENT == 0
        assert start % view.element_size() == 0
    # Pairwise disjoint byte ranges.
    ranges = sorted(byte_range(v) for v in views if v.numel())
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        assert stop <= start
    # Writing one view leaves the others alone.
    for index, view in enumerate(views):
        if view.numel() and view.dtype.is_floating_point and view.element_size() > 1:
            for other in views:
                if other.numel() and other.dtype.is_floating_point and other.element_size() > 1:
                    other.fill_(float("nan"))
            view.fill_(index + 1)
            for j, other in enumerate(views):
                if j != index and other.numel() and other.dtype.is_floating_point and other.element_size() > 1:
                    assert torch.isnan(other.float()).all()


@pytest.mark.parametrize("specs", SPEC_SETS, ids=[f"set{i}" for i in range(len(SPEC_SETS))])
def test_required_bytes(specs):
    expected = 0
    for shape, dtype in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        expected += -(-nbytes // ALIGNMENT) * ALIGNMENT
    assert WorkspaceManager.required_bytes(*specs) == expected
    workspace = WorkspaceManager("cpu")
    workspace.get_simultaneous(*specs)
    assert workspace.size_bytes == expected


def test_views_alias_earlier_calls():
    workspace = WorkspaceManager("cpu")
    (first,) = workspace.get_simultaneous(((8,), torch.float32))
    (second,) = workspace.get_simultaneous(((8,), torch.float32))
    assert first.data_ptr() == second.data_ptr()


def test_reserve_grows_and_never_shrinks():
    workspace = WorkspaceManager("cpu")
    assert workspace.size_bytes == 0
    workspace.reserve(((100,), torch.float32))
    assert workspace.size_bytes == 512
    workspace.reserve(((1000,), torch.float32), ((10,), torch.int8))
    assert workspace.size_bytes == 4096 + 256
    workspace.reserve(((1,), torch.float32))
    assert workspace.size_bytes == 4096 + 256
    pointer = workspace._buffer.data_ptr()
    views = workspace.get_simultaneous(((500,), torch.float32), ((500,), torch.float32))
    assert views[0].data_ptr() == pointer  # served from the reservation, nothing allocated


def test_lock_forbids_growth_and_names_the_sizes():
    workspace = WorkspaceManager("cpu")
    workspace.reserve(((1024,), torch.float32))
    workspace.lock()
    assert workspace.is_locked
    with pytest.raises(WorkspaceLockedError) as info:
        workspace.get_simultaneous(((1024,), torch.float32), ((1,), torch.float32))
    message = str(info.value)
    assert "4096 bytes" in message and "4352 bytes" in message
    with pytest.raises(WorkspaceLockedError, match="8192"):
        workspace.reserve(((2048,), torch.float32))
    assert isinstance(info.value, RuntimeError)
    assert mm.WorkspaceLockedError is WorkspaceLockedError
    assert workspace.size_bytes == 4096


def test_fitting_request_after_lock_allocates_nothing():
    workspace = WorkspaceManager("cpu")
    workspace.reserve(((64, 64), torch.float32))
    pointer = workspace._buffer.data_ptr()
    workspace.lock()
    views = workspace.get_simultaneous(((32, 64), torch.float32), ((32, 64), torch.float32))
    assert workspace._buffer.data_ptr() == pointer
    assert views[0].data_ptr() == pointer
    assert views[1].data_ptr() == pointer + 32 * 64 * 4
    assert workspace.size_bytes == 64 * 64 * 4
    workspace.unlock()
    assert not workspace.is_locked
    workspace.reserve(((128, 64), torch.float32))
    assert workspace.size_bytes == 128 * 64 * 4


def test_vllm_split_kv_reservation():
    # vLLM's Triton MLA builder reserves (max_num_seqs, num_heads, max_num_kv_splits, kv_lora_rank + 1) float32.
    max_num_seqs, num_heads, max_num_kv_splits, kv_lora_rank = 8, 16, 4, 512
    shape = (max_num_seqs, num_heads, max_num_kv_splits, kv_lora_rank + 1)
    workspace = WorkspaceManager(torch.device("cpu"))
    workspace.reserve((shape, torch.float32))
    assert workspace.size_bytes >= math.prod(shape) * 4
    pointer = workspace._buffer.data_ptr()
    workspace.lock()
    # Every smaller batch fits without allocation.
    for batch in (1, 3, max_num_seqs):
        (logits,) = workspace.get_simultaneous(((batch, num_heads, max_num_kv_splits, kv_lora_rank + 1), torch.float32))
        assert logits.dtype == torch.float32 and logits.data_ptr() == pointer
        assert logits.shape == (batch, num_heads, max_num_kv_splits, kv_lora_rank + 1)
    with pytest.raises(WorkspaceLockedError):
        workspace.get_simultaneous(((max_num_seqs + 1, num_heads, max_num_kv_splits, kv_lora_rank + 1), torch.float32))


@pytest.mark.parametrize("spec, fragment", [(((4,), "float32"), "dtype='float32'"), (((4, -1), torch.float32), "shape=(4, -1)"),
                                            (((2.0,), torch.float32), "shape=(2.0,)")])
def test_bad_specs(spec, fragment):
    workspace = WorkspaceManager("cpu")
    with pytest.raises(ValueError) as info:
        workspace.get_simultaneous(spec)
    assert fragment in str(info.value)


def test_same_specs_get_the_same_views_until_the_buffer_is_replaced():
    """`get_simultaneous` makes no tensors for specs it has seen on the current buffer (hot paths call it per
    launch); a reservation that replaces the buffer gives views of the new one."""
    workspace = WorkspaceManager("cpu")
    specs = (((4, 8), torch.float32), ([16], torch.int32))
    first = workspace.get_simultaneous(*specs)
    again = workspace.get_simultaneous(*specs)
    assert all(a is b for a, b in zip(first, again))
    workspace.reserve(((1 << 16,), torch.uint8))
    grown = workspace.get_simultaneous(*specs)
    assert all(g is not f for g, f in zip(grown, first))
    assert grown[0].untyped_storage().data_ptr() == workspace._buffer.untyped_storage().data_ptr()
    assert [tuple(v.shape) for v in grown] == [(4, 8), (16,)] and [v.dtype for v in grown] == [torch.float32, torch.int32]
