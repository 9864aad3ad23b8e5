"""Launch configurations of the package's Triton kernels, for NVIDIA and AMD, in one place.

Every choice is a function of a `Platform` (vendor, arch, shared memory / LDS
per block), never of ``torch.version``: tests and the ahead-of-time compile
check impersonate any device.  Each kernel family has its own section;
`all_*_configs(platform)` lists every configuration the code can choose so the
compile check can build each one for each target.

AMD-only options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) are
passed only when the installed Triton's HIP backend declares them
(`hip_option_names`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from mla_multi import checks, envs

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

__all__ = [
    "CompileSpec",
    "DecodeLaunchConfig",
    "DecodeReduceLaunchConfig",
    "CacheOpsLaunchConfig",
    "hip_option_names",
    "decode_config",
    "all_decode_configs",
    "decode_reduce_config",
    "all_decode_reduce_configs",
    "fp8_bit_decode_needed",
    "load_k_transposed",
    "cache_ops_config",
]


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """One kernel instance for the ahead-of-time compile check.

    Attributes:
        name: readable id, e.g. "mla_decode_split[h64n32w8s2,kv=bf16,page=64,partial]".
        fn: the ``@triton.jit`` function.
        signature: argument name -> Triton type ("*bf16", "i32", "fp32", "constexpr").
        constexprs: constexpr argument name -> value.
        options: compile options (num_warps, num_stages and backend options).
        divisible_by_16: arguments (pointers, strides) that a real launch sees
            16-divisible; the JIT specialises them and so must the compile check,
            or loads lose their vector width and their pipelining.
    """

    name: str
    fn: Callable[..., Any]
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    divisible_by_16: tuple[str, ...] = ()


@functools.lru_cache(maxsize=1)
def tl_range_disables_licm() -> bool:
    """Whether the installed Triton's ``tl.range`` takes ``disable_licm`` (3.5 and later)."""
    import inspect

    import triton.language as tl

    return "disable_licm" in inspect.signature(tl.range.__init__).parameters


@functools.lru_cache(maxsize=1)
def hip_option_names() -> frozenset[str]:
    """Fields of the installed Triton's ``HIPOptions`` (empty if the HIP backend is absent)."""
    try:
        from triton.backends.amd.compiler import HIPOptions

        return frozenset(field.name for field in dataclasses.fields(HIPOptions))
    except Exception:  # a Triton without the AMD backend: no AMD-only options
        return frozenset()


def _amd_options(**options: Any) -> dict[str, Any]:
    accepted = hip_option_names()
    return {key: value for key, value in options.items() if value is not None and key in accepted}


# ---------------------------------------------------------------------------
# decode (mla_multi.kernels.mla_decode)
# ---------------------------------------------------------------------------


class _MatrixTileLaunch:
    """Name suffix and launch options shared by the attention tile configurations
    (fields num_warps, num_stages, waves_per_eu, matrix_instr_nonkdim, kpack)."""

    def _amd_suffix(self) -> str:
        text = ""
        if self.waves_per_eu is not None:
            text += f"wpe{self.waves_per_eu}"
        if self.matrix_instr_nonkdim is not None:
            text += f"mi{self.matrix_instr_nonkdim}"
        if self.kpack is not None:
            text += f"kp{self.kpack}"
        return text

    def launch_options(self) -> dict[str, Any]:
        """Keyword options for a Triton launch or ``triton.compile``."""
        options: dict[str, Any] = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        options.update(
            _amd_options(
                waves_per_eu=self.waves_per_eu,
                matrix_instr_nonkdim=self.matrix_instr_nonkdim,
                kpack=self.kpack,
            )
        )
        return options


# config-name suffix of each sm_90 warpgroup kernel (`DecodeLaunchConfig.kernel`)
DECODE_KERNEL_SUFFIXES = {"wgmma_ws": "ws", "wgmma_rm": "rm"}
# every `DecodeLaunchConfig.kernel`: the Triton split kernel and the sm_90 warpgroup kernels
DECODE_KERNELS = ("triton", *DECODE_KERNEL_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig(_MatrixTileLaunch):
    """Tile and launch options of the split-KV decode kernel.

    Attributes:
        block_h: query rows (heads x folded query tokens) per program; >= 16, the MMA minimum.
        block_n: cache tokens per tile.
        num_warps, num_stages: Triton launch options (num_stages = software pipeline depth).
        programs_per_cu: programs that run at once on one SM / CU with this
            configuration (register and shared-memory bound), used by the split heuristic.
        waves_per_eu, matrix_instr_nonkdim, kpack: AMD options (None elsewhere).
        disable_licm: keep the tile loop's invariants inside it (``tl.range(...,
            disable_licm=True)``, Triton >= 3.5; ignored by older ones): what
            keeps the sm_90 64-row tiles free of spills (`_decode_table`).
        kernel: ``"triton"`` (the Triton split kernel, `mla_decode`), or one of
            the sm_90 warp-specialised Gluon kernels of `mla_decode_wgmma`:
            ``"wgmma_ws"`` (the cache tokens as the MMA's M) or ``"wgmma_rm"``
            (the query rows as M); for these ``num_warps`` = 4 is the first
            warpgroup's and ``num_stages`` their cp.async depth.  Anything
            else is a ValueError (`DECODE_KERNELS`).
        raw_stages: FP8 caches on the warp-specialised kernels only: > 0 copies
            the cache's bytes with cp.async into this many raw FP8 stages and
            computes QK on the FP8 tensor cores from them, with the query
            quantised to e4m3 per row; the loader converts each tile's latent
            part once into the ``num_stages`` float16 stages that P V reads;
            with ``num_stages`` = 0 (``wgmma_ws``, up to 16 rows) there are no
            float16 stages and P V runs on the FP8 tensor cores too, V read
            from the raw stage into registers and P as e4m3.
            0: the whole tile converted to float16, float16 products.
        tma: the warp-specialised kernels' loaders that copy tiles as they are
            (16-bit caches, and FP8 bytes into raw stages): whole tiles are
            copied by TMA (two bulk tensor copies a tile, issued by one
            thread) where the cache allows it (`mla_decode_wgmma.tma_cache_reason`:
            pages a multiple of ``block_n``, rows 16-byte aligned and evenly
            spaced across blocks), by cp.async otherwise and for a split's
            partial last tile.
        tokens_as_m: the Triton kernel (``kernel="triton"``) computes QK as
            K Q^T, the tile's cache tokens as the matrix op's M: with
            ``block_n`` >= 16 x ``num_warps`` the warps split the tokens and
            each QK product is computed once.  With the query rows as M, AMD's
            compiler puts every warp of a chained QK on M, and a block of
            fewer than 16 x ``num_warps`` rows computes the same QK in several
            warps (`mla_multi.compile_check` reports this as ``mma_repeat``).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_cu: int = 1
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None
    disable_licm: bool = False
    kernel: str = "triton"
    raw_stages: int = 0
    tma: bool = False
    tokens_as_m: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in DECODE_KERNELS:
            raise ValueError(
                f"kernel {self.kernel!r}; accepted: {', '.join(repr(kernel) for kernel in DECODE_KERNELS)}"
            )
        if self.tokens_as_m and self.kernel != "triton":
            raise ValueError(f"tokens_as_m is an option of the Triton kernel, not of kernel {self.kernel!r}")

    @property
    def name(self) -> str:
        text = f"h{self.block_h}n{self.block_n}w{self.num_warps}s{self.num_stages}"
        if self.disable_licm:
            text += "nolicm"
        if self.tokens_as_m:
            text += "tm"
        text += DECODE_KERNEL_SUFFIXES.get(self.kernel, "")
        if self.raw_stages:
            text += f"f{self.raw_stages}"
        if self.tma:
            text += "t"
        return text + self._amd_suffix()

    @property
    def warpgroup(self) -> bool:
        """Whether this configuration runs one of the sm_90 warpgroup kernels (`mla_decode_wgmma`)."""
        return self.kernel != "triton"

    @property
    def warp_specialised(self) -> bool:
        """Whether this configuration runs the warp-specialised warpgroup kernel (``wgmma_ws`` or ``wgmma_rm``)."""
        return self.kernel in ("wgmma_ws", "wgmma_rm")


@dataclasses.dataclass(frozen=True)
class DecodeReduceLaunchConfig:
    """Launch options of the split merge: `block_dv` output columns of one (token, head)
    per program, reading `block_splits` splits per step."""

    block_dv: int
    block_splits: int
    num_warps: int
    num_stages: int = 1

    @property
    def name(self) -> str:
        return f"dv{self.block_dv}s{self.block_splits}w{self.num_warps}"

    def launch_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def _decode_table(
    platform, fp8: bool = False, wgmma: bool = True, fp8_qk: bool = True
) -> dict[str, DecodeLaunchConfig]:
    """The decode configurations of a platform by row bucket ("16", "32", "64").

    Chosen from the ahead-of-time compile report (registers, spills, shared
    memory / LDS) of each target, then timed where a device was at hand:

    * sm_90 (227 KiB): 16 rows x 64-token tiles, 2 stages (191
      registers, 94 KiB, no spill; 99% of the HBM copy rate at B=128,
      S=16384 on an H200).  Past 32 rows, 64 rows x 64-token tiles on 8 warps
      (wgmma), 221 KiB, no spill: 257 TFLOP/s at B=128, S=4096, N=128 on an
      H200, against 175 for the 16-row tile.  The 64 x 512 float32 output
      takes 128 of the 255 registers; the tile loop runs without loop-invariant
      code motion (`disable_licm`), which would otherwise compute the
      shared-memory descriptors of the query tile's 36 wgmma k-steps before the
      loop and hold them across it (168-264 bytes of stack, 262 TFLOP/s).  At 32
      heads two 16-row blocks beat one padded 64-row block (2.54 against 2.01
      TB/s at B=128, S=4096), at 64 heads the 64-row block wins (1.97 against
      1.39).  bench/RESULTS.md has the measurements.
    * sm_100 (227 KiB): the 16-row tile for every head count until a B200 has
      run the 64-row one (Triton lowers it to tcgen05 there and its compiled
      resource report is implausible).
    * sm_80 (163 KiB): 32-token tiles.
    * gfx942 / gfx950 (CDNA3 / CDNA4, 64 / 160 KiB LDS): up to 16 rows,
      16-token tiles on 4 warps, waves_per_eu=2 (gfx942 FP8: 1), where decode
      is bound by memory.  From 17 rows on, 64-token tiles with the tokens as
      the matrix op's M (`DecodeLaunchConfig.tokens_as_m`) on 4 warps, 32 rows
      a block, one program per CU, no spill: each warp computes a quarter of
      the tile's QK once, where the rows-as-M tiles (16/32 x 16 tokens on 4 or
      8 warps) computed each QK element in 2-4 warps.  At 32-128 heads that is
      2.6x fewer matrix instructions per cache token (gfx942 bf16; gfx950 up
      to 32 rows), 1.5x fewer matrix FLOPs (gfx942 FP8; gfx950 bf16 past 32
      rows, which reads the cache with twice as many head blocks).  gfx950
      FP8: the 32-row tile spills, so 16 rows for 17-32 and the 64-row tile
      past 32 (16-row blocks would read the cache 8 times at 128 heads).
    * RDNA (warp 32, 64 KiB LDS, WMMA): 16-token tiles, 4 / 8 warps.

    FP8 caches pass the tile through registers for the conversion, so their
    tiles are smaller where the bf16 shapes would spill (sm_80/90/100, gfx942).
    """
    arch = platform.arch
    smem = platform.max_shared_memory_per_block
    if wgmma and arch == "sm_90" and not wgmma_decode_reason(platform, torch.float8_e4m3fn if fp8 else torch.bfloat16):
        return _sm90_wgmma_table(fp8, fp8_qk)
    if platform.is_cuda() and fp8:
        if smem >= 200 * 1024:
            narrow = DecodeLaunchConfig(16, 64, 8, 2, programs_per_cu=2)
            # no spill without loop-invariant code motion, as the bf16 64-row
            # tile, and with one stage: the query scaled into float16's range is
            # a register operand, which two stages spill (336-728 bytes)
            wide = DecodeLaunchConfig(64, 32, 8, 1, programs_per_cu=1, disable_licm=True)
            if arch != "sm_90":
                wide = narrow
        else:  # sm_80 decodes FP8 by bits: more registers per tile element
            narrow = DecodeLaunchConfig(16, 32, 8, 2, programs_per_cu=2)
            wide = DecodeLaunchConfig(32, 32, 8, 2, programs_per_cu=2)
        return {"16": narrow, "32": narrow, "64": wide}
    if platform.is_cuda():
        if smem >= 200 * 1024:  # sm_90, sm_100
            narrow = DecodeLaunchConfig(16, 64, 4, 2, programs_per_cu=2)
            if arch != "sm_90":
                # sm_100 lowers the 64-row tile to tcgen05; its compiled resource
                # report is implausible (4 registers) and no B200 has run it
                return {"16": narrow, "32": narrow, "64": narrow}
            wide = DecodeLaunchConfig(64, 64, 8, 2, programs_per_cu=1, disable_licm=True)
            return {"16": narrow, "32": narrow, "64": wide}
        return {  # sm_80 class
            "16": DecodeLaunchConfig(16, 32, 4, 2, programs_per_cu=2),
            "32": DecodeLaunchConfig(32, 32, 8, 2, programs_per_cu=2),
            "64": DecodeLaunchConfig(32, 32, 8, 2, programs_per_cu=2),
        }
    if platform.is_rocm():
        if platform.warp_size == 32:  # RDNA
            return {
                "16": DecodeLaunchConfig(16, 16, 4, 1, 2),
                "32": DecodeLaunchConfig(32, 16, 8, 1, 2),
                "64": DecodeLaunchConfig(32, 16, 8, 1, 2),
            }
        cdna = dict(matrix_instr_nonkdim=16, kpack=1)
        if arch == "gfx950":
            narrow = DecodeLaunchConfig(16, 16, 4, 2, 2, waves_per_eu=2, **cdna)
            if fp8:
                # a 32-row FP8 tile with the tokens as M spills (104 VGPRs), and 16-row
                # blocks would read the cache 8 times at 128 heads: past 32 rows the
                # 64-row tile stays (QK in 2 warps each)
                wide = DecodeLaunchConfig(16, 64, 4, 2, 1, waves_per_eu=1, tokens_as_m=True, **cdna)
                widest = DecodeLaunchConfig(64, 16, 8, 2, 2, waves_per_eu=2, **cdna)
                return {"16": narrow, "32": wide, "64": widest}
            wide = DecodeLaunchConfig(32, 64, 4, 2, 1, waves_per_eu=1, tokens_as_m=True, **cdna)
            return {"16": narrow, "32": wide, "64": wide}
        # gfx942 / gfx90a: 64 KiB LDS
        if fp8:
            narrow = DecodeLaunchConfig(16, 16, 4, 2, 1, waves_per_eu=1, **cdna)
            wide = DecodeLaunchConfig(32, 64, 4, 1, 1, waves_per_eu=1, tokens_as_m=True, **cdna)
        else:
            narrow = DecodeLaunchConfig(16, 16, 4, 1, 2, waves_per_eu=2, **cdna)
            wide = DecodeLaunchConfig(32, 64, 4, 2, 1, waves_per_eu=1, tokens_as_m=True, **cdna)
        return {"16": narrow, "32": wide, "64": wide}
    # CPU (the Triton interpreter): small tiles keep it fast
    return {
        "16": DecodeLaunchConfig(16, 16, 4, 1),
        "32": DecodeLaunchConfig(32, 16, 4, 1),
        "64": DecodeLaunchConfig(32, 16, 4, 1),
    }


def _sm90_wgmma_table(fp8: bool, fp8_qk: bool = True) -> dict[str, DecodeLaunchConfig]:
    """sm_90 with a Triton whose Gluon builds the warpgroup kernels (`mla_decode_wgmma`).

    Tokens are the MMA's M dimension (64 per tile) and query rows its N, so 32
    and 64 rows are each their own tile without padding; one program per SM
    (the query, two 64-token stages of the cache and P take 185-225 KiB of
    shared memory).  By measurement on an H200 (bench/RESULTS.md):

    * 16-bit caches, 17-32 rows: the warp-specialised kernel (QK + softmax +
      half of PV, the other half of PV, a cp.async loader), 1.2x the Triton
      kernel at 32 heads; 33-64 rows: the same split with the query rows as
      the MMA's M (the softmax stays inside each warp, P feeds the first
      warpgroup's PV from registers), 1.3-2.0x the Triton kernel and
      1.36x the single-stream warpgroup kernel (since removed) at 128 heads;
    * FP8 caches: the same two warp-specialised kernels, the tokens-as-M one
      up to 16 rows and the rows-as-M one from 17.  By default (fp8_qk) QK
      runs on the FP8 tensor cores from raw FP8 stages (cp.async) with an e4m3
      query, and the loader converts the latent part once into float16 stages
      for P V; up to 16 rows P V runs on the FP8 tensor cores as well, from
      four raw stages and no float16 stage.  FP8 takes 0.56-0.98x the bf16
      time (0.56 at 16 heads, 0.91 at 128 heads, B = 128, S = 4096; 0.98 at
      128 heads, B = 1, S = 32768, with TMA loads).  fp8_qk=False: the loader converts the
      whole tile once into a float16 stage, float16 products (the bf16 path's
      accuracy), 0.76-1.08x the bf16 time; the Triton kernel's FP8 path takes
      1.85x as long at 16 heads;
    * 16-bit caches up to 16 rows: the Triton kernel (memory-bound there; the
      warpgroup kernels pad the QK product's N to 16 rows and are no faster);
    * the 16-bit entries and the FP8 ones from 17 rows load whole tiles by
      TMA where the cache allows it (``tma``): 1-4 % faster than cp.async at
      64-128 heads, and what keeps FP8 under the bf16 time at 128 heads
      (0.91-0.98); FP8 up to 16 rows gains nothing measurable from it.
    """
    if fp8 and fp8_qk:
        return {
            # no TMA: 88.9 / 33.9 / 16.7 against 90.6 / 33.7 / 16.6 µs (B = 128 / 32 / 1), not worth the
            # 18-23 µs more host time each eager launch takes to encode its descriptors
            "16": DecodeLaunchConfig(16, 64, 4, 0, programs_per_cu=1, kernel="wgmma_ws", raw_stages=4),
            # one float16 stage: the query (e4m3), two raw stages and P take the rest (184 KiB)
            "32": DecodeLaunchConfig(64, 64, 4, 1, programs_per_cu=1, kernel="wgmma_rm", raw_stages=2, tma=True),
            "64": DecodeLaunchConfig(64, 64, 4, 1, programs_per_cu=1, kernel="wgmma_rm", raw_stages=2, tma=True),
        }
    if fp8:
        return {
            "16": DecodeLaunchConfig(16, 64, 4, 2, programs_per_cu=1, kernel="wgmma_ws"),
            # 17-32 rows padded to 64 rows as M: 0.9x the tokens-as-M kernel's time with FP8 (52.8 / 163.7
            # against 57.9 / 185.5 µs at 32 heads, B = 32 / 128, S = 4096; equal at B = 1)
            "32": DecodeLaunchConfig(64, 64, 4, 2, programs_per_cu=1, kernel="wgmma_rm"),
            "64": DecodeLaunchConfig(64, 64, 4, 2, programs_per_cu=1, kernel="wgmma_rm"),
        }
    return {
        "16": DecodeLaunchConfig(16, 64, 4, 2, programs_per_cu=2),
        "32": DecodeLaunchConfig(32, 64, 4, 2, programs_per_cu=1, kernel="wgmma_ws", tma=True),
        "64": DecodeLaunchConfig(64, 64, 4, 2, programs_per_cu=1, kernel="wgmma_rm", tma=True),
    }


WGMMA_DECODE_DIMS = (512, 64)


def decode_config(
    platform,
    num_heads: int,
    q_len: int,
    kv_dtype: torch.dtype,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    warpgroup: bool = True,
    fp8_qk: bool | None = None,
) -> DecodeLaunchConfig:
    """The decode launch configuration for `num_heads` heads x `q_len` query tokens.

    Rows (num_heads * q_len) up to 16 take a 16-row tile (MMA minimum, padded),
    up to 32 a 32-row tile, more the platform's large tile (several head blocks
    when the rows exceed it).
    FP8 caches (`kv_dtype`) have their own table.  warpgroup=False: the Triton
    kernel's table even where the sm_90 warpgroup kernels could run.  fp8_qk
    (default `MLA_MULTI_FP8_QK`, on): where the sm_90 warpgroup kernels take an
    FP8 cache, QK on the FP8 tensor cores with an e4m3 query; False: float16
    products (the bf16 path's accuracy).
    """
    if num_heads < 1 or q_len < 1:
        raise ValueError(f"num_heads={num_heads}, q_len={q_len}; accepted: both >= 1")
    rows = num_heads * q_len
    # float8_e4m3fnuz on sm_90, say, or other than DeepSeek's latent dims (the
    # warpgroup kernels are built and measured for 512 + 64): the Triton kernel's table
    wgmma = warpgroup and not wgmma_decode_reason(platform, kv_dtype, kv_lora_rank, rope_dim)
    if fp8_qk is None:
        fp8_qk = envs.MLA_MULTI_FP8_QK
    if kv_dtype == torch.uint8:
        # fp8_ds_mla rows (uint8, 656 bytes): the FP8 table's register-loader configurations, whose loader
        # dequantises into 16-bit stages (no raw FP8 stages: the values have a scale per row and tile)
        fp8_qk = False
    table = _decode_table(platform, fp8=kv_dtype in _FP8_DTYPES or kv_dtype == torch.uint8, wgmma=wgmma, fp8_qk=fp8_qk)
    if rows <= 16:
        return table["16"]
    if rows <= 32:
        return table["32"]
    return table["64"]


def all_decode_configs(platform, fp8: bool | None = None) -> list[DecodeLaunchConfig]:
    """Every distinct decode configuration `decode_config` can return on `platform`.

    fp8: only the FP8-cache table (True), only the 16-bit one (False), or both (None).
    """
    seen: list[DecodeLaunchConfig] = []
    tables = (False, True) if fp8 is None else (fp8,)
    for table in tables:
        for wgmma, fp8_qk in ((True, True), (True, False), (False, True)):
            for config in _decode_table(platform, fp8=table, wgmma=wgmma, fp8_qk=fp8_qk).values():
                if config not in seen:
                    seen.append(config)
    return seen


REDUCE_TILE_ELEMENTS = 4096
REDUCE_MAX_SPLITS_PER_STEP = 64
REDUCE_MIN_COLUMNS = 64


def decode_reduce_config(num_kv_splits: int = REDUCE_MAX_SPLITS_PER_STEP, kv_lora_rank: int = 512
                         ) -> DecodeReduceLaunchConfig:
    """Tile of the split merge of `num_kv_splits` splits, on every device and at every row count.

    A program merges `block_splits` splits (all of them up to 64) x `block_dv`
    columns per step, the widest tile of at most 4096 float32 values (32 a
    thread on 4 warps) at every row count: fewer, wider programs finish sooner
    even where they leave most of the device idle (H200, DeepSeek-V4 decode of
    10 splits, 128 heads, one token: 13.7 µs with 1024 programs of 64 columns,
    12.4 with 256 of 256; bench/RESULTS.md), and 131072 programs of 2 x 64
    values took 213 µs for B=128, N=128 where whole rows take a fraction of
    that. Tiles of 8192 (whole rows at 16 splits) were slower at 64 x 8192
    tokens of 128 heads.
    """
    block_splits = min(_next_power_of_two(max(1, num_kv_splits)), REDUCE_MAX_SPLITS_PER_STEP)
    return DecodeReduceLaunchConfig(block_dv=_widest_reduce_columns(block_splits, kv_lora_rank),
                                    block_splits=block_splits, num_warps=4)


def all_decode_reduce_configs(kv_lora_rank: int = 512) -> list[DecodeReduceLaunchConfig]:
    """Every merge configuration `decode_reduce_config` can return (for the compile check): one a power of
    two of splits a step."""
    configs = []
    block_splits = 1
    while block_splits <= REDUCE_MAX_SPLITS_PER_STEP:
        configs.append(DecodeReduceLaunchConfig(block_dv=_widest_reduce_columns(block_splits, kv_lora_rank),
                                                block_splits=block_splits, num_warps=4))
        block_splits *= 2
    return configs


def _widest_reduce_columns(block_splits: int, kv_lora_rank: int) -> int:
    # 32+ splits per step: one split row address per split lives in scalar
    # registers on AMD, which run out (SGPR spills) past 64 columns
    elements = REDUCE_TILE_ELEMENTS if block_splits < 32 else REDUCE_TILE_ELEMENTS // 2
    return max(REDUCE_MIN_COLUMNS, min(kv_lora_rank, elements // block_splits))


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


def fp8_bit_decode_needed(platform, kv_dtype: torch.dtype) -> bool:
    """Whether the Triton backend of `platform` lacks a conversion for this FP8 flavour.

    The HIP backend converts both e4m3 flavours; the NVIDIA backend converts
    ``float8_e4m3fn`` from sm_89 on and never ``float8_e4m3fnuz``; the
    interpreter converts both.  Where it lacks one, the kernel decodes the bytes.
    """
    if platform.is_rocm() or platform.is_cpu():
        return False
    if platform.is_cuda():
        capability = platform.device_capability or (0, 0)
        return kv_dtype != torch.float8_e4m3fn or tuple(capability) < (8, 9)
    return True


def wgmma_decode_reason(platform, kv_dtype: torch.dtype, kv_lora_rank: int = 512, rope_dim: int = 64) -> str:
    """Why the sm_90 warpgroup decode kernels (`mla_decode_wgmma`) cannot run here ("" when they can).

    They need an sm_90 device (warpgroup MMA exists on Hopper only), a Triton
    whose Gluon has Hopper's warpgroup MMA and cp.async (3.6 and later), a
    16-bit, ``float8_e4m3fn`` or fp8_ds_mla (uint8 rows) cache (the NVIDIA
    backend has no conversion for ``float8_e4m3fnuz``, which the Triton kernel
    decodes by bits; only these kernels read fp8_ds_mla rows in place), and
    DeepSeek's latent dims, for which they are built and measured.
    """
    if (kv_lora_rank, rope_dim) != WGMMA_DECODE_DIMS:
        return (
            f"kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={rope_dim}; the warpgroup decode kernels take "
            f"{WGMMA_DECODE_DIMS[0]} and {WGMMA_DECODE_DIMS[1]}"
        )
    if not platform.is_cuda() or platform.arch != "sm_90":
        return f"the warpgroup decode kernel needs sm_90 (Hopper), not {platform.arch}"
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8):
        return (f"the warpgroup decode kernel reads bfloat16, float16, float8_e4m3fn or fp8_ds_mla (uint8) caches, "
                f"not {kv_dtype}")
    from mla_multi.kernels.mla_decode_wgmma import gluon_available

    ok, reason = gluon_available()
    return "" if ok else reason


def load_k_transposed(platform, kv_dtype: torch.dtype, config: DecodeLaunchConfig) -> bool:
    """Whether the decode kernel loads K^T separately instead of transposing the tile.

    On NVIDIA an FP8 tile is converted in registers; used both converted and
    transposed it is no longer copied asynchronously (pipelined), so K^T is
    read a second time (from L2).  The AMD pipeliner has no such limit and the
    extra tile would cost registers there.  The interpreter takes the NVIDIA path.
    A ``tokens_as_m`` tile (QK as K Q^T) is never transposed, so never loads K^T.
    """
    return kv_dtype in _FP8_DTYPES and not platform.is_rocm() and not config.tokens_as_m


# ---------------------------------------------------------------------------
# cache ops (mla_multi.kernels.cache_ops)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheOpsLaunchConfig:
    """Launch options of the cache write / gather kernels (one token row per program)."""

    num_warps: int
    block_tokens: int = 1

    @property
    def name(self) -> str:
        return f"t{self.block_tokens}w{self.num_warps}"

    def launch_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": 1}


def cache_ops_config(platform) -> CacheOpsLaunchConfig:
    """Row copies of 576 elements: a few warps per row on every platform."""
    return CacheOpsLaunchConfig(num_warps=2 if platform.warp_size == 64 else 4)


# ---------------------------------------------------------------------------
# prefill (mla_multi.kernels.prefill: varlen flash attention with LSE)
# ---------------------------------------------------------------------------

__all__ += ["PrefillLaunchConfig", "prefill_config", "all_prefill_configs"]


@dataclasses.dataclass(frozen=True)
class PrefillLaunchConfig(_MatrixTileLaunch):
    """Tile and launch options of the varlen prefill attention kernel.

    Attributes:
        block_m: query rows per program (128 on every GPU: large tiles amortise the
            softmax and the K/V loads).
        block_n: keys per inner-loop tile.
        num_warps, num_stages: Triton launch options (num_stages = K/V pipeline depth).
        use_tma: unmasked K/V tiles come through Hopper's tensor-memory accelerator
            from host-built descriptors (NVIDIA sm_90+ only; the launcher falls back to
            pointer loads when a tensor's alignment does not allow a descriptor).
        waves_per_eu, matrix_instr_nonkdim, kpack: AMD options (None elsewhere).
        xcds: > 1: the launch is one-dimensional and each program takes the work item that puts the query
            tiles of one head on one XCD (`Platform.num_xcds`: the device deals programs to its XCDs in
            turn, each XCD with its own L2), as AMD's own attention kernels order their programs; 1: the
            grid is (query tiles, heads, sequences).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    waves_per_eu: int | None = None
    matrix_instr_nonkdim: int | None = None
    kpack: int | None = None
    warp_specialize: bool = False
    xcds: int = 1

    def __post_init__(self) -> None:
        checks.check_positive_int("PrefillLaunchConfig.xcds", self.xcds)

    @property
    def name(self) -> str:
        text = f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
        if self.use_tma:
            text += "tma"
        if self.warp_specialize:
            text += "ws"
        return text + self._amd_suffix() + (f"x{self.xcds}" if self.xcds > 1 else "")


def _padded_head_dims(head_dim_qk: int, head_dim_v: int) -> tuple[int, int]:
    """Head dims as the kernel tiles them (qk split in two power-of-two blocks, v padded)."""
    block_a = 1 << (head_dim_qk.bit_length() - 1)
    rest = head_dim_qk - block_a
    block_b = 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())
    return block_a + block_b, max(16, 1 << (head_dim_v - 1).bit_length())


def _prefill_shared_bytes(platform, config: PrefillLaunchConfig, dqk: int, dv: int, elem: int) -> int:
    """Shared memory / LDS model of one program.

    NVIDIA: the query tile stays in shared memory (wgmma / the first dot reads it
    there) and every pipeline stage holds one K and one V tile. AMD: the query tile
    lives in registers and the stream pipeliner keeps ``max(1, num_stages - 1)``
    K/V tile pairs in LDS plus the one in use when num_stages > 1.
    """
    kv_tile = config.block_n * (dqk + dv) * elem
    if platform.is_rocm():
        return kv_tile * max(1, config.num_stages)
    return config.block_m * dqk * elem + kv_tile * config.num_stages


def prefill_config(platform, head_dim_qk: int, head_dim_v: int, dtype: torch.dtype, causal: bool):
    """The prefill launch configuration for one head-dim pair on `platform`.

    Model (MLA: qk 192 = 128 + 64, v 128, bf16):
    * sm_90 / sm_100 (227 KiB): 128 x 64 tiles, 8 warps (two warpgroups share the
      128 query rows), 3 stages: 48 KiB query tile + 3 x 40 KiB K/V = 168 KiB;
      128 x 128 tiles spill the 255-register budget.
    * sm_80 (163 KiB, mma.sync with the query in registers): 128 x 32, 8 warps,
      3 stages (88 KiB); 128 x 64 spills a few registers.
    * gfx950 (160 KiB LDS): 128 x 64, 8 waves, 2 stages, ``waves_per_eu=2``, 16x16
      MFMA. gfx942 / gfx90a (64 KiB LDS): 128 x 64, 8 waves, a single K/V stage
      (32 KiB), ``waves_per_eu=2``, 16x16 MFMA, ``kpack=2`` on gfx942 (deprecated and
      ignored on gfx950). With 4 waves the whole 64 x 192 K tile sits in each wave's
      registers next to its 32 query rows and spills past the 256 VGPRs that two
      waves per SIMD leave. On both, programs are ordered for the device's XCDs (``xcds``: a head's query
      tiles, which read the same K and V, share one XCD's L2).
    * RDNA (warp 32, 64 KiB, WMMA): 64 x 32, one stage.
    * CPU (the Triton interpreter): 32 x 16, small tiles keep it fast.
    Where a larger head dim would not fit, stages, then block_n, then block_m shrink
    until the shared-memory model fits the platform's limit.
    """
    if head_dim_qk < 16 or head_dim_v < 16:
        raise ValueError(f"head_dim_qk={head_dim_qk}, head_dim_v={head_dim_v}; accepted: both >= 16")
    dqk, dv = _padded_head_dims(head_dim_qk, head_dim_v)
    elem = 4 if dtype == torch.float32 else 2
    arch = platform.arch
    if platform.is_cuda():
        if platform.max_shared_memory_per_block >= 200 * 1024:
            config = PrefillLaunchConfig(128, 64, 8, 3)
        else:
            config = PrefillLaunchConfig(128, 32, 8, 3)
    elif platform.is_rocm():
        if platform.warp_size == 32:
            config = PrefillLaunchConfig(64, 32, 4, 1)
        elif arch == "gfx950":
            config = PrefillLaunchConfig(128, 64, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16)
        else:
            kpack = 2 if arch == "gfx942" else None
            config = PrefillLaunchConfig(128, 64, 8, 1, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=kpack)
        config = dataclasses.replace(config, xcds=platform.num_xcds)
    else:
        return PrefillLaunchConfig(32, 16, 4, 1)
    # Fit the model under the limit, keeping 4 KiB for the compiler's scratch.
    limit = platform.max_shared_memory_per_block - 4096
    while _prefill_shared_bytes(platform, config, dqk, dv, elem) > limit:
        if config.num_stages > 1:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif config.block_n > 16:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
        elif config.block_m > 16:
            config = dataclasses.replace(config, block_m=config.block_m // 2, num_warps=4)
        else:
            break
    return config


def all_prefill_configs(platform) -> list[PrefillLaunchConfig]:
    """Every distinct prefill configuration `prefill_config` returns on `platform` for the
    MLA head dims (qk 192, v 128) in bfloat16 and float16, causal or not."""
    seen: list[PrefillLaunchConfig] = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (True, False):
            config = prefill_config(platform, 192, 128, dtype, causal)
            if config not in seen:
                seen.append(config)
    return seen
