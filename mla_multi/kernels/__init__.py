"""Private Triton kernels of mla_multi and their launch configurations (no dispatch logic)."""

from __future__ import annotations

import os


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on the CPU.

    Triton reads the variable when a kernel is defined, so it must be set
    before the kernel modules are imported; this reads it the way Triton does.
    False when Triton is not importable.
    """
    try:
        import triton  # noqa: F401
    except Exception:  # no (usable) Triton: no interpreter either
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # a Triton without knobs reads the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def capturing(tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s device (False for a CPU
    tensor): what a launch made in such a call belongs to that graph, and is not kept for later calls."""
    import torch

    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def capturing_on(device) -> bool:
    """`capturing` for a torch.device."""
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keep_unless_capturing(owner, name: str, value, capture: bool):
    """`value`, also kept as ``owner.<name>`` for later calls unless it was made while a CUDA graph was being
    captured (`capture`, `capturing`): what a capture makes is written only when its graph replays, so it
    belongs to that graph alone. The one rule of everything a bound launch makes once and keeps."""
    if not capture:
        setattr(owner, name, value)
    return value


def rows_of_heads(tensor) -> bool:
    """Whether each token's heads lie side by side inside its row: a [rows, heads, dim] tensor with the heads'
    stride at least dim and the row stride at least all of them (or [rows, dim] with the row stride at least
    dim), as the TMA descriptors of the sm_90 kernels view a tensor ([rows, columns]). A [T, N, D] view of an
    [N, T, D] tensor, as transformers leaves the query, is not."""
    if tensor.dim() == 2:
        return tensor.stride(0) >= tensor.shape[1]
    heads, dim = tensor.shape[1], tensor.shape[2]
    return (heads == 1 or tensor.stride(1) >= dim) and tensor.stride(0) >= (heads - 1) * tensor.stride(1) + dim
