"""LSE correction of decode context parallelism: one kernel between the two collectives.

Under decode context parallelism every rank decodes all heads of the layer
over its own shard of the tokens, giving a partial output and LSE per
(request, head). After the LSEs of all ranks are all-gathered, this kernel
computes per (row, head)

    lse    = log(sum_r exp(lse_r))                  (the LSE over the whole sequence)
    factor = exp(lse_own - lse)                     (this rank's share of the softmax mass)
    dest[head // N_local, row, head % N_local] = factor * out_own[row, head]

in float32, around the maximum over ranks so nothing overflows. The
destination is laid out rank-major, so that a reduce-scatter of it sums the
ranks' shares and hands each rank its own heads. The rules are those of
`merge_attn_states`: an LSE of ``+inf`` counts as ``-inf`` (a rank without
tokens), a rank with LSE ``-inf`` contributes nothing even if its partial
output holds NaN, and when every rank is ``-inf`` the output is 0 and the LSE
``-inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dcp_correct", "compile_specs", "kernel_constexprs", "CORRECT_BLOCK_HEADS"]

# Heads per program: an [8, 512] float32 tile keeps 128 threads busy with
# 16-byte accesses; the grid is rows x heads / 8.
CORRECT_BLOCK_HEADS = 8
_CORRECT_NUM_WARPS = 4


@triton.jit
def _dcp_correct_kernel(
    Dest,
    DestLse,
    PartialOut,
    Lses,
    rank,
    world_size,
    num_local_heads,
    num_heads,
    stride_d_w,
    stride_d_r,
    stride_d_h,
    stride_dl_r,
    stride_p_r,
    stride_p_h,
    stride_l_w,
    stride_l_r,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    head_in = offs_h < num_heads
    tile_in = head_in[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_row = Lses + row * stride_l_r + offs_h

    max_lse = tl.full([BLOCK_HEADS], float("-inf"), tl.float32)
    for r in range(0, world_size):
        lse = tl.load(lse_row + r * stride_l_w, mask=head_in, other=float("-inf"))
        lse = tl.where(lse == float("inf"), float("-inf"), lse)
        max_lse = tl.maximum(max_lse, lse)
    all_empty = max_lse == float("-inf")
    # exp(-inf - (-inf)) is NaN: shift by 0 where no rank has a token.
    max_safe = tl.where(all_empty, 0.0, max_lse)
    total = tl.zeros([BLOCK_HEADS], tl.float32)
    for r in range(0, world_size):
        lse = tl.load(lse_row + r * stride_l_w, mask=head_in, other=float("-inf"))
        lse = tl.where(lse == float("inf"), float("-inf"), lse)
        total += tl.exp(lse - max_safe)
    total_safe = tl.where(all_empty, 1.0, total)
    own = tl.load(lse_row + rank * stride_l_w, mask=head_in, other=float("-inf"))
    own = tl.where(own == float("inf"), float("-inf"), own)
    factor = tl.exp(own - max_safe) / total_safe

    partial = tl.load(
        PartialOut + row * stride_p_r + offs_h[:, None] * stride_p_h + offs_d[None, :], mask=tile_in, other=0.0
    ).to(tl.float32)
    # Select rather than multiply by a zero factor: a rank without tokens may
    # hold anything in its partial output (0 * NaN = NaN).
    corrected = tl.where(factor[:, None] > 0.0, partial * factor[:, None], 0.0)
    owner = offs_h // num_local_heads
    local_head = offs_h - owner * num_local_heads
    tl.store(
        Dest + owner[:, None] * stride_d_w + row * stride_d_r + local_head[:, None] * stride_d_h + offs_d[None, :],
        corrected.to(Dest.dtype.element_ty),
        mask=tile_in,
    )
    global_lse = tl.where(all_empty, float("-inf"), tl.log(total_safe) + max_safe)
    tl.store(DestLse + row * stride_dl_r + local_head, global_lse, mask=head_in & (owner == rank))


def kernel_constexprs(head_dim: int) -> dict:
    """Compile-time arguments for one head dim (shared with the compile check)."""
    return {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_HEADS": CORRECT_BLOCK_HEADS}


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(name: str, value, accepted: str):
    got = (
        f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}, strides={value.stride()})"
        if isinstance(value, torch.Tensor)
        else repr(value)
    )
    raise ValueError(f"{name}={got}; accepted: {accepted}")


def dcp_correct(
    partial_output: torch.Tensor,
    lses: torch.Tensor,
    rank: int,
    num_local_heads: int,
    dest: torch.Tensor | None = None,
    dest_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale this rank's partial decode output by its share of the softmax mass.

    Args:
        partial_output: [R, N, D] float16/bfloat16/float32, this rank's decode of
            all N = world_size * num_local_heads heads over its tokens (R rows:
            requests, or request-token pairs); last dimension contiguous.
        lses: [world_size, R, N] float32, every rank's partial LSE (all-gathered),
            last dimension contiguous.
        rank: this rank, 0 <= rank < world_size.
        num_local_heads: heads per rank; head h belongs to rank h // num_local_heads.
        dest: optional [world_size, R, num_local_heads, D] buffer (any of the three
            float dtypes), last dimension contiguous; default a new contiguous
            tensor in partial_output's dtype.
        dest_lse: optional [R, num_local_heads] float32 buffer.

    Returns:
        (dest, dest_lse): dest[w, row, h] = this rank's corrected output of head
        w * num_local_heads + h (the input of a reduce-scatter over dim 0),
        dest_lse the LSE over all ranks of this rank's own heads. Launches on
        the current stream, never synchronises (CUDA-graph safe).
    """
    if not isinstance(partial_output, torch.Tensor) or partial_output.dim() != 3:
        _fail("partial_output", partial_output, "a 3-D tensor [R, N, D]")
    if partial_output.dtype not in _SUPPORTED_DTYPES:
        _fail("partial_output", partial_output, "float16, bfloat16 or float32")
    rows, num_heads, head_dim = partial_output.shape
    device = partial_output.device
    if head_dim > 1 and partial_output.stride(-1) != 1:
        _fail("partial_output", partial_output, "a contiguous last dimension")
    if not isinstance(num_local_heads, int) or num_local_heads < 1 or num_heads % num_local_heads:
        _fail("num_local_heads", num_local_heads, f"a positive divisor of the {num_heads} heads of partial_output")
    world_size = num_heads // num_local_heads
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        _fail("rank", rank, f"an int in [0, {world_size})")
    if (
        not isinstance(lses, torch.Tensor)
        or tuple(lses.shape) != (world_size, rows, num_heads)
        or lses.dtype != torch.float32
        or lses.device != device
        or (num_heads > 1 and lses.stride(-1) != 1)
    ):
        _fail("lses", lses, f"float32 [{world_size}, {rows}, {num_heads}] on {device}, last dimension contiguous")
    dest_shape = (world_size, rows, num_local_heads, head_dim)
    if dest is None:
        dest = torch.empty(dest_shape, dtype=partial_output.dtype, device=device)
    elif (
        not isinstance(dest, torch.Tensor)
        or tuple(dest.shape) != dest_shape
        or dest.dtype not in _SUPPORTED_DTYPES
        or dest.device != device
        or (head_dim > 1 and dest.stride(-1) != 1)
    ):
        _fail("dest", dest, f"float {list(dest_shape)} on {device}, last dimension contiguous")
    if dest_lse is None:
        dest_lse = torch.empty((rows, num_local_heads), dtype=torch.float32, device=device)
    elif (
        not isinstance(dest_lse, torch.Tensor)
        or tuple(dest_lse.shape) != (rows, num_local_heads)
        or dest_lse.dtype != torch.float32
        or dest_lse.device != device
        or (num_local_heads > 1 and dest_lse.stride(-1) != 1)
    ):
        _fail("dest_lse", dest_lse, f"float32 [{rows}, {num_local_heads}] on {device}, last dimension contiguous")
    if rows == 0 or head_dim == 0:
        return dest, dest_lse
    grid = (rows, triton.cdiv(num_heads, CORRECT_BLOCK_HEADS))
    _dcp_correct_kernel[grid](
        dest,
        dest_lse,
        partial_output,
        lses,
        rank,
        world_size,
        num_local_heads,
        num_heads,
        dest.stride(0),
        dest.stride(1),
        dest.stride(2),
        dest_lse.stride(0),
        partial_output.stride(0),
        partial_output.stride(1),
        lses.stride(0),
        lses.stride(1),
        num_warps=_CORRECT_NUM_WARPS,
        **kernel_constexprs(head_dim),
    )
    return dest, dest_lse


_TRITON_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_specs(platform) -> list:
    """Kernel instances for the ahead-of-time compile check: the decode latent width
    (512) in bfloat16 and float16. The launch options are the same on every platform."""
    from mla_multi.kernels.launch_config import CompileSpec

    specs = []
    for dtype in (torch.bfloat16, torch.float16):
        ty = _TRITON_DTYPE_NAMES[dtype]
        signature = {"Dest": f"*{ty}", "DestLse": "*fp32", "PartialOut": f"*{ty}", "Lses": "*fp32"}
        ints = [
            "rank", "world_size", "num_local_heads", "num_heads", "stride_d_w", "stride_d_r", "stride_d_h",
            "stride_dl_r", "stride_p_r", "stride_p_h", "stride_l_w", "stride_l_r",
        ]  # fmt: skip
        signature.update({name: "i32" for name in ints})
        constexprs = kernel_constexprs(512)
        signature.update({name: "constexpr" for name in constexprs})
        specs.append(
            CompileSpec(
                name=f"dcp_correct[d512,{ty}]",
                fn=_dcp_correct_kernel,
                signature=signature,
                constexprs=constexprs,
                options={"num_warps": _CORRECT_NUM_WARPS, "num_stages": 1},
                # Output strides are multiples of the 512-wide rows; LSE strides are head counts: any value.
                divisible_by_16=("Dest", "DestLse", "PartialOut", "Lses", "stride_d_w", "stride_d_r", "stride_d_h",
                                 "stride_p_r", "stride_p_h"),
            )
        )
    return specs
