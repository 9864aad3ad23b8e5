"""Device-side record of bad index data met by the kernels.

The kernels never read or write outside the tensors they are given, whatever
the index data (block tables, sequence lengths, slots, cumulative lengths).
A request whose indices are bad gets a documented result instead (its output
rows and LSE are NaN, a bad slot is not written) and the kernel sets a bit in
an int32 flag that lives on the device, with an atomic OR: recording costs no
host synchronisation, so it stays on in the hot path and inside CUDA graphs.

`raise_pending_errors()` reads the flag (it synchronises), clears it and raises
`ValueError` naming every kind of bad index recorded since the last report.
A call that runs the data checks (``MLA_MULTI_CHECK_INPUTS=1``, or tensors on
the CPU) reports pending errors of its device first.

One flag per device, allocated at first use.  A CUDA graph captures the
flag's address, so the flag must exist before capture: `MLAAttention` and the
TRITON decode backend's `reserve_workspace` allocate it; otherwise call
`error_flag(device)` (or run the ops once) before capturing.
"""

from __future__ import annotations

import threading

import torch

from mla_multi.kernels import capturing_on

__all__ = [
    "BLOCK_INDEX",
    "SEQ_RANGE",
    "SLOT",
    "CU_SEQLENS",
    "SPARSE_INDEX",
    "ERROR_KINDS",
    "canonical_device",
    "error_flag",
    "has_flag",
    "record",
    "pending_errors",
    "raise_pending_errors",
    "describe_bits",
]

# One bit per kind of bad index (the kernels take them as constants).
BLOCK_INDEX = 1
SEQ_RANGE = 2
SLOT = 4
CU_SEQLENS = 8
SPARSE_INDEX = 16

ERROR_KINDS: dict[int, str] = {
    BLOCK_INDEX: "a block-table entry that a request reads lies outside [0, num_blocks) "
    "(its output rows and LSE are NaN)",
    SEQ_RANGE: "a sequence range outside its block-table row: decode seq_lens outside "
    "[0, max_blocks * block_size], or gather_cache positions seq_starts .. seq_starts + seq_lens "
    "negative or past the row (decode: the request's rows and LSE are NaN; gather: those rows are NaN)",
    SLOT: "a slot_mapping entry past the cache, >= num_blocks * block_size (that token is not written)",
    CU_SEQLENS: "cumulative lengths that do not start at 0, decrease, run past the token count, or hold "
    "a sequence longer than max_seqlen (that sequence's rows and LSE are NaN; gather_cache rows no "
    "request covers are NaN)",
    SPARSE_INDEX: "a sparse decode index outside [-1, num_slots) (that token's output rows and LSE are NaN)",
}

_flags: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def canonical_device(device) -> torch.device:
    """`device` as a torch.device with its index ("cuda" is the current CUDA device): a dictionary key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_flag(device) -> torch.Tensor:
    """The int32 tensor [1] on `device` that the kernels OR their error bits into.

    Allocated (zeroed) at first use; the same tensor afterwards. Allocating it
    while the current CUDA stream is being captured raises RuntimeError (the
    graph would zero it on every replay): call this before capturing.
    """
    device = canonical_device(device)
    flag = _flags.get(device)
    if flag is not None:
        return flag
    with _lock:
        flag = _flags.get(device)
        if flag is None:
            if capturing_on(device):
                raise RuntimeError(
                    f"the error flag of {device} does not exist yet and the stream is being captured; "
                    "call mla_multi.errors.error_flag(device) (or run the ops once) before capturing"
                )
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            _flags[device] = flag
    return flag


def has_flag(device) -> bool:
    """Whether the flag of `device` exists (nothing can be pending otherwise)."""
    return canonical_device(device) in _flags


def record(device, bits: int) -> None:
    """OR host-known error `bits` into the flag of `device` (no synchronisation)."""
    if bits:
        error_flag(device).bitwise_or_(int(bits))


def describe_bits(bits: int) -> list[str]:
    """The kinds of bad index that `bits` stands for, one sentence each."""
    return [text for bit, text in ERROR_KINDS.items() if bits & bit]


def _devices(device) -> list[torch.device]:
    if device is not None:
        return [canonical_device(device)]
    return list(_flags)


def pending_errors(device=None) -> int:
    """The error bits recorded on `device` (every device with a flag when None); synchronises, clears nothing."""
    bits = 0
    for dev in _devices(device):
        flag = _flags.get(dev)
        if flag is not None:
            bits |= int(flag.item())
    return bits


def raise_pending_errors(device=None) -> None:
    """Raise ValueError naming every kind of bad index the kernels recorded, then clear the record.

    `device`: a torch device (or its name); None checks every device with a
    flag. Synchronises that device; not callable during CUDA-graph capture.
    Returns None when nothing was recorded.
    """
    reports = []
    for dev in _devices(device):
        flag = _flags.get(dev)
        if flag is None:
            continue
        bits = int(flag.item())
        if bits:
            flag.zero_()
            kinds = "; ".join(describe_bits(bits)) or f"unknown error bits {bits:#x}"
            reports.append(f"{dev} (error bits {bits:#x}): {kinds}")
    if reports:
        raise ValueError(
            "mla_multi kernels met bad index data since the last report on "
            + " | ".join(reports)
            + "; accepted: block-table entries in [0, num_blocks), seq_lens in [0, max_blocks * block_size], "
            "slots negative (skip) or in [0, num_blocks * block_size), cumulative lengths non-decreasing from 0 "
            "up to the token count with no sequence longer than max_seqlen. Run with MLA_MULTI_CHECK_INPUTS=1 "
            "to raise at the call that passes them"
        )
