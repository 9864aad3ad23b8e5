"""The varlen prefill's input checks and head-dim split, shared by both prefill kernels.

`kernels/prefill.py` (the Triton kernel) and `kernels/prefill_wgmma.py` (the sm_90
Gluon kernel) both check their inputs here, so neither imports the other for it.
Plain Python: no Triton needed to import it.
"""

from __future__ import annotations

import torch


def split_head_dim_qk(head_dim_qk: int) -> tuple[int, int]:
    """Split the qk head dim into two power-of-two blocks (192 -> 128 + 64).

    The second block is padded up to a power of two (>= 16, the smallest dot
    width) and masked when the remainder is not one; 0 means no second block.
    """
    block_a = 1 << (head_dim_qk.bit_length() - 1)
    rest = head_dim_qk - block_a
    block_b = 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())
    return block_a, block_b


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, k_pe=None) -> None:
    """Raise ValueError naming the argument when the varlen prefill's inputs are not what its kernels take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {got}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype is {t.dtype}; accepted: float16, bfloat16, float32")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all tensors must share one device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k_pe is not None:
        if not isinstance(k_pe, torch.Tensor) or k_pe.dim() not in (2, 3) or k_pe.dtype != q.dtype:
            got = f"{k_pe.dtype} {tuple(k_pe.shape)}" if isinstance(k_pe, torch.Tensor) else type(k_pe).__name__
            raise ValueError(f"k_pe must be a [total_k, rope_dim] or [total_k, heads, rope_dim] tensor of q's dtype, got {got}")
        if k_pe.stride(-1) != 1 or k_pe.device != q.device or k_pe.shape[0] != k.shape[0]:
            raise ValueError(f"k_pe {tuple(k_pe.shape)} strides {k_pe.stride()} on {k_pe.device}; accepted: k's tokens "
                             f"({k.shape[0]}), a contiguous last dimension, on {q.device}")
        if k_pe.dim() == 3 and k_pe.shape[1] not in (1, k.shape[1]):
            raise ValueError(f"k_pe has {k_pe.shape[1]} heads; accepted: 1 (shared) or k's {k.shape[1]}")
        if split_head_dim_qk(q.shape[2]) != (k.shape[2], k_pe.shape[-1]):
            raise ValueError(
                f"k ({k.shape[2]}) and k_pe ({k_pe.shape[-1]}) head dims; accepted: the kernel's split of q's "
                f"{q.shape[2]}: {split_head_dim_qk(q.shape[2])}"
            )
    elif k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim {k.shape[2]} must equal q head dim {q.shape[2]}")
    if v.shape[0] != k.shape[0] or v.shape[1] != k.shape[1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} in tokens and heads")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if q.shape[2] < 16 or v.shape[2] < 16:
        raise ValueError(f"head dims must be >= 16, got qk {q.shape[2]} and v {v.shape[2]}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1], got {got}")
        if t.numel() < 1:
            raise ValueError(f"{name} must hold at least one entry (batch + 1), got 0")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k {cu_seqlens_k.numel()}; "
            "both must be batch + 1"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if cu_seqlens_q.numel() - 1 > 65535 or q.shape[1] > 65535:
        # The grid's y and z axes (heads, sequences) are limited to 65535 on CUDA.
        raise ValueError(
            f"batch {cu_seqlens_q.numel() - 1} and heads {q.shape[1]}; accepted: at most 65535 of each per call"
        )
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if out is not None:
        expected = (num_tokens, num_heads, v.shape[2])
        if tuple(out.shape) != expected or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
            raise ValueError(
                f"out must be a {q.dtype} tensor of shape {expected} on {q.device} with a contiguous last "
                f"dimension, got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
            )
    if lse is not None:
        expected = (num_heads, num_tokens)
        if tuple(lse.shape) != expected or lse.dtype != torch.float32 or lse.device != q.device or (
            num_tokens > 1 and lse.stride(-1) != 1
        ):
            raise ValueError(
                f"lse must be a float32 tensor of shape {expected} on {q.device} with a contiguous last "
                f"dimension, got {lse.dtype} {tuple(lse.shape)} strides {lse.stride()} on {lse.device}"
            )
