"""Merge two partial attention results by their log-sum-exp.

Chunked prefill computes attention over the cached context in pieces (each
non-causal, returning its LSE) and over the new tokens (causal); the pieces are
combined exactly with

    lse  = log(exp(lse_p) + exp(lse_s))
    out  = out_p * exp(lse_p - lse) + out_s * exp(lse_s - lse)

computed around ``max(lse_p, lse_s)`` so nothing overflows. Conventions (the
same as vLLM's ``merge_attn_states``): an LSE of ``+inf`` is treated as ``-inf``
(a side with no keys), and when both sides are ``-inf`` the output is 0 and the
LSE ``-inf``, never NaN. A side whose LSE is ``-inf`` contributes nothing, even
if its output holds garbage.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_attn_states", "compile_specs", "kernel_constexprs", "MERGE_BLOCK_HEADS"]

# Heads merged per program: a [BLOCK_HEADS, head_dim] tile keeps every thread
# busy with 16-byte accesses while the grid stays at tokens x heads/BLOCK_HEADS.
MERGE_BLOCK_HEADS = 8
_MERGE_NUM_WARPS = 4


@triton.jit
def merge_scales(lse_a, lse_b):
    """The module docstring's merge of two sides' LSEs: (scale of side a, scale of side b, merged LSE). An LSE of
    +inf counts as -inf (an empty side); a scale is 0 exactly where its side is empty; both empty: scales 0
    and LSE -inf. Callers select rather than multiply by a zero scale (0 * NaN = NaN). Shared by the merge
    kernel and the prefill kernels' in-kernel merge."""
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    lse_b = tl.where(lse_b == float("inf"), float("-inf"), lse_b)
    lse_max = tl.maximum(lse_a, lse_b)
    both_empty = lse_max == float("-inf")
    lse_max = tl.where(both_empty, 0.0, lse_max)
    w_a = tl.exp(lse_a - lse_max)
    w_b = tl.exp(lse_b - lse_max)
    total = tl.where(both_empty, 1.0, w_a + w_b)
    return w_a / total, w_b / total, tl.where(both_empty, float("-inf"), tl.log(total) + lse_max)


@triton.jit
def _merge_attn_states_kernel(
    Out,
    OutLse,
    PrefixOut,
    PrefixLse,
    SuffixOut,
    SuffixLse,
    num_heads,
    stride_o_t,
    stride_o_h,
    stride_ol_h,
    stride_po_t,
    stride_po_h,
    stride_pl_h,
    stride_so_t,
    stride_so_h,
    stride_sl_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    head_in = offs_h < num_heads
    tile_in = head_in[:, None] & (offs_d[None, :] < HEAD_DIM)

    p_lse = tl.load(PrefixLse + offs_h * stride_pl_h + token, mask=head_in, other=float("-inf"))
    s_lse = tl.load(SuffixLse + offs_h * stride_sl_h + token, mask=head_in, other=float("-inf"))
    p_scale, s_scale, out_lse = merge_scales(p_lse, s_lse)

    p_out = tl.load(
        PrefixOut + token * stride_po_t + offs_h[:, None] * stride_po_h + offs_d[None, :], mask=tile_in, other=0.0
    ).to(tl.float32)
    s_out = tl.load(
        SuffixOut + token * stride_so_t + offs_h[:, None] * stride_so_h + offs_d[None, :], mask=tile_in, other=0.0
    ).to(tl.float32)
    # Select rather than multiply by a zero scale: a side without keys may hold
    # uninitialised values (0 * NaN = NaN).
    merged = tl.where(p_scale[:, None] > 0.0, p_out * p_scale[:, None], 0.0)
    merged += tl.where(s_scale[:, None] > 0.0, s_out * s_scale[:, None], 0.0)
    # a NaN LSE on either side (a state a NaN reached) makes the merged row and its LSE NaN (the NaN policy)
    nan_lse = (p_lse != p_lse) | (s_lse != s_lse)
    merged = tl.where(nan_lse[:, None], float("nan"), merged)
    out_lse = tl.where(nan_lse, float("nan"), out_lse)
    tl.store(
        Out + token * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :],
        merged.to(Out.dtype.element_ty),
        mask=tile_in,
    )
    if STORE_LSE:
        tl.store(OutLse + offs_h * stride_ol_h + token, out_lse, mask=head_in)


def kernel_constexprs(head_dim: int, store_lse: bool = True) -> dict:
    """Compile-time arguments for one head dim (shared with the compile check)."""
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "BLOCK_HEADS": MERGE_BLOCK_HEADS,
        "STORE_LSE": bool(store_lse),
    }


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_output(name: str, t, shape, dtype_ok, device):
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {got}")
    if not dtype_ok(t.dtype):
        raise ValueError(f"{name}.dtype is {t.dtype}, which is not accepted here")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device}")
    if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    *,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine two partial attention results over disjoint key sets.

    Args:
        prefix_output, suffix_output: ``[num_tokens, num_heads, head_dim]`` float16/bfloat16/
            float32 (same shape and dtype), last dimension contiguous.
        prefix_lse, suffix_lse: ``[num_heads, num_tokens]`` float32 natural-log LSE;
            ``+inf`` is read as ``-inf`` (no keys on that side).
        output: optional ``[num_tokens, num_heads, head_dim]`` buffer (any of the three
            float dtypes); default a new tensor in prefix_output's dtype. It may alias
            prefix_output or suffix_output (each element is read before it is written).
        output_lse: optional ``[num_heads, num_tokens]`` float32 buffer.
        return_lse: when False and ``output_lse`` is None, no LSE is computed (``None``).

    Returns:
        ``(output, output_lse)``; where both sides are ``-inf`` the output is 0 and the
        LSE ``-inf``.
    """
    if not isinstance(prefix_output, torch.Tensor) or prefix_output.dim() != 3:
        got = tuple(prefix_output.shape) if isinstance(prefix_output, torch.Tensor) else type(prefix_output).__name__
        raise ValueError(f"prefix_output must be a 3-D tensor [num_tokens, num_heads, head_dim], got {got}")
    if prefix_output.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"prefix_output.dtype is {prefix_output.dtype}; accepted: float16, bfloat16, float32")
    num_tokens, num_heads, head_dim = prefix_output.shape
    device = prefix_output.device
    is_float = lambda dt: dt in _SUPPORTED_DTYPES  # noqa: E731
    is_f32 = lambda dt: dt == torch.float32  # noqa: E731
    _check_output("prefix_output", prefix_output, prefix_output.shape, is_float, device)
    _check_output(
        "suffix_output", suffix_output, prefix_output.shape, lambda dt: dt == prefix_output.dtype, device
    )
    _check_output("prefix_lse", prefix_lse, (num_heads, num_tokens), is_f32, device)
    _check_output("suffix_lse", suffix_lse, (num_heads, num_tokens), is_f32, device)
    if output is None:
        output = torch.empty_like(prefix_output, memory_format=torch.contiguous_format)
    else:
        _check_output("output", output, prefix_output.shape, is_float, device)
    store_lse = output_lse is not None or return_lse
    if output_lse is None and store_lse:
        output_lse = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=device)
    elif output_lse is not None:
        _check_output("output_lse", output_lse, (num_heads, num_tokens), is_f32, device)
    if num_tokens == 0 or num_heads == 0:
        return output, output_lse
    grid = (num_tokens, triton.cdiv(num_heads, MERGE_BLOCK_HEADS))
    _merge_attn_states_kernel[grid](
        output,
        output_lse if store_lse else output,
        prefix_output,
        prefix_lse,
        suffix_output,
        suffix_lse,
        num_heads,
        output.stride(0),
        output.stride(1),
        output_lse.stride(0) if store_lse else 0,
        prefix_output.stride(0),
        prefix_output.stride(1),
        prefix_lse.stride(0),
        suffix_output.stride(0),
        suffix_output.stride(1),
        suffix_lse.stride(0),
        num_warps=_MERGE_NUM_WARPS,
        **kernel_constexprs(head_dim, store_lse),
    )
    return output, output_lse


_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_specs(platform) -> list:
    """Kernel instances for the ahead-of-time compile check: the prefill output (head dim
    128) in bfloat16 and float16 with and without the output LSE, and the decode latent
    width (512) in bfloat16. The launch options are the same on every platform."""
    from mla_multi.kernels.launch_config import CompileSpec

    specs = []
    for dtype, head_dim, store_lse in (
        (torch.bfloat16, 128, True),
        (torch.bfloat16, 128, False),
        (torch.float16, 128, True),
        (torch.bfloat16, 512, True),
    ):
        ty = _TRITON_DTYPE_NAMES[dtype]
        signature = {
            "Out": f"*{ty}", "OutLse": "*fp32", "PrefixOut": f"*{ty}", "PrefixLse": "*fp32",
            "SuffixOut": f"*{ty}", "SuffixLse": "*fp32", "num_heads": "i32",
        }  # fmt: skip
        strides = [
            "stride_o_t", "stride_o_h", "stride_ol_h", "stride_po_t", "stride_po_h", "stride_pl_h",
            "stride_so_t", "stride_so_h", "stride_sl_h",
        ]  # fmt: skip
        signature.update({name: "i32" for name in strides})
        constexprs = kernel_constexprs(head_dim, store_lse)
        signature.update({name: "constexpr" for name in constexprs})
        specs.append(
            CompileSpec(
                name=f"merge_attn_states[d{head_dim},{ty}{'' if store_lse else ',no-lse'}]",
                fn=_merge_attn_states_kernel,
                signature=signature,
                constexprs=constexprs,
                options={"num_warps": _MERGE_NUM_WARPS, "num_stages": 1},
                # LSE head strides are token counts: any value.
                divisible_by_16=("Out", "OutLse", "PrefixOut", "PrefixLse", "SuffixOut", "SuffixLse",
                                 "stride_o_t", "stride_o_h", "stride_po_t", "stride_po_h", "stride_so_t", "stride_so_h"),
            )
        )
    return specs
