"""Triton cache operations on the paged latent cache ``[num_blocks, block_size, Lkv + R]``.

* `concat_and_cache_mla` writes ``[kv_c | k_pe]`` rows at their slots
  (``slot = block * block_size + offset``; a negative slot is padding and is
  skipped, a slot past the cache is skipped too and sets the ``SLOT`` bit of
  the device's error flag, `mla_multi.errors`).  An FP8 cache is written as
  ``x / scale`` rounded to nearest-even and saturated to the format's largest
  finite value (448 for e4m3fn, 240 for e4m3fnuz), so no value becomes NaN.
* `slot_mapping` computes each new token's slot on the device from the
  requests' query start locations, sequence lengths and block-table rows
  (`CommonAttentionMetadata.from_lengths` on a GPU: no per-token work on the
  host).
* `gather_cache` copies each request's cached tokens ``seq_starts[i] ..
  seq_starts[i] + seq_lens[i]`` into one contiguous ``[sum(seq_lens), Lkv + R]``
  tensor, dequantising an FP8 cache by ``scale``.  An output row whose
  position lies outside its block-table row, whose block lies outside the
  cache, or that no range of ``cu_seq_lens`` covers is NaN, reads nothing
  outside the tensors and sets its bit of the error flag.

FP8 bytes are encoded and decoded with integer arithmetic on every backend:
the NVIDIA backend has no conversion for ``float8_e4m3fnuz`` (and none at all
on sm_80), and these kernels are bound by memory, not arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_multi import errors
from mla_multi.kernels.launch import BoundLaunch, alignment_key, layout_key
from mla_multi.kernels.launch_config import CompileSpec, cache_ops_config
from mla_multi.kernels.mla_decode import _fp8_bits_to_float

__all__ = ["concat_and_cache_mla", "concat_and_cache_quantized", "gather_cache", "slot_mapping", "compile_specs",
           "FP8_MAX", "QUANTIZED_FORMATS"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
_FP8_EXPONENT_BIAS = {torch.float8_e4m3fn: 7, torch.float8_e4m3fnuz: 8}
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32) + FP8_DTYPES
BLOCK_INDEX_ERROR = tl.constexpr(errors.BLOCK_INDEX)
SEQ_RANGE_ERROR = tl.constexpr(errors.SEQ_RANGE)
SLOT_ERROR = tl.constexpr(errors.SLOT)
CU_SEQLENS_ERROR = tl.constexpr(errors.CU_SEQLENS)


@triton.jit
def _float_to_fp8_bits(x, EXPONENT_BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """Encode float32 to e4m3 bytes: saturating, round to nearest even."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    # normal numbers: round the float32 mantissa to 3 bits (ties to even), rebias
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal_code = (rounded >> 20) - ((127 - EXPONENT_BIAS) << 3)
    # subnormals are multiples of 2^-(bias + 2); the float32 add rounds to even
    scaled = magnitude * tl.exp2(EXPONENT_BIAS + 2.0)
    subnormal_code = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    min_normal = tl.exp2(1.0 - EXPONENT_BIAS)
    code = tl.where(magnitude < min_normal, subnormal_code, normal_code)
    if EXPONENT_BIAS == 8:
        # e4m3fnuz has no negative zero (0x80 is its NaN)
        code = tl.where(negative & (code != 0), code | 0x80, code)
    else:
        code = tl.where(negative, code | 0x80, code)
    return code.to(tl.uint8)


@triton.jit
def _write_token_row(
    token,
    KV_c,
    K_pe,
    KV_cache,
    Slot_mapping,
    Scale,
    Error_flag,
    stride_kv_c_t,
    stride_k_pe_t,
    stride_cache_block,
    stride_cache_token,
    block_size,
    num_slots,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Write token `token`'s ``[kv_c | k_pe]`` row into its slot (`concat_and_cache_mla`'s rules)."""
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    # padding tokens (negative slots) write nothing; slots past the cache neither, and are recorded
    past_cache = slot >= num_slots
    tl.atomic_or(Error_flag, SLOT_ERROR, mask=past_cache)
    keep = (slot >= 0) & ~past_cache
    safe_slot = tl.where(keep, slot, 0)
    row = KV_cache + (safe_slot // block_size) * stride_cache_block + (safe_slot % block_size) * stride_cache_token
    offs_c = tl.arange(0, KV_LORA_RANK)
    offs_r = tl.arange(0, ROPE_DIM)
    # the scalar decision as vector masks (built from vectors: the interpreter takes no broadcast scalar mask)
    slot_c = offs_c * 0 + slot
    slot_r = offs_r * 0 + slot
    keep_c = (slot_c >= 0) & (slot_c < num_slots)
    keep_r = (slot_r >= 0) & (slot_r < num_slots)
    kv_c = tl.load(KV_c + token * stride_kv_c_t + offs_c, mask=keep_c, other=0.0)
    k_pe = tl.load(K_pe + token * stride_k_pe_t + offs_r, mask=keep_r, other=0.0)
    if FP8_BIAS != 0:
        inv_scale = 1.0 / tl.load(Scale).to(tl.float32)
        kv_c = _float_to_fp8_bits(kv_c.to(tl.float32) * inv_scale, FP8_BIAS, FP8_MAX)
        k_pe = _float_to_fp8_bits(k_pe.to(tl.float32) * inv_scale, FP8_BIAS, FP8_MAX)
    else:
        kv_c = kv_c.to(KV_cache.dtype.element_ty)
        k_pe = k_pe.to(KV_cache.dtype.element_ty)
    tl.store(row + offs_c, kv_c, mask=keep_c)
    tl.store(row + KV_LORA_RANK + offs_r, k_pe, mask=keep_r)


@triton.jit
def _concat_and_cache_mla_kernel(
    KV_c,
    K_pe,
    KV_cache,
    Slot_mapping,
    Scale,
    Error_flag,
    stride_kv_c_t,
    stride_k_pe_t,
    stride_cache_block,
    stride_cache_token,
    block_size,
    num_slots,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    _write_token_row(tl.program_id(0).to(tl.int64), KV_c, K_pe, KV_cache, Slot_mapping, Scale, Error_flag,
                     stride_kv_c_t, stride_k_pe_t, stride_cache_block, stride_cache_token, block_size, num_slots,
                     KV_LORA_RANK, ROPE_DIM, FP8_BIAS, FP8_MAX)


# the quantising cache formats (`mla_multi.cache_formats`) as the writer kernel names them
QUANTIZED_FORMATS = {"fp8_ds_mla": 0, "fp8_ds_mla_v4": 1, "fp8_ds_mla_v41": 2, "fp4_ds_mla_v41": 3}
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _ue8m0_code(amax):
    """The UE8M0 byte of 2^ceil(log2(max(amax / 448, 1e-4))): that power of two's float32 exponent field, from
    the bits of the float32 quotient (one more where its mantissa is not zero)."""
    x = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-4)
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _bf16_bits(x):
    """float32 -> the bits of its bfloat16 (round to nearest even, as PyTorch's conversion; no NaN in a row)
    as uint16: one rounding on every backend and under the interpreter, which truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _e2m1_code(x):
    """float32 in [-6, 6] -> e2m1 codes 0..15 (nearest, ties to the even code; +0 for a zero result)."""
    m = tl.abs(x)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + (m >= 1.75).to(tl.int32)
            + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    return tl.where((x < 0) & (code > 0), code + 8, code)


@triton.jit
def _quantized_row(KV_c, K_pe, token, stride_kv_c_t, stride_k_pe_t, LATENT: tl.constexpr, ROPE: tl.constexpr):
    """A token's [kv_c | k_pe] as one float32 row of LATENT + ROPE (a power of two) values, and k_pe's values
    (in their dtype) at the row's positions LATENT.. (0 elsewhere)."""
    offs = tl.arange(0, LATENT + ROPE)
    latent = tl.load(KV_c + token * stride_kv_c_t + offs, mask=offs < LATENT, other=0.0)
    rope = tl.load(K_pe + token * stride_k_pe_t + (offs - LATENT), mask=offs >= LATENT, other=0.0)
    return tl.where(offs < LATENT, latent.to(tl.float32), rope.to(tl.float32)), rope


@triton.jit
def _quantize_into_cache_kernel(
    KV_c, K_pe, Cache, Slot_mapping, Error_flag, stride_kv_c_t, stride_k_pe_t, block_bytes, block_size, num_slots,
    FORMAT: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
):
    """Program `token`: its row quantised into the record of its slot in a byte cache of FORMAT
    (`QUANTIZED_FORMATS`), each byte the format's reference quantiser's (`mla_multi.cache_formats`); a
    negative slot writes nothing, a slot past the cache neither and sets the SLOT bit."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    tl.atomic_or(Error_flag, SLOT_ERROR, mask=slot >= num_slots)
    if (slot >= 0) & (slot < num_slots):
        block_base = Cache + (slot // block_size) * block_bytes
        offset = slot % block_size
        if FORMAT == 0:  # fp8_ds_mla: 512 e4m3 | 4 float32 scales (amax / 448) | 64 bf16
            offs = tl.arange(0, LATENT)
            tiles = tl.reshape(tl.load(KV_c + token * stride_kv_c_t + offs).to(tl.float32), [4, LATENT // 4])
            scales = tl.maximum(tl.math.div_rn(tl.max(tl.abs(tiles), axis=1), 448.0), _FLT_MIN)
            codes = _float_to_fp8_bits(tl.math.div_rn(tiles, scales[:, None]), 7, 448.0)
            record = block_base + offset * 656
            tl.store(record + offs, tl.reshape(codes, [LATENT]))
            tl.store((record + LATENT).to(tl.pointer_type(tl.float32)) + tl.arange(0, 4), scales)
            offs_r = tl.arange(0, ROPE)
            rope = tl.load(K_pe + token * stride_k_pe_t + offs_r)
            tl.store((record + LATENT + 16).to(tl.pointer_type(tl.uint16)) + offs_r, _bf16_bits(rope.to(tl.float32)))
        elif FORMAT == 1:  # fp8_ds_mla_v4: 448 e4m3 (7 UE8M0 scales of 64) | 64 bf16; the scales in the block tail
            row, rope = _quantized_row(KV_c, K_pe, token, stride_kv_c_t, stride_k_pe_t, LATENT, ROPE)
            groups = tl.reshape(row, [8, 64])  # the eighth group: the RoPE values, kept bf16
            code = _ue8m0_code(tl.max(tl.abs(groups), axis=1))
            inverse = ((254 - code) << 23).to(tl.float32, bitcast=True)  # 1 / 2^(code - 127), exactly
            values = tl.reshape(_float_to_fp8_bits(groups * inverse[:, None], 7, 448.0), [LATENT + ROPE])
            offs = tl.arange(0, LATENT + ROPE)
            record = block_base + offset * 576
            tl.store(record + offs, values, mask=offs < LATENT)
            tl.store((record + LATENT).to(tl.pointer_type(tl.uint16)) + (offs - LATENT),
                     _bf16_bits(rope.to(tl.float32)), mask=offs >= LATENT)
            tl.store(block_base + block_size * 576 + offset * 8 + tl.arange(0, 8),
                     tl.where(tl.arange(0, 8) < 7, code, 0).to(tl.uint8))
        elif FORMAT == 2:  # fp8_ds_mla_v41: 512 e4m3 (RoPE too) | 16 UE8M0 scales of 32
            row, _ = _quantized_row(KV_c, K_pe, token, stride_kv_c_t, stride_k_pe_t, LATENT, ROPE)
            groups = tl.reshape(row, [16, 32])
            code = _ue8m0_code(tl.max(tl.abs(groups), axis=1))
            inverse = ((254 - code) << 23).to(tl.float32, bitcast=True)
            record = block_base + offset * 528
            tl.store(record + tl.arange(0, 512),
                     tl.reshape(_float_to_fp8_bits(groups * inverse[:, None], 7, 448.0), [512]))
            tl.store(record + 512 + tl.arange(0, 16), code.to(tl.uint8))
        else:  # fp4_ds_mla_v41: 512 e2m1, two a byte (the even value low) | 32 e4m3 scales of 16 (amax / 6)
            row, _ = _quantized_row(KV_c, K_pe, token, stride_kv_c_t, stride_k_pe_t, LATENT, ROPE)
            groups = tl.reshape(row, [32, 16])
            scale_codes = _float_to_fp8_bits(tl.math.div_rn(tl.max(tl.abs(groups), axis=1), 6.0), 7, 448.0)
            scales = _fp8_bits_to_float(scale_codes, 7)
            positive = scales > 0
            scaled = tl.math.div_rn(groups, tl.where(positive, scales, 1.0)[:, None])
            scaled = tl.where(positive[:, None], tl.minimum(tl.maximum(scaled, -6.0), 6.0), 0.0)
            low, high = tl.split(tl.reshape(_e2m1_code(scaled), [256, 2]))
            record = block_base + offset * 288
            tl.store(record + tl.arange(0, 256), (low | (high << 4)).to(tl.uint8))
            tl.store(record + 256 + tl.arange(0, 32), scale_codes)


@triton.jit
def _gather_cache_kernel(
    KV_cache,
    Block_table,
    Cu_seq_lens,
    Seq_starts,
    Out,
    Scale,
    Error_flag,
    batch_size,
    stride_cache_block,
    stride_cache_token,
    stride_bt_b,
    stride_out_t,
    block_size,
    max_blocks,
    num_cache_blocks,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    out_token = tl.program_id(0)
    # the request owning this output row: the last i with cu_seq_lens[i] <= out_token
    # (whatever the values, the search stays inside [0, batch_size - 1])
    low = out_token * 0
    high = low + batch_size - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (low + high + 1) // 2
        go_right = tl.load(Cu_seq_lens + mid) <= out_token
        low = tl.where(go_right, mid, low)
        high = tl.where(go_right, high, mid - 1)
    request = low
    range_start = tl.load(Cu_seq_lens + request)
    covered = (range_start <= out_token) & (out_token < tl.load(Cu_seq_lens + request + 1))
    position = tl.load(Seq_starts + request).to(tl.int64) + (out_token.to(tl.int64) - range_start)
    in_table = (position >= 0) & (position < max_blocks * block_size)
    position = tl.where(covered & in_table, position, 0)
    page = tl.load(Block_table + request.to(tl.int64) * stride_bt_b + position // block_size)
    in_cache = (page >= 0) & (page < num_cache_blocks)
    tl.atomic_or(Error_flag, CU_SEQLENS_ERROR, mask=~covered)
    tl.atomic_or(Error_flag, SEQ_RANGE_ERROR, mask=covered & ~in_table)
    tl.atomic_or(Error_flag, BLOCK_INDEX_ERROR, mask=covered & in_table & ~in_cache)
    valid = covered & in_table & in_cache
    page = tl.where(valid, page, 0).to(tl.int64)
    row = KV_cache + page * stride_cache_block + (position % block_size) * stride_cache_token
    offs_c = tl.arange(0, KV_LORA_RANK)
    offs_r = tl.arange(0, ROPE_DIM)
    kv_c = tl.load(row + offs_c)
    k_pe = tl.load(row + KV_LORA_RANK + offs_r)
    if FP8_BIAS != 0:
        kv_c = _fp8_bits_to_float(kv_c, FP8_BIAS)
        k_pe = _fp8_bits_to_float(k_pe, FP8_BIAS)
    else:
        kv_c = kv_c.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(Scale).to(tl.float32)
        kv_c = kv_c * scale
        k_pe = k_pe * scale
    kv_c = tl.where(valid, kv_c, float("nan"))
    k_pe = tl.where(valid, k_pe, float("nan"))
    out_row = Out + out_token.to(tl.int64) * stride_out_t
    tl.store(out_row + offs_c, kv_c.to(Out.dtype.element_ty))
    tl.store(out_row + KV_LORA_RANK + offs_r, k_pe.to(Out.dtype.element_ty))


def _split_row_width(kv_cache: torch.Tensor, kv_lora_rank: int | None) -> tuple[int, int]:
    width = kv_cache.shape[-1]
    if kv_lora_rank is None:
        # DeepSeek rows are 512 + 64; other power-of-two splits are found by size
        rope = 64 if width > 64 and ((width - 64) & (width - 65)) == 0 else width & -width
        kv_lora_rank = width - rope
    rope_dim = width - kv_lora_rank
    for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        if value < 1 or value & (value - 1):
            raise ValueError(
                f"kv_cache row width {width} splits into {name}={value}; accepted: powers of two "
                "(DeepSeek: 512 + 64)"
            )
    return kv_lora_rank, rope_dim


def _launch_view(kv_cache: torch.Tensor):
    """(is FP8, the cache as the kernels read it (FP8 as bytes), the launch configuration)."""
    from mla_multi.platforms import current_platform

    fp8 = kv_cache.dtype in FP8_DTYPES
    return fp8, kv_cache.view(torch.uint8) if fp8 else kv_cache, cache_ops_config(current_platform())


def _error_flag(error_flag: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if error_flag is None:
        return errors.error_flag(device)
    if error_flag.shape != (1,) or error_flag.dtype != torch.int32 or error_flag.device != device:
        raise ValueError(
            f"error_flag has shape {tuple(error_flag.shape)}, dtype {error_flag.dtype} on {error_flag.device}; "
            f"accepted: [1] int32 on {device}"
        )
    return error_flag


def _check_scale(kv_cache: torch.Tensor, scale) -> None:
    if kv_cache.dtype in FP8_DTYPES:
        if scale is None or not torch.is_tensor(scale) or scale.numel() != 1:
            raise ValueError(
                f"scale={scale!r} with a {kv_cache.dtype} kv_cache; accepted: a float32 tensor of 1 element"
            )
        if scale.device != kv_cache.device:
            raise ValueError(f"scale is on {scale.device}, kv_cache on {kv_cache.device}; accepted: the same device")


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    error_flag: torch.Tensor | None = None,
) -> "ConcatAndCachePlan | None":
    """Write ``[kv_c | k_pe]`` of each token into its cache slot; returns the bound write it launched
    (tensors of this layout launch it and nothing else), None for no token.

    Args:
        kv_c: [T, Lkv] float16/bfloat16/float32.
        k_pe: [T, R], same dtype as kv_c.
        kv_cache: [num_blocks, block_size, Lkv + R], written in place; float16,
            bfloat16, float32 or FP8 (float8_e4m3fn / float8_e4m3fnuz).
        slot_mapping: [T] int64; slot = block * block_size + offset, negative = skip.
        scale: float32 tensor of 1 element, required for an FP8 cache (the
            stored value is x / scale, saturated).
        error_flag: int32 [1] that slots past the cache are ORed into
            (`mla_multi.errors.SLOT`); default the device's flag. Such a token is
            not written.
    """
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)}; accepted: [T, Lkv] and [T, R]"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != kv_c.shape[1] + k_pe.shape[1]:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; accepted: [num_blocks, block_size, "
            f"{kv_c.shape[1] + k_pe.shape[1]}]"
        )
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype}; accepted: {', '.join(map(str, _CACHE_DTYPES))}")
    if slot_mapping.shape != (kv_c.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping has shape {tuple(slot_mapping.shape)} and dtype {slot_mapping.dtype}; "
            f"accepted: [{kv_c.shape[0]}] int64"
        )
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("kv_c, k_pe and kv_cache must have a contiguous last dimension")
    _split_row_width(kv_cache, kv_c.shape[1])
    _check_scale(kv_cache, scale)
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return None
    error_flag = _error_flag(error_flag, kv_cache.device)
    key = (layout_key(kv_c), layout_key(k_pe), layout_key(kv_cache), layout_key(slot_mapping),
           None if scale is None else layout_key(scale), error_flag.data_ptr())
    plan = _plan_of_layout(_CONCAT_LAUNCHES, key,
                           lambda: ConcatAndCachePlan(kv_c, k_pe, kv_cache, slot_mapping, scale, error_flag))
    plan.launch(kv_c, k_pe, kv_cache, slot_mapping, scale)
    return plan


def _plan_of_layout(plans: dict, key, make):
    """The plan of `key` in `plans` (a bounded cache: emptied at 256 entries), made by `make()` the first time."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 256:
            plans.clear()
        plan = plans[key] = make()
    return plan


class ConcatAndCachePlan:
    """The bound cache-write kernel of one layout (the token count included): `launch` only launches.

    Built from checked tensors (`concat_and_cache_mla` checks them); valid for
    any tensors of the same shapes, strides, dtypes, devices and alignment.
    """

    def __init__(self, kv_c, k_pe, kv_cache, slot_mapping, scale, error_flag) -> None:
        fp8, cache, config = _launch_view(kv_cache)
        self.fp8 = fp8
        self.error_flag = error_flag
        self.int_args = (
            kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1), kv_cache.shape[1],
            kv_cache.shape[0] * kv_cache.shape[1],
        )
        self.bound = BoundLaunch(
            _concat_and_cache_mla_kernel,
            (kv_c.shape[0],),
            dict(
                KV_LORA_RANK=kv_c.shape[1],
                ROPE_DIM=k_pe.shape[1],
                FP8_BIAS=_FP8_EXPONENT_BIAS[kv_cache.dtype] if fp8 else 0,
                FP8_MAX=FP8_MAX[kv_cache.dtype] if fp8 else 0.0,
                **config.launch_options(),
            ),
            kv_cache.device,
        )

    def launch(self, kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
        cache = kv_cache.view(torch.uint8) if self.fp8 else kv_cache
        self.bound(kv_c, k_pe, cache, slot_mapping, scale if self.fp8 else slot_mapping, self.error_flag,
                   *self.int_args)


# the plans of concat_and_cache_mla, by the layout of its tensors (the token count included)
_CONCAT_LAUNCHES: dict = {}


def concat_and_cache_quantized(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, kv_format: str, *,
                               error_flag: torch.Tensor | None = None) -> "QuantizedCacheWrite | None":
    """Quantise each token's ``[kv_c | k_pe]`` into its slot's record of a byte cache in `kv_format` (one of
    `QUANTIZED_FORMATS`), one launch: the bytes of the format's reference quantiser
    (`mla_multi.cache_formats.CacheFormat.quantize`), its padding byte 0; a negative slot is skipped, a slot
    past the cache too and recorded in the error flag. The caller checked the tensors (`mla_multi.ops`):
    kv_c [T, width - 64], k_pe [T, 64] of one float dtype with contiguous rows, kv_cache uint8 with the
    format's strides, slot_mapping [T] int64 or int32.

    The UE8M0 scales come from the float32 quotient's bits (2^ceil(log2(x)) exactly); the reference takes
    `torch.log2`, whose float32 result for an x within a few units in the last place above a power of two
    can round down to the integer: there the reference's scale is half this one (and the group's largest value
    saturates to 448), a case the golden data and random rows do not meet. Returns the bound write it
    launched (`QuantizedCacheWrite`: tensors of this layout launch it and nothing else), None for no token."""
    if kv_c.shape[0] == 0:
        return None
    error_flag = _error_flag(error_flag, kv_cache.device)
    key = (kv_format, layout_key(kv_c), layout_key(k_pe), layout_key(kv_cache), layout_key(slot_mapping),
           error_flag.data_ptr())
    plan = _plan_of_layout(_QUANTIZED_LAUNCHES, key,
                           lambda: QuantizedCacheWrite(kv_c, k_pe, kv_cache, slot_mapping, kv_format, error_flag))
    plan.launch(kv_c, k_pe, kv_cache, slot_mapping)
    return plan


class QuantizedCacheWrite:
    """The bound quantising cache writer of one layout (the token count included): `launch` only launches."""

    def __init__(self, kv_c, k_pe, kv_cache, slot_mapping, kv_format: str, error_flag) -> None:
        from mla_multi.cache_formats import get_format
        from mla_multi.platforms import current_platform

        fmt = get_format(kv_format)
        block_size = kv_cache.shape[1]
        self.error_flag = error_flag
        self.ints = (kv_c.stride(0), k_pe.stride(0), fmt.block_bytes(block_size), block_size,
                     kv_cache.shape[0] * block_size)
        self.bound = BoundLaunch(
            _quantize_into_cache_kernel, (kv_c.shape[0],),
            dict(FORMAT=QUANTIZED_FORMATS[kv_format], LATENT=kv_c.shape[1], ROPE=k_pe.shape[1],
                 **cache_ops_config(current_platform()).launch_options()),
            kv_cache.device,
        )

    def launch(self, kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
        """(`scale`: unused, the formats' scales come from the data; taken as every cache write's plan takes it)"""
        self.bound(kv_c, k_pe, kv_cache, slot_mapping, self.error_flag, *self.ints)


# the plans of concat_and_cache_quantized, by format and the layout of its tensors (the token count included)
_QUANTIZED_LAUNCHES: dict = {}


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    seq_starts: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    kv_lora_rank: int | None = None,
    error_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each request's cached tokens into one contiguous tensor.

    Args:
        kv_cache: [num_blocks, block_size, Lkv + R] (float or FP8).
        block_table: [B, max_blocks] int32.
        cu_seq_lens: [B + 1] int32, cumulative lengths of the gathered ranges (starts at 0).
        seq_starts: [B] int32, first cached position of each range.
        out: [cu_seq_lens[-1], Lkv + R] float16/bfloat16/float32, written;
            row cu_seq_lens[i] + j is position seq_starts[i] + j of request i.
        scale: float32 tensor of 1 element, required for an FP8 cache (dequantisation).
        kv_lora_rank: Lkv (default: 512 for 576-wide rows, else inferred).
        error_flag: int32 [1] that bad indices are ORed into (`mla_multi.errors` bits);
            default the device's flag. A row whose position lies outside
            [0, max_blocks * block_size), whose block lies outside the cache, or
            that no range of cu_seq_lens covers is NaN; nothing outside the
            tensors is read whatever the index values.

    Returns:
        out.
    """
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; accepted: [num_blocks, block_size, Lkv + R]")
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype}; accepted: {', '.join(map(str, _CACHE_DTYPES))}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table has shape {tuple(block_table.shape)} and dtype {block_table.dtype}; "
            "accepted: [B, max_blocks] int32"
        )
    batch = block_table.shape[0]
    if cu_seq_lens.shape != (batch + 1,) or cu_seq_lens.dtype != torch.int32:
        raise ValueError(
            f"cu_seq_lens has shape {tuple(cu_seq_lens.shape)} and dtype {cu_seq_lens.dtype}; "
            f"accepted: [{batch + 1}] int32"
        )
    if seq_starts.shape != (batch,) or seq_starts.dtype != torch.int32:
        raise ValueError(
            f"seq_starts has shape {tuple(seq_starts.shape)} and dtype {seq_starts.dtype}; accepted: [{batch}] int32"
        )
    if out.dim() != 2 or out.shape[1] != kv_cache.shape[-1] or out.dtype not in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ):
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; accepted: [total_tokens, "
            f"{kv_cache.shape[-1]}] float16/bfloat16/float32"
        )
    if out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("out and kv_cache must have a contiguous last dimension")
    lora, rope = _split_row_width(kv_cache, kv_lora_rank)
    _check_scale(kv_cache, scale)
    total = out.shape[0]
    if total == 0:
        return out
    if batch == 0 or block_table.shape[1] == 0 or kv_cache.shape[0] * kv_cache.shape[1] == 0:
        # nothing can be read: every row is one that no valid position covers
        _error_flag(error_flag, kv_cache.device).bitwise_or_(errors.CU_SEQLENS if batch == 0 else errors.SEQ_RANGE)
        return out.fill_(float("nan"))
    error_flag = _error_flag(error_flag, kv_cache.device)
    fp8, cache, config = _launch_view(kv_cache)
    _gather_cache_kernel[(total,)](
        cache,
        block_table,
        cu_seq_lens,
        seq_starts,
        out,
        scale if scale is not None else cu_seq_lens,
        error_flag,
        batch,
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        kv_cache.shape[1],
        block_table.shape[1],
        kv_cache.shape[0],
        KV_LORA_RANK=lora,
        ROPE_DIM=rope,
        SEARCH_STEPS=batch.bit_length() + 1,
        FP8_BIAS=_FP8_EXPONENT_BIAS[kv_cache.dtype] if fp8 else 0,
        HAS_SCALE=scale is not None,
        **config.launch_options(),
    )
    return out


@triton.jit
def _slot_mapping_kernel(Query_start_loc, Seq_lens, Block_table, Slots, stride_table, block_size,
                         BLOCK: tl.constexpr):
    """One program a request: its new tokens sit at the last query_len positions of its sequence; each one's
    slot is block_table[req, pos // block_size] * block_size + pos % block_size (the host checked that every
    position lies inside the request's block-table row)."""
    req = tl.program_id(0)
    q_start = tl.load(Query_start_loc + req)
    q_end = tl.load(Query_start_loc + req + 1)
    first = tl.load(Seq_lens + req) - (q_end - q_start)
    row = Block_table + req.to(tl.int64) * stride_table
    for t0 in range(q_start, q_end, BLOCK):
        tokens = t0 + tl.arange(0, BLOCK)
        inside = tokens < q_end
        positions = first + (tokens - q_start)
        block = tl.load(row + positions // block_size, mask=inside, other=0)
        tl.store(Slots + tokens, block.to(tl.int64) * block_size + positions % block_size, mask=inside)


_SLOT_BLOCK = 256
# bound launches of the slot kernel by (device, the block table's row stride and the block size as Triton
# specialises them, the tensors' alignment): one launch a step, without Triton's dispatch
_SLOT_LAUNCHES: dict = {}


def slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                 num_tokens: int) -> torch.Tensor:
    """int64 [num_tokens]: the slot of every new token of the batch, computed on the device of `block_table`
    (query_start_loc [B + 1] and seq_lens [B] int32 there too, already checked against the table)."""
    slots = torch.empty(num_tokens, dtype=torch.int64, device=block_table.device)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return slots
    stride = block_table.stride(0)
    key = (block_table.device, stride == 1, stride % 16 == 0, block_size == 1, block_size % 16 == 0,
           alignment_key(query_start_loc, seq_lens, block_table, slots))
    launch = _SLOT_LAUNCHES.get(key)
    if launch is None:
        if len(_SLOT_LAUNCHES) >= 64:
            _SLOT_LAUNCHES.clear()
        launch = _SLOT_LAUNCHES[key] = BoundLaunch(_slot_mapping_kernel, (num_reqs,),
                                                   dict(BLOCK=_SLOT_BLOCK, num_warps=4), block_table.device)
    launch.grid = (num_reqs, 1, 1)
    launch(query_start_loc, seq_lens, block_table, slots, stride, block_size)
    return slots


def compile_specs(platform) -> list[CompileSpec]:
    """The cache kernels for `platform`: bf16 and FP8 (e4m3fn bytes) caches, DeepSeek rows."""
    config = cache_ops_config(platform)
    options = config.launch_options()
    specs = [CompileSpec(
        name="slot_mapping",
        fn=_slot_mapping_kernel,
        signature={"Query_start_loc": "*i32", "Seq_lens": "*i32", "Block_table": "*i32", "Slots": "*i64",
                   "stride_table": "i32", "block_size": "i32", "BLOCK": "constexpr"},
        constexprs={"BLOCK": _SLOT_BLOCK},
        options={"num_warps": 4},
        divisible_by_16=("Query_start_loc", "Seq_lens", "Block_table", "Slots", "block_size"),
    )]
    for kv_format, code in QUANTIZED_FORMATS.items():
        specs.append(CompileSpec(
            name=f"concat_and_cache_quantized[{config.name},{kv_format}]",
            fn=_quantize_into_cache_kernel,
            signature={"KV_c": "*bf16", "K_pe": "*bf16", "Cache": "*u8", "Slot_mapping": "*i64", "Error_flag": "*i32",
                       "stride_kv_c_t": "i32", "stride_k_pe_t": "i32", "block_bytes": "i32", "block_size": "i32",
                       "num_slots": "i32", "FORMAT": "constexpr", "LATENT": "constexpr", "ROPE": "constexpr"},
            constexprs={"FORMAT": code, "LATENT": 512 if kv_format == "fp8_ds_mla" else 448, "ROPE": 64},
            options=options,
            divisible_by_16=("KV_c", "K_pe", "Cache", "Slot_mapping", "stride_kv_c_t", "stride_k_pe_t", "block_bytes"),
        ))
    for fp8 in (False, True):
        cache_type = "*u8" if fp8 else "*bf16"
        specs.append(
            CompileSpec(
                name=f"concat_and_cache_mla[{config.name},kv={'fp8' if fp8 else 'bf16'}]",
                fn=_concat_and_cache_mla_kernel,
                signature={
                    "KV_c": "*bf16",
                    "K_pe": "*bf16",
                    "KV_cache": cache_type,
                    "Slot_mapping": "*i64",
                    "Scale": "*fp32" if fp8 else "*i64",
                    "Error_flag": "*i32",
                    "stride_kv_c_t": "i32",
                    "stride_k_pe_t": "i32",
                    "stride_cache_block": "i32",
                    "stride_cache_token": "i32",
                    "block_size": "i32",
                    "num_slots": "i32",
                    "KV_LORA_RANK": "constexpr",
                    "ROPE_DIM": "constexpr",
                    "FP8_BIAS": "constexpr",
                    "FP8_MAX": "constexpr",
                },
                constexprs={
                    "KV_LORA_RANK": 512,
                    "ROPE_DIM": 64,
                    "FP8_BIAS": 7 if fp8 else 0,
                    "FP8_MAX": 448.0 if fp8 else 0.0,
                },
                options=options,
                divisible_by_16=("KV_c", "K_pe", "KV_cache", "Slot_mapping", "stride_cache_block", "stride_cache_token"),
            )
        )
        specs.append(
            CompileSpec(
                name=f"gather_cache[{config.name},kv={'fp8' if fp8 else 'bf16'}]",
                fn=_gather_cache_kernel,
                signature={
                    "KV_cache": cache_type,
                    "Block_table": "*i32",
                    "Cu_seq_lens": "*i32",
                    "Seq_starts": "*i32",
                    "Out": "*bf16",
                    "Scale": "*fp32" if fp8 else "*i32",
                    "Error_flag": "*i32",
                    "batch_size": "i32",
                    "stride_cache_block": "i32",
                    "stride_cache_token": "i32",
                    "stride_bt_b": "i32",
                    "stride_out_t": "i32",
                    "block_size": "i32",
                    "max_blocks": "i32",
                    "num_cache_blocks": "i32",
                    "KV_LORA_RANK": "constexpr",
                    "ROPE_DIM": "constexpr",
                    "SEARCH_STEPS": "constexpr",
                    "FP8_BIAS": "constexpr",
                    "HAS_SCALE": "constexpr",
                },
                constexprs={
                    "KV_LORA_RANK": 512,
                    "ROPE_DIM": 64,
                    "SEARCH_STEPS": 9,
                    "FP8_BIAS": 7 if fp8 else 0,
                    "HAS_SCALE": fp8,
                },
                options=options,
                divisible_by_16=("KV_cache", "Out", "stride_cache_block", "stride_cache_token", "stride_out_t"),
            )
        )
    return specs
