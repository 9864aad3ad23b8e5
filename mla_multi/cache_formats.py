"""The byte formats of the sparse MLA latent caches, each described once.

A format says how many bytes one cached token takes, where its values and
scales sit, how a block is padded, which dtypes it needs, and how rows are
quantised into it and read back (PyTorch, any device).  Every op, backend and
kernel asks the format instead of comparing widths itself.

=================  =====  ======================================================================
name               bytes  layout of one token (FlashMLA's name)
=================  =====  ======================================================================
``fp8_ds_mla``       656  DeepSeek-V3.2 (``V32``): 512 e4m3 latent values, 4 float32 scales
                          (one per 128 values), 64 bf16 RoPE values; token after token.
``fp8_ds_mla_v4``    584  DeepSeek-V4 "MODEL1" (``V4``): 448 e4m3 latent values + 64 bf16 RoPE
                          values (576 bytes) for every token of the block first, then each
                          token's 7 UE8M0 scales (one per 64 values) + 1 pad byte in the
                          block's tail; the block padded to a multiple of 576 bytes.
``fp8_ds_mla_v41``   528  DeepSeek-V4.1 (``V41``): 512 e4m3 values (the RoPE dims quantised
                          too), then 16 UE8M0 scales (one per 32 values); token after token.
``fp4_ds_mla_v41``   288  DeepSeek-V4.1 FP4 (``V41_FP4``): 512 e2m1 values two a byte (the
                          even-indexed one in the low nibble), then 32 e4m3 scales (one per 16
                          values); token after token; only a second KV segment beside a
                          ``fp8_ds_mla_v41`` main cache.
=================  =====  ======================================================================

A cache is ``uint8 [num_blocks, block_size, bytes_per_token]`` whose block
stride is ``block_bytes(block_size)`` (`CacheFormat.allocate` makes one).  For
``fp8_ds_mla_v4`` that stride is the padded block and the two inner dimensions
are nominal (the shape FlashMLA's interface takes: slot ``block * block_size +
offset`` lives at ``block * block_bytes + offset * 576`` and its scales at
``block * block_bytes + block_size * 576 + offset * 8``); the other formats are
plain contiguous caches.

Scales: ``fp8_ds_mla`` keeps ``max(amax / 448, FLT_MIN)`` as float32 (the
package's writer since V3.2; ``power_of_two_scales=True`` gives FlashMLA's
reference quantiser's power-of-two scales).  The UE8M0 formats store
``2 ** ceil(log2(max(amax / 448, 1e-4)))`` (FlashMLA's ``tests/quant.py``).
``fp4_ds_mla_v41`` stores ``e4m3(amax / 6)`` per 16 values and rounds each
value / scale to nearest-even e2m1 (±0, 0.5, 1, 1.5, 2, 3, 4, 6), saturated at 6;
a value that rounds to zero is stored as +0.  Every reader accepts any scale the
bytes hold.  The bytes of ``fp8_ds_mla`` (with ``power_of_two_scales``) and
``fp8_ds_mla_v4`` equal FlashMLA's quantiser's on the same bf16 rows
(tests/data/, generated at deepseek-ai/FlashMLA 9241ae3ef9bac614dd25e45e507e089f888280e0);
the V4.1 layouts follow the published interface of ``sgl-flash-mla`` 1.0.0,
whose source read had no V4.1 quantiser.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = [
    "CacheFormat",
    "FORMATS",
    "FP8_DS_MLA",
    "FP8_DS_MLA_V4",
    "FP8_DS_MLA_V41",
    "FP4_DS_MLA_V41",
    "V4_FORMATS",
    "get_format",
    "format_of",
    "check_cache",
]

_FP8_MAX = 448.0
_FP4_MAX = 6.0
_FLT_MIN = torch.finfo(torch.float32).tiny
_UE8M0_FLOOR = 1e-4  # FlashMLA's clamp of amax / 448 before rounding the scale up to a power of two


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ue8m0_scales(amax: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(max(amax / 448, 1e-4))) in float32 (amax float32)."""
    return torch.pow(2, torch.clamp_min(amax.float() / _FP8_MAX, _UE8M0_FLOOR).log2().ceil()).float()


def _ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> their UE8M0 bytes (the float32 exponent field)."""
    return (scales.float().contiguous().view(torch.int32) >> 23).bitwise_and(0xFF).to(torch.uint8)


def _ue8m0_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """UE8M0 bytes -> 2 ** (byte - 127) in `dtype` (0xFF, NaN in the format, is read as NaN)."""
    exponent = codes.to(torch.int32) - 127
    values = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=codes.device), exponent.double()).to(dtype)
    return torch.where(codes == 0xFF, torch.full_like(values, float("nan")), values)


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn bytes (round to nearest even; callers keep |values| <= 448)."""
    return values.float().to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).to(dtype)


# e2m1 magnitudes by code; a value rounds up past a threshold (">" where the tie goes down to the even
# code, ">=" where it goes up to it)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP_AT = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit e2m1 codes (uint8 0..15), nearest even, saturated at 6, +0 for a zero result."""
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for threshold, inclusive in _E2M1_UP_AT:
        code += (magnitude >= threshold if inclusive else magnitude > threshold).to(torch.uint8)
    negative = (values < 0) & (code > 0)
    return code + negative.to(torch.uint8) * 8


def _e2m1_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    table = torch.tensor(_E2M1_VALUES, dtype=dtype, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """One cache byte format (see the module's table).

    name: the package's name; flashmla_name: FlashMLA's (its ``kv_format``);
    model: the model generation; width: values a token (the attention's d_qk);
    rope_dims: the trailing RoPE values; bytes_per_token; data_bytes: a token's
    value bytes (values and, where unquantised, the bf16 RoPE part) before its
    scale bytes; scale_bytes: a token's scale bytes (pad included);
    values_per_scale; value_dtype / scale_dtype: the element formats (names);
    quantizes_rope: the RoPE dims are quantised with the rest (else kept bf16);
    scales_in_block_tail: the scales sit after all the block's tokens' data;
    block_align: a block's bytes are padded to a multiple of this;
    second_segment_only: valid only as the second KV segment;
    main_formats: the main formats it may accompany as a second segment;
    dtypes_needed: the torch dtypes its quantiser and reader use.
    """

    name: str
    flashmla_name: str
    model: str
    width: int
    rope_dims: int
    bytes_per_token: int
    data_bytes: int
    scale_bytes: int
    values_per_scale: int
    value_dtype: str
    scale_dtype: str
    quantizes_rope: bool = False
    scales_in_block_tail: bool = False
    block_align: int = 1
    second_segment_only: bool = False
    main_formats: tuple[str, ...] = ()
    dtypes_needed: tuple[torch.dtype, ...] = (torch.uint8, torch.float8_e4m3fn)
    _quantize: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    _dequantize: Callable | None = dataclasses.field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ geometry

    @property
    def num_scales(self) -> int:
        return (self.width - (0 if self.quantizes_rope else self.rope_dims)) // self.values_per_scale

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one cache block of `block_size` tokens (padding included): the block stride."""
        raw = block_size * self.bytes_per_token
        return -(-raw // self.block_align) * self.block_align

    def allocate(self, num_blocks: int, block_size: int, device=None, *, fill: int | None = 0) -> torch.Tensor:
        """A zeroed cache: uint8 [num_blocks, block_size, bytes_per_token] with the format's block stride
        (`fill=None`: uninitialised)."""
        stride = self.block_bytes(block_size)
        maker = torch.empty if fill is None else torch.zeros
        storage = maker(num_blocks * stride, dtype=torch.uint8, device=device)
        if fill:
            storage.fill_(fill)
        return storage.as_strided((num_blocks, block_size, self.bytes_per_token), (stride, self.bytes_per_token, 1))

    def cache_reason(self, cache: torch.Tensor) -> str:
        """Why `cache` is not a cache of this format ("" when it is)."""
        if not torch.is_tensor(cache):
            return f"a {type(cache).__name__}, not a tensor"
        if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != self.bytes_per_token:
            return (f"dtype {cache.dtype}, shape {tuple(cache.shape)}; the {self.name} format is uint8 "
                    f"[num_blocks, block_size, {self.bytes_per_token}]")
        block_size = cache.shape[1]
        expected = (self.block_bytes(block_size), self.bytes_per_token, 1)
        strides = tuple(cache.stride())
        if ((cache.shape[0] > 1 and strides[0] != expected[0]) or strides[2] != 1
                or (block_size > 1 and strides[1] != expected[1])):
            return (f"strides {strides}; the {self.name} format of blocks of {block_size} needs strides {expected}"
                    + (f" (blocks padded to a multiple of {self.block_align} bytes: CacheFormat.allocate)"
                       if self.block_align > 1 else ""))
        return ""

    # ------------------------------------------------------------------ token records

    def quantize(self, rows: torch.Tensor, **options) -> torch.Tensor:
        """[T, width] float rows -> uint8 [T, bytes_per_token] token records (a token's data bytes, then its
        scale bytes: the cache bytes themselves except for the block-tail scales of ``fp8_ds_mla_v4``)."""
        if rows.dim() != 2 or rows.shape[-1] != self.width:
            raise ValueError(f"rows of shape {tuple(rows.shape)}; the {self.name} format takes [T, {self.width}]")
        if not rows.is_floating_point():
            raise ValueError(f"rows of dtype {rows.dtype}; accepted: a float dtype")
        return self._quantize(self, rows, **options)

    def dequantize(self, records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [..., bytes_per_token] token records -> [..., width] values in `dtype`."""
        if records.dtype != torch.uint8 or records.shape[-1] != self.bytes_per_token:
            raise ValueError(f"records of dtype {records.dtype} and last dimension {records.shape[-1]}; the "
                             f"{self.name} format's are uint8 [..., {self.bytes_per_token}]")
        lead = records.shape[:-1]
        flat = records.reshape(-1, self.bytes_per_token)
        return self._dequantize(self, flat, dtype).reshape(*lead, self.width)

    # ------------------------------------------------------------------ caches

    def _byte_offsets(self, block_size: int, slots: torch.Tensor) -> torch.Tensor:
        """[S, bytes_per_token] byte offsets of the token records of `slots` (int64) in the flat cache."""
        block, offset = slots // block_size, slots % block_size
        base = block * self.block_bytes(block_size)
        record = torch.arange(self.bytes_per_token, device=slots.device)
        if not self.scales_in_block_tail:
            return (base + offset * self.bytes_per_token).unsqueeze(1) + record
        data = (base + offset * self.data_bytes).unsqueeze(1) + record[: self.data_bytes]
        tail = (base + block_size * self.data_bytes + offset * self.scale_bytes).unsqueeze(1) + record[: self.scale_bytes]
        return torch.cat([data, tail], dim=1)

    def _flat(self, cache: torch.Tensor) -> torch.Tensor:
        num_blocks, block_size, _ = cache.shape
        size = max(0, (num_blocks - 1) * self.block_bytes(block_size) + block_size * self.bytes_per_token)
        return cache.as_strided((size,), (1,), cache.storage_offset())

    def read_records(self, cache: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [S, bytes_per_token] token records of `slots` (every slot when None) of a cache."""
        num_blocks, block_size, _ = cache.shape
        if slots is None:
            slots = torch.arange(num_blocks * block_size, device=cache.device)
        if slots.numel() == 0 or num_blocks == 0:
            return torch.zeros(slots.numel(), self.bytes_per_token, dtype=torch.uint8, device=cache.device)
        return self._flat(cache)[self._byte_offsets(block_size, slots.long())]

    def write_records(self, cache: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Put token records at `slots` (int64, each in [0, num_slots); later duplicates win on the CPU)."""
        if slots.numel() == 0:
            return
        offsets = self._byte_offsets(cache.shape[1], slots.long())
        self._flat(cache).index_put_((offsets.reshape(-1),), records.reshape(-1))

    def read_rows(self, cache: torch.Tensor, dtype: torch.dtype = torch.float32, slots: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The cache's tokens dequantised: [S, width] in `dtype` (every slot when `slots` is None)."""
        return self.dequantize(self.read_records(cache, slots), dtype)

    def write_rows(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, **options) -> None:
        """Quantise [S, width] rows into the cache at `slots` (int64, each in [0, num_slots))."""
        self.write_records(cache, slots, self.quantize(rows, **options))


# ---------------------------------------------------------------------------- fp8_ds_mla (V3.2)


def _quantize_ds_mla(fmt: CacheFormat, rows: torch.Tensor, *, power_of_two_scales: bool = False) -> torch.Tensor:
    tokens = rows.shape[0]
    latent_width = fmt.width - fmt.rope_dims
    tiles = rows[:, :latent_width].float().reshape(tokens, fmt.num_scales, fmt.values_per_scale)
    amax = tiles.abs().amax(dim=-1)
    scales = _ue8m0_scales(amax) if power_of_two_scales else (amax / _FP8_MAX).clamp_min(_FLT_MIN)
    values = (tiles / scales.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX)
    out = torch.empty(tokens, fmt.bytes_per_token, dtype=torch.uint8, device=rows.device)
    out[:, :latent_width] = _e4m3(values).reshape(tokens, latent_width)
    out[:, latent_width:latent_width + 4 * fmt.num_scales] = scales.contiguous().view(torch.uint8).reshape(tokens, -1)
    out[:, latent_width + 4 * fmt.num_scales:] = (
        rows[:, latent_width:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(tokens, -1))
    return out


def _dequantize_ds_mla(fmt: CacheFormat, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    latent_width = fmt.width - fmt.rope_dims
    # float32 products (value x float32 scale), as every fp8_ds_mla kernel computes them
    values = _e4m3_values(flat[:, :latent_width], torch.float32).reshape(-1, fmt.num_scales, fmt.values_per_scale)
    scales = flat[:, latent_width:latent_width + 4 * fmt.num_scales].contiguous().view(torch.float32)
    rope = flat[:, latent_width + 4 * fmt.num_scales:].contiguous().view(torch.bfloat16)
    latent = (values * scales.unsqueeze(-1)).reshape(-1, latent_width)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


# ---------------------------------------------------------------------------- fp8_ds_mla_v4 (V4 "MODEL1")


def _quantize_v4(fmt: CacheFormat, rows: torch.Tensor) -> torch.Tensor:
    tokens = rows.shape[0]
    latent_width = fmt.width - fmt.rope_dims
    tiles = rows[:, :latent_width].float().reshape(tokens, fmt.num_scales, fmt.values_per_scale)
    scales = _ue8m0_scales(tiles.abs().amax(dim=-1))
    out = torch.zeros(tokens, fmt.bytes_per_token, dtype=torch.uint8, device=rows.device)
    out[:, :latent_width] = _e4m3(tiles / scales.unsqueeze(-1)).reshape(tokens, latent_width)
    out[:, latent_width:fmt.data_bytes] = rows[:, latent_width:].to(torch.bfloat16).contiguous().view(
        torch.uint8).reshape(tokens, -1)
    out[:, fmt.data_bytes:fmt.data_bytes + fmt.num_scales] = _ue8m0_bytes(scales)
    return out  # the pad byte stays 0


def _dequantize_v4(fmt: CacheFormat, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    latent_width = fmt.width - fmt.rope_dims
    compute = _compute(dtype)
    values = _e4m3_values(flat[:, :latent_width], compute).reshape(-1, fmt.num_scales, fmt.values_per_scale)
    scales = _ue8m0_values(flat[:, fmt.data_bytes:fmt.data_bytes + fmt.num_scales], compute)
    rope = flat[:, latent_width:fmt.data_bytes].contiguous().view(torch.bfloat16)
    latent = (values * scales.unsqueeze(-1)).reshape(-1, latent_width)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


# ---------------------------------------------------------------------------- fp8_ds_mla_v41 (V4.1)


def _quantize_v41(fmt: CacheFormat, rows: torch.Tensor) -> torch.Tensor:
    tokens = rows.shape[0]
    tiles = rows.float().reshape(tokens, fmt.num_scales, fmt.values_per_scale)
    scales = _ue8m0_scales(tiles.abs().amax(dim=-1))
    out = torch.empty(tokens, fmt.bytes_per_token, dtype=torch.uint8, device=rows.device)
    out[:, :fmt.data_bytes] = _e4m3(tiles / scales.unsqueeze(-1)).reshape(tokens, fmt.data_bytes)
    out[:, fmt.data_bytes:] = _ue8m0_bytes(scales)
    return out


def _dequantize_v41(fmt: CacheFormat, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    compute = _compute(dtype)
    values = _e4m3_values(flat[:, :fmt.data_bytes], compute).reshape(-1, fmt.num_scales, fmt.values_per_scale)
    scales = _ue8m0_values(flat[:, fmt.data_bytes:], compute)
    return (values * scales.unsqueeze(-1)).reshape(-1, fmt.width).to(dtype)


# ---------------------------------------------------------------------------- fp4_ds_mla_v41 (V4.1 FP4)


def _quantize_fp4(fmt: CacheFormat, rows: torch.Tensor) -> torch.Tensor:
    tokens = rows.shape[0]
    groups = rows.float().reshape(tokens, fmt.num_scales, fmt.values_per_scale)
    scale_codes = _e4m3((groups.abs().amax(dim=-1) / _FP4_MAX).clamp_max(_FP8_MAX))
    scales = _e4m3_values(scale_codes, torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    scaled = torch.where(scales.unsqueeze(-1) > 0, groups / safe, torch.zeros_like(groups))
    codes = _e2m1_codes(scaled.clamp(-_FP4_MAX, _FP4_MAX)).reshape(tokens, fmt.width)
    out = torch.empty(tokens, fmt.bytes_per_token, dtype=torch.uint8, device=rows.device)
    out[:, :fmt.data_bytes] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, fmt.data_bytes:] = scale_codes
    return out


def _dequantize_fp4(fmt: CacheFormat, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    compute = _compute(dtype)
    packed = flat[:, :fmt.data_bytes]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1, fmt.width)
    values = _e2m1_values(codes, compute).reshape(-1, fmt.num_scales, fmt.values_per_scale)
    scales = _e4m3_values(flat[:, fmt.data_bytes:], compute)
    return (values * scales.unsqueeze(-1)).reshape(-1, fmt.width).to(dtype)


FP8_DS_MLA = CacheFormat(
    name="fp8_ds_mla", flashmla_name="V32", model="DeepSeek-V3.2", width=576, rope_dims=64, bytes_per_token=656,
    data_bytes=512, scale_bytes=16, values_per_scale=128, value_dtype="float8_e4m3fn", scale_dtype="float32",
    dtypes_needed=(torch.uint8, torch.float8_e4m3fn, torch.float32, torch.bfloat16),
    _quantize=_quantize_ds_mla, _dequantize=_dequantize_ds_mla,
)
# data_bytes: the 448 e4m3 values and the 64 bf16 RoPE values; the scale bytes hold 7 scales and a pad byte
FP8_DS_MLA_V4 = CacheFormat(
    name="fp8_ds_mla_v4", flashmla_name="V4", model="DeepSeek-V4", width=512, rope_dims=64, bytes_per_token=584,
    data_bytes=576, scale_bytes=8, values_per_scale=64, value_dtype="float8_e4m3fn", scale_dtype="float8_e8m0fnu",
    scales_in_block_tail=True, block_align=576, dtypes_needed=(torch.uint8, torch.float8_e4m3fn, torch.bfloat16),
    _quantize=_quantize_v4, _dequantize=_dequantize_v4,
)
FP8_DS_MLA_V41 = CacheFormat(
    name="fp8_ds_mla_v41", flashmla_name="V41", model="DeepSeek-V4.1", width=512, rope_dims=64, bytes_per_token=528,
    data_bytes=512, scale_bytes=16, values_per_scale=32, value_dtype="float8_e4m3fn", scale_dtype="float8_e8m0fnu",
    quantizes_rope=True, _quantize=_quantize_v41, _dequantize=_dequantize_v41,
)
FP4_DS_MLA_V41 = CacheFormat(
    name="fp4_ds_mla_v41", flashmla_name="V41_FP4", model="DeepSeek-V4.1", width=512, rope_dims=64,
    bytes_per_token=288, data_bytes=256, scale_bytes=32, values_per_scale=16, value_dtype="float4_e2m1fn (x2)",
    scale_dtype="float8_e4m3fn", quantizes_rope=True, second_segment_only=True, main_formats=("fp8_ds_mla_v41",),
    _quantize=_quantize_fp4, _dequantize=_dequantize_fp4,
)

FORMATS: dict[str, CacheFormat] = {f.name: f for f in (FP8_DS_MLA, FP8_DS_MLA_V4, FP8_DS_MLA_V41, FP4_DS_MLA_V41)}
# the formats of the V4 contract (d_qk = d_v = 512)
V4_FORMATS: tuple[str, ...] = ("fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41")
_BY_BYTES = {f.bytes_per_token: f for f in FORMATS.values()}


def get_format(name: str) -> CacheFormat:
    """The format called `name` (ValueError naming the accepted ones otherwise)."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kv_format={name!r}; accepted: {', '.join(FORMATS)}") from None


def format_of(cache: torch.Tensor) -> CacheFormat | None:
    """The byte format of a uint8 cache by its bytes a token (None for a float cache or an unknown width)."""
    if not torch.is_tensor(cache) or cache.dtype != torch.uint8 or cache.dim() == 0:
        return None
    return _BY_BYTES.get(cache.shape[-1])


def check_cache(name: str, cache: torch.Tensor, kv_format: str | None = None, *,
                accepted: tuple[str, ...] | None = None) -> CacheFormat:
    """The format of the cache argument `name` (`kv_format` when given, else found from its width); raises
    ValueError naming `name` when the cache is not one of that format or of `accepted`."""
    if kv_format is not None:
        fmt = get_format(kv_format)
    else:
        fmt = format_of(cache)
        if fmt is None:
            names = accepted or tuple(FORMATS)
            widths = ", ".join(f"{FORMATS[n].bytes_per_token} ({n})" for n in names)
            shape = tuple(cache.shape) if torch.is_tensor(cache) else type(cache).__name__
            dtype = cache.dtype if torch.is_tensor(cache) else None
            raise ValueError(f"{name} of dtype {dtype} and shape {shape} is in no cache format; accepted: uint8 "
                             f"[num_blocks, block_size, bytes a token] with {widths} bytes a token")
    if accepted is not None and fmt.name not in accepted:
        raise ValueError(f"{name} is a {fmt.name} cache ({fmt.bytes_per_token} bytes a token); accepted here: "
                         f"{', '.join(accepted)}")
    reason = fmt.cache_reason(cache)
    if reason:
        raise ValueError(f"{name} has {reason}")
    return fmt

