"""ROCM_AITER: AMD's aiter kernels for MLA on MI300 (gfx942) and MI350 (gfx950).

* Decode calls `aiter.mla.mla_decode_fwd`, whose assembly kernels read the
  latent cache with a page size of 1: the paged cache
  `[num_blocks, block_size, 576]` is viewed as `[num_blocks * block_size, 1, 1, 576]`
  and each request's block-table row is expanded, on the device, into one
  `kv_indices` entry per cached token (`kv_indptr` delimits the requests,
  `kv_last_page_lens` is all ones, `qo_indptr` counts one query per request).
  The expansion has static shapes and reads nothing back to the host, so a
  decode step that uses it can be captured in a graph.
* Prefill calls `aiter.flash_attn_varlen_func` (CK / assembly flash attention)
  with qk head dim 192 and v head dim 128, returning the LSE as `[N, T]`.

What the installed aiter can run is decided from the installed aiter itself:
the parameters of its functions (`inspect.signature`) and the architectures
it ships MLA kernel objects for. Every configuration it cannot run is a
reason naming the aiter version and the platform, so the registry falls back
to the next backend instead of crashing inside aiter.

The softmax scale is always passed: aiter defaults to 1/sqrt(576), which is
wrong for MLA (the scale belongs to the 192-wide qk head of the model).

Decode LSE: aiter versions whose `mla_decode_fwd` has no `return_lse`
parameter return a final-LSE buffer they never write, so the decode impl
returns None for the LSE there and the backend declares
`provides_decode_lse() == False`; callers that need the decode LSE must pick
another backend.

Sparse MLA (DeepSeek Sparse Attention, phases sparse_decode and
sparse_prefill) also runs on `mla_decode_fwd`: every query token is a request
of its own (`qo_indptr = arange(T + 1)`), the cache is viewed with page size 1
and a token's valid indices, compacted in order on the device, are its
`kv_indices` (`sparse_kv_indices`). bfloat16 caches only. The LSE and the
attention sink need an aiter whose `mla_decode_fwd` has `return_lse`; a sink
passed to an older one is a ValueError at the call. See `AiterSparseDecodeImpl`.

`AITER_CALLS` records, declaratively, every aiter function this module calls
and the keyword arguments it passes; the test suite checks it against the
published aiter sources.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
from typing import Any, ClassVar

import torch

from mla_multi import errors
from mla_multi.backends.base import (
    FP8_DTYPES,
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
    PrefillSelectorConfig,
    SparseSelectorConfig,
    dtype_name,
    prefill_lse_heads_tokens,
)
from mla_multi.platforms import Platform

# --------------------------------------------------------------------------- the calls made into aiter


@dataclasses.dataclass(frozen=True)
class AiterCall:
    """One aiter function this backend calls, and how.

    `source` is the file of the published aiter package that defines
    `function`; `keywords` are always passed (every argument is passed by
    keyword); `optional_keywords` are passed only when the installed
    signature has them.
    """

    module: str
    function: str
    source: str
    keywords: tuple[str, ...]
    optional_keywords: tuple[str, ...] = ()


MLA_DECODE_FWD = AiterCall(
    module="aiter.mla",
    function="mla_decode_fwd",
    source="aiter/mla.py",
    keywords=(
        "q",
        "kv_buffer",
        "o",
        "qo_indptr",
        "kv_indptr",
        "kv_indices",
        "kv_last_page_lens",
        "max_seqlen_q",
        "sm_scale",
        "num_kv_splits",
    ),
    # q_scale / kv_scale arrived with the fp8 (a8w8) kernels; return_lse later.
    optional_keywords=("q_scale", "kv_scale", "return_lse"),
)

FLASH_ATTN_VARLEN_FUNC = AiterCall(
    module="aiter",
    function="flash_attn_varlen_func",
    source="aiter/ops/mha.py",
    keywords=(
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "softmax_scale",
        "causal",
        "return_lse",
    ),
)

# Sparse MLA: the same function with one request per query token over the
# page-size-1 cache; the split count is left to aiter, the LSE asked for where
# the signature has `return_lse`.
SPARSE_MLA_DECODE_FWD = dataclasses.replace(
    MLA_DECODE_FWD,
    keywords=tuple(k for k in MLA_DECODE_FWD.keywords if k != "num_kv_splits"),
    optional_keywords=("return_lse",),
)

AITER_CALLS: tuple[AiterCall, ...] = (MLA_DECODE_FWD, FLASH_ATTN_VARLEN_FUNC, SPARSE_MLA_DECODE_FWD)

# Architectures aiter builds its MLA and flash-attention kernels for; used when
# the installed package's kernel inventory cannot be located.
AITER_ARCHS: tuple[str, ...] = ("gfx942", "gfx950")
# Head counts `mla_decode_fwd` runs natively (its split-KV path has assembly
# kernels for 16 and 128 query heads per latent head); fewer than 16 heads are
# padded with zero queries up to 16, which costs compute but no KV traffic.
AITER_DECODE_NATIVE_NUM_HEADS: tuple[int, ...] = (16, 128)
AITER_DECODE_PADDED_NUM_HEADS = 16
# The kernels compute a 576-wide qk (512 latent + 64 rope) and a 512-wide v.
AITER_DECODE_KV_LORA_RANK = 512
AITER_DECODE_QK_ROPE_HEAD_DIM = 64
# CK flash attention handles head dims up to 256.
AITER_PREFILL_MAX_HEAD_DIM = 256
# kv_indices are int32 slot numbers of the page-size-1 view.
_MAX_INT32 = 2**31 - 1
# FP8 MLA decode kernels in aiter's source that a sparse FP8 path could build
# on, looked up by name in the installed package (none is called here):
# HipKittens' DeepSeek V3.2 decode (FP8 query and cache, heads x query tokens
# 128, gfx942 / gfx950, reached through mla_decode_fwd's persistent path;
# `hk_mla_decode_fwd` in older sources) and the gfx950 DSA V3.2 decode over
# separate FP8 NoPE / bf16 RoPE buffers with E8M0 block scales.
AITER_SPARSE_FP8_KERNELS: tuple[str, ...] = ("hk_mla_v32_decode_fwd", "hk_mla_decode_fwd", "mla_decode_fwd_ds32")


# --------------------------------------------------------------------------- probing the installed aiter


@dataclasses.dataclass(frozen=True)
class AiterProbe:
    """What the installed aiter offers; `error` is set when it cannot be used at all."""

    version: str
    error: str | None = None
    decode_parameters: tuple[str, ...] = ()
    prefill_parameters: tuple[str, ...] = ()
    # Architectures with MLA kernel objects in the installed package, or None when unknown.
    kernel_archs: tuple[str, ...] | None = None
    # Which of AITER_SPARSE_FP8_KERNELS the installed package defines.
    sparse_fp8_kernels: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"aiter {self.version}"

    def decode_has(self, name: str) -> bool:
        return name in self.decode_parameters

    def prefill_has(self, name: str) -> bool:
        return name in self.prefill_parameters


def _installed_version() -> str | None:
    for distribution in ("amd-aiter", "aiter"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken installation's metadata must not break probing
            continue
    return None


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _kernel_archs(aiter_module: Any) -> tuple[str, ...] | None:
    """Architectures whose `hsa/<arch>/mla/*.co` kernel objects the installed aiter ships."""
    roots = []
    try:
        spec = importlib.util.find_spec("aiter_meta")
        if spec is not None and spec.submodule_search_locations:
            roots.extend(pathlib.Path(p) for p in spec.submodule_search_locations)
    except Exception:
        pass
    module_file = getattr(aiter_module, "__file__", None)
    if module_file:
        package_dir = pathlib.Path(module_file).parent
        roots.extend([package_dir.parent / "aiter_meta", package_dir])
    for root in roots:
        hsa = root / "hsa"
        if hsa.is_dir():
            archs = sorted(
                entry.name for entry in hsa.iterdir() if (entry / "mla").is_dir() and any((entry / "mla").glob("*.co"))
            )
            return tuple(archs)
    return None


@functools.lru_cache(maxsize=1)
def probe_aiter() -> AiterProbe:
    """Import aiter once and record what it offers. Never raises.

    `import aiter` raises RuntimeError (not ImportError) on a machine without
    ROCm, and may raise anything when its JIT setup is broken: every exception
    becomes `AiterProbe.error`.
    """
    version = _installed_version()
    try:
        aiter_module = importlib.import_module("aiter")
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "aiter":
            return AiterProbe(version="(not installed)", error="aiter is not installed (pip package amd-aiter)")
        label = version or "(version unknown)"
        return AiterProbe(version=label, error=f"import aiter {label} failed: {type(error).__name__}: {error}")
    if version is None:
        version = str(getattr(aiter_module, "__version__", None) or "(version unknown)")
    try:
        mla_module = importlib.import_module(MLA_DECODE_FWD.module)
        decode_function = getattr(mla_module, MLA_DECODE_FWD.function, None)
    except Exception as error:
        return AiterProbe(version=version, error=f"import aiter.mla from aiter {version} failed: {type(error).__name__}: {error}")
    prefill_function = getattr(aiter_module, FLASH_ATTN_VARLEN_FUNC.function, None)
    fp8_kernels = tuple(
        name for name in AITER_SPARSE_FP8_KERNELS
        if getattr(aiter_module, name, None) is not None or getattr(mla_module, name, None) is not None
    )
    return AiterProbe(
        version=version,
        decode_parameters=_parameters(decode_function) if decode_function is not None else (),
        prefill_parameters=_parameters(prefill_function) if prefill_function is not None else (),
        kernel_archs=_kernel_archs(aiter_module),
        sparse_fp8_kernels=fp8_kernels,
    )


def clear_probe_cache() -> None:
    """Forget the probe (tests that change what `import aiter` finds call this)."""
    probe_aiter.cache_clear()


def _missing_keywords(call: AiterCall, parameters: tuple[str, ...]) -> list[str]:
    return [name for name in call.keywords if name not in parameters]


def _call_reasons(call: AiterCall, phase: str) -> list[str]:
    """Why the installed aiter cannot take `call` (empty when it can), against the signature the probe read
    of its decode function (`phase` "decode") or its prefill one ("prefill")."""
    probe = probe_aiter()
    if probe.error:
        return [probe.error]
    parameters = probe.decode_parameters if phase == "decode" else probe.prefill_parameters
    if not parameters:
        return [f"{probe.label} has no {call.module}.{call.function}"]
    missing = _missing_keywords(call, parameters)
    if missing:
        return [f"{probe.label}'s {call.function} lacks the parameters {', '.join(missing)}"]
    return []


def _where(platform: Platform) -> str:
    return f"{platform.name} ({platform.arch})"


def _arch_reasons(probe: AiterProbe, platform: Platform, what: str) -> list[str]:
    archs = AITER_ARCHS if probe.kernel_archs is None else tuple(a for a in probe.kernel_archs if a in AITER_ARCHS)
    if platform.arch not in archs:
        source = "supported" if probe.kernel_archs is None else "shipped with kernels"
        return [f"{probe.label} has no {what} kernels for {_where(platform)}; {source}: {', '.join(archs) or 'none'}"]
    return []


def _rocm_platform_reasons(platform: Platform) -> list[str]:
    if platform.vendor != "rocm":
        return [f"platform {platform.name} ({platform.vendor} {platform.arch}) is not supported; aiter runs on ROCm only"]
    return []


def _decode_num_heads_text() -> str:
    return f"1-{AITER_DECODE_PADDED_NUM_HEADS - 1} (padded to {AITER_DECODE_PADDED_NUM_HEADS}), " + ", ".join(
        map(str, AITER_DECODE_NATIVE_NUM_HEADS)
    )


def _decode_shape_reasons(dims, where: str) -> list[str]:
    """The head counts and latent widths `mla_decode_fwd`'s kernels take (dense and sparse decode)."""
    reasons = []
    num_heads = dims.num_heads
    if not (num_heads < AITER_DECODE_PADDED_NUM_HEADS or num_heads in AITER_DECODE_NATIVE_NUM_HEADS):
        reasons.append(
            f"num_heads {num_heads} is not supported by {where}'s mla_decode_fwd; "
            f"supported: {_decode_num_heads_text()}"
        )
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (AITER_DECODE_KV_LORA_RANK, AITER_DECODE_QK_ROPE_HEAD_DIM):
        reasons.append(
            f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim} are not supported by "
            f"{where}; its kernels are built for {AITER_DECODE_KV_LORA_RANK} / {AITER_DECODE_QK_ROPE_HEAD_DIM}"
        )
    return reasons


def _padded_query(query: torch.Tensor) -> torch.Tensor:
    """query [T, N, D] with zero queries on extra heads up to AITER_DECODE_PADDED_NUM_HEADS (their outputs are dropped)."""
    tokens, num_heads, width = query.shape
    if num_heads >= AITER_DECODE_PADDED_NUM_HEADS:
        return query
    padded = query.new_zeros(tokens, AITER_DECODE_PADDED_NUM_HEADS, width)
    padded[:, :num_heads] = query
    return padded


# --------------------------------------------------------------------------- decode


def paged_kv_indices(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aiter's page-size-1 indexing of a paged cache, built on the device.

    block_table [B, max_blocks] int32, seq_lens [B] int32 (each at most
    max_blocks * block_size). Returns, all int32 on block_table's device:
    qo_indptr [B + 1] (one query per request), kv_indptr [B + 1] (prefix sums
    of seq_lens), kv_indices [B * max_blocks * block_size] (request b's token
    j is entry kv_indptr[b] + j and holds the cache row
    block_table[b, j // block_size] * block_size + j % block_size; the tail
    past kv_indptr[B] is zero and never read) and kv_last_page_lens [B] (ones).

    Shapes depend only on the input shapes and nothing is read back to the
    host, so the construction can be captured in a graph; the price is
    O(B * max_blocks * block_size) temporary index memory.
    """
    device = block_table.device
    batch, max_blocks = block_table.shape
    capacity = max_blocks * block_size
    positions = torch.arange(capacity, device=device, dtype=torch.int32)
    block_of_position = (positions // block_size).long()
    slots = block_table.index_select(1, block_of_position).to(torch.int32) * block_size + positions % block_size
    seq_lens32 = seq_lens.to(torch.int32)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(seq_lens32, dim=0, dtype=torch.int32)
    valid = positions.unsqueeze(0) < seq_lens32.unsqueeze(1)
    # Tokens past a request's length go to one spare entry, cut off below.
    spare = batch * capacity
    destination = torch.where(
        valid, kv_indptr[:-1].unsqueeze(1).long() + positions.unsqueeze(0).long(), torch.full_like(valid, spare, dtype=torch.long)
    )
    kv_indices = torch.zeros(spare + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, destination.reshape(-1), slots.reshape(-1))
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)
    return qo_indptr, kv_indptr, kv_indices[:spare], kv_last_page_lens


def _scale_tensor(value, device: torch.device) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


class AiterMLADecodeImpl(MLADecodeImpl):
    """Decode through `aiter.mla.mla_decode_fwd` on the page-size-1 view of the cache."""

    def forward_mqa(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        num_kv_splits: int | None = None,
        workspace_manager=None,
        max_seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_nope [B, N, Lkv] (or [B, 1, N, Lkv]), q_pe [B, (1,) N, R] bfloat16;
        kv_cache [num_blocks, block_size, Lkv + R] bfloat16 or fp8 (with
        k_scale); block_table [B, max_blocks] int32; seq_lens [B] int32.

        Returns out with q_nope's shape (bfloat16) and the LSE [B, (1,) N]
        float32 when the installed aiter returns one, else None.
        `num_kv_splits=None` leaves the split count to aiter's own heuristic,
        which is tuned for its kernels (mla_multi.heuristics models the Triton
        kernel's launch); it sees the static length of kv_indices, the
        per-request capacity of the block table, so `max_seq_len` is not needed.
        """
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        from aiter.mla import mla_decode_fwd

        single_token = q_nope.dim() == 3
        if not single_token:
            if q_nope.shape[1] != 1:
                raise ValueError(
                    f"q_nope has {q_nope.shape[1]} query tokens per request; accepted by ROCM_AITER: 1"
                )
            q_nope, q_pe = q_nope.squeeze(1), q_pe.squeeze(1)
        batch, num_heads, kv_lora_rank = q_nope.shape
        num_blocks, block_size, width = kv_cache.shape
        if num_blocks * block_size > _MAX_INT32:
            raise ValueError(
                f"kv_cache has {num_blocks * block_size} rows; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache is not contiguous; accepted by ROCM_AITER: a contiguous cache (viewed with page size 1)")

        query = _padded_query(torch.cat([q_nope, q_pe], dim=-1))
        padded_heads = query.shape[1]
        kv_buffer = kv_cache.view(num_blocks * block_size, 1, 1, width)
        qo_indptr, kv_indptr, kv_indices, kv_last_page_lens = paged_kv_indices(block_table, seq_lens, block_size)
        output = torch.empty(batch, padded_heads, kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)

        keywords: dict[str, Any] = dict(sm_scale=self.scale, num_kv_splits=num_kv_splits)
        if kv_cache.dtype != query.dtype:
            # aiter's fp8 cache kernels are a8w8: the query is quantised to the
            # cache's fp8 type with a per-tensor scale computed on the device.
            if k_scale is None:
                raise ValueError("k_scale=None with an fp8 kv_cache; accepted: a float or a 1-element tensor")
            finite_max = torch.finfo(kv_cache.dtype).max
            q_scale = (query.abs().amax().float() / finite_max).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
            query = (query.float() / q_scale).clamp(-finite_max, finite_max).to(kv_cache.dtype)
            keywords.update(q_scale=q_scale, kv_scale=_scale_tensor(k_scale, query.device))
        wants_lse = probe.decode_has("return_lse")
        if wants_lse:
            keywords["return_lse"] = True

        result = mla_decode_fwd(
            q=query,
            kv_buffer=kv_buffer,
            o=output,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_lens=kv_last_page_lens,
            max_seqlen_q=1,
            **keywords,
        )
        # aiter leaves requests without tokens undefined; the convention is 0 / -inf.
        has_tokens = (seq_lens > 0).unsqueeze(1)
        out = torch.where(has_tokens.unsqueeze(2), output[:, :num_heads], torch.zeros((), dtype=output.dtype, device=output.device))
        lse = None
        if wants_lse and isinstance(result, (tuple, list)) and len(result) > 1 and result[1] is not None:
            lse = result[1].reshape(batch, padded_heads)[:, :num_heads].float()
            lse = torch.where(has_tokens, lse, torch.full((), float("-inf"), device=lse.device))
        if not single_token:
            out = out.unsqueeze(1)
            lse = lse.unsqueeze(1) if lse is not None else None
        return out, lse


class AiterMLADecodeBackend(MLADecodeBackend):
    """`aiter.mla.mla_decode_fwd`: bfloat16 (or a8w8 fp8) decode on gfx942 / gfx950."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.bfloat16,)
    supported_kv_cache_dtypes = (torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn)
    max_num_heads = 128
    max_query_len = 1
    # Index construction is on the device with static shapes (see paged_kv_indices).
    supports_cuda_graphs = True

    @staticmethod
    def get_decode_impl_cls():
        return AiterMLADecodeImpl

    @classmethod
    def availability_reasons(cls) -> list[str]:
        return _call_reasons(MLA_DECODE_FWD, "decode")

    @classmethod
    def provides_decode_lse(cls) -> bool:
        """Whether forward_mqa returns an LSE (aiter's mla_decode_fwd has `return_lse`)."""
        probe = probe_aiter()
        return probe.error is None and probe.decode_has("return_lse")

    @classmethod
    def supported_num_heads_text(cls) -> str:
        return _decode_num_heads_text()

    @classmethod
    def fp8_kv_cache_reasons(cls, probe: AiterProbe, platform: Platform, kv_cache_dtype: torch.dtype) -> list[str]:
        where = f"{probe.label} on {_where(platform)}"
        if platform.fp8_dtype is None:
            return [f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}: the platform has no fp8"]
        if kv_cache_dtype != platform.fp8_dtype:
            return [
                f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}; "
                f"its fp8 type is {dtype_name(platform.fp8_dtype)}"
            ]
        if not (probe.decode_has("q_scale") and probe.decode_has("kv_scale")):
            return [
                f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}: "
                "its mla_decode_fwd takes no q_scale / kv_scale (no fp8 kernels)"
            ]
        return []

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can)."""
        reasons = cls.availability_reasons() + _rocm_platform_reasons(platform)
        if reasons:
            return reasons
        probe = probe_aiter()
        where = f"{probe.label} on {_where(platform)}"
        reasons += _arch_reasons(probe, platform, "MLA decode")
        if config.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype_name(config.dtype)} is not supported by {where}; supported: bfloat16")
        if config.kv_cache_dtype in (torch.float8_e4m3fnuz, torch.float8_e4m3fn):
            reasons += cls.fp8_kv_cache_reasons(probe, platform, config.kv_cache_dtype)
        elif config.kv_cache_dtype != torch.bfloat16:
            reasons.append(
                f"kv_cache_dtype {dtype_name(config.kv_cache_dtype)} is not supported by {where}; "
                f"supported: bfloat16{', ' + dtype_name(platform.fp8_dtype) if platform.fp8_dtype else ''}"
            )
        reasons += _decode_shape_reasons(config.dims, where)
        if config.block_size < 1:
            reasons.append(f"block_size {config.block_size} is not supported by {where}; accepted: any positive size")
        if config.max_query_len > cls.max_query_len:
            reasons.append(
                f"max_query_len {config.max_query_len} is not supported by ROCM_AITER ({where}); accepted: 1"
            )
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probe = probe_aiter()
        info.update(
            aiter_version=probe.version,
            num_heads=cls.supported_num_heads_text(),
            returns_lse=cls.provides_decode_lse(),
            kernel_archs=list(probe.kernel_archs) if probe.kernel_archs is not None else "unknown",
        )
        return info


# --------------------------------------------------------------------------- prefill


class AiterMLAPrefillImpl(MLAPrefillImpl):
    """Varlen prefill through `aiter.flash_attn_varlen_func` (qk 192, v 128, no padding)."""

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        return_softmax_lse: bool,
    ):
        """q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] (float16 / bfloat16), cu_seqlens int32 [B + 1].

        Returns out [Tq, N, Dv] and, with `return_softmax_lse`, lse [N, Tq] float32.
        """
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        import aiter

        result = aiter.flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k),
            softmax_scale=self.scale,
            causal=causal,
            return_lse=return_softmax_lse,
        )
        if not return_softmax_lse:
            return result[0] if isinstance(result, (tuple, list)) else result
        out, lse = result[0], result[1]
        return out, prefill_lse_heads_tokens(lse, q.shape[1], q.shape[0], "aiter")


class AiterMLAPrefillBackend(MLAPrefillBackend):
    """`aiter.flash_attn_varlen_func`: CK / assembly flash attention on gfx942 / gfx950."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_prefill_impl_cls():
        return AiterMLAPrefillImpl

    @classmethod
    def availability_reasons(cls) -> list[str]:
        return _call_reasons(FLASH_ATTN_VARLEN_FUNC, "prefill")

    @classmethod
    def validate_configuration(cls, platform: Platform, config: PrefillSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can)."""
        reasons = cls.availability_reasons() + _rocm_platform_reasons(platform)
        if reasons:
            return reasons
        probe = probe_aiter()
        where = f"{probe.label} on {_where(platform)}"
        reasons += _arch_reasons(probe, platform, "flash-attention")
        if config.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype_name(config.dtype)} is not supported by {where}; supported: "
                + ", ".join(dtype_name(d) for d in cls.supported_dtypes)
            )
        dims = config.dims
        for label, value in (("qk_head_dim", dims.qk_head_dim), ("v_head_dim", dims.v_head_dim)):
            if value > AITER_PREFILL_MAX_HEAD_DIM or value % 8:
                reasons.append(
                    f"{label} {value} is not supported by {where}; accepted: a multiple of 8 up to {AITER_PREFILL_MAX_HEAD_DIM}"
                )
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        info.update(aiter_version=probe_aiter().version)
        return info


# --------------------------------------------------------------------------- sparse MLA


@dataclasses.dataclass(frozen=True)
class SparseKVIndices:
    """Sparse index lists as `mla_decode_fwd`'s page-size-1 indexing, one request per query token.

    All int32 on the indices' device: qo_indptr [T + 1] (arange), kv_indptr
    [T + 1] (prefix sums of `counts`), kv_indices [T * topk] (token t's valid
    rows, in list order, at kv_indptr[t] .. kv_indptr[t + 1]; the tail past
    kv_indptr[T] holds 0 and is never read), kv_last_page_lens [T] (ones) and
    counts [T] (valid entries a token). `bad` [T] bool marks the tokens whose
    list holds an index outside [-1, num_rows) (None where such an index is
    simply no token).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    counts: torch.Tensor
    bad: torch.Tensor | None


def sparse_kv_indices(
    indices: torch.Tensor, num_rows: int, topk_length: torch.Tensor | None = None, *, out_of_range_is_bad: bool = True
) -> SparseKVIndices:
    """aiter's indexing of sparse index lists, built on the device.

    indices int32 [T, topk] (rows of a page-size-1 cache; -1 is no token, a
    duplicate counts twice), topk_length [T] (only the first topk_length[t]
    entries count), num_rows the cache's rows. An entry is valid when it is
    in [0, num_rows) and within topk_length; valid entries are compacted,
    stably, to the front of kv_indices: entry k of the flattened list goes to
    the number of valid entries before it, the invalid ones fill the tail in
    order, so one scatter writes every position once. An index outside
    [-1, num_rows) is never passed on; with `out_of_range_is_bad` it marks its
    token in `bad` (decode), wherever it stands in the list.

    Shapes depend only on the input shapes and nothing is read back to the
    host (no synchronisation; capturable in a graph); the price is O(T * topk)
    temporary index memory.
    """
    device = indices.device
    tokens, topk = indices.shape
    total = tokens * topk
    if total > _MAX_INT32:
        raise ValueError(
            f"indices has {tokens} x {topk} entries; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)"
        )
    if num_rows > _MAX_INT32:
        raise ValueError(f"the cache has {num_rows} rows; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)")
    index = indices.to(torch.int32)
    in_range = (index >= 0) & (index < num_rows)
    bad = (~in_range & (index != -1)).any(dim=1) if out_of_range_is_bad else None
    valid = in_range
    if topk_length is not None:
        positions = torch.arange(topk, device=device, dtype=torch.int32)
        valid = valid & (positions.unsqueeze(0) < topk_length.to(device=device, dtype=torch.int32).unsqueeze(1))
    counts = valid.sum(dim=1, dtype=torch.int32)
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(counts, dim=0, dtype=torch.int32)
    kv_indices = torch.zeros(total, dtype=torch.int32, device=device)
    if total:
        flat_valid = valid.reshape(-1)
        valid_through = torch.cumsum(flat_valid, dim=0)  # valid entries up to and including each entry
        entry = torch.arange(total, device=device)
        destination = torch.where(flat_valid, valid_through - 1, valid_through[-1] + entry - valid_through)
        kv_indices.scatter_(0, destination, torch.where(flat_valid, index.reshape(-1), 0))
    return SparseKVIndices(
        qo_indptr=torch.arange(tokens + 1, dtype=torch.int32, device=device),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_lens=torch.ones(tokens, dtype=torch.int32, device=device),
        counts=counts,
        bad=bad,
    )


def _sparse_mla_decode_fwd(
    query: torch.Tensor, kv_buffer: torch.Tensor, output: torch.Tensor, index: SparseKVIndices, scale: float,
    with_lse: bool, probe: AiterProbe,
) -> torch.Tensor | None:
    """The sparse phases' one call into aiter: writes `output`, returns aiter's LSE [T, heads] with `with_lse`."""
    from aiter.mla import mla_decode_fwd

    keywords: dict[str, Any] = dict(sm_scale=float(scale))
    if with_lse:
        keywords["return_lse"] = True
    result = mla_decode_fwd(
        q=query,
        kv_buffer=kv_buffer,
        o=output,
        qo_indptr=index.qo_indptr,
        kv_indptr=index.kv_indptr,
        kv_indices=index.kv_indices,
        kv_last_page_lens=index.kv_last_page_lens,
        max_seqlen_q=1,
        **keywords,
    )
    if not with_lse:
        return None
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    if lse is None:
        raise RuntimeError(f"{probe.label}'s mla_decode_fwd(return_lse=True) returned no LSE")
    return lse


class _AiterSparseImpl(MLASparseImpl):
    """Sparse MLA through `aiter.mla.mla_decode_fwd`: each query token a request of its own over page-size-1 rows.

    Results follow the REFERENCE semantics: a token without a valid index
    gives 0 and LSE -inf (aiter leaves such a request undefined: the rows are
    replaced after the call from the per-token counts); attn_sink scales out
    by 1 / (1 + exp(sink - lse)) after the call; in decode a token whose list
    holds an index outside [-1, num_slots) gets NaN rows and LSE and ORs
    `errors.SPARSE_INDEX` into the device's error flag, its bad entries never
    reaching aiter. The LSE is aiter's (natural log) where its mla_decode_fwd
    has `return_lse`; elsewhere the LSE returned is None and attn_sink is a
    ValueError. Nothing is read back to the host.
    """

    out_of_range_is_bad: ClassVar[bool] = True
    phase: ClassVar[str] = "sparse_decode"

    def _attend(self, q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink):
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        with_lse = probe.decode_has("return_lse")
        if attn_sink is not None and not with_lse:
            raise ValueError(
                f"attn_sink with ROCM_AITER {self.phase} on {probe.label}: the sink is applied from the LSE, and "
                "this aiter's mla_decode_fwd returns none (it has no return_lse parameter); accepted: attn_sink=None, "
                "an aiter whose mla_decode_fwd has return_lse, or another backend (REFERENCE, TRITON)"
            )
        if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
            raise ValueError(
                f"q_nope / q_pe are {dtype_name(q_nope.dtype)} / {dtype_name(q_pe.dtype)}; accepted by ROCM_AITER: bfloat16"
            )
        tokens, num_heads, kv_lora_rank = q_nope.shape
        width = kv_buffer.shape[-1]
        if kv_lora_rank + q_pe.shape[-1] != width:
            raise ValueError(
                f"q_nope / q_pe widths {kv_lora_rank} / {q_pe.shape[-1]} do not add up to the kv width {width}"
            )
        device = q_nope.device
        index = sparse_kv_indices(indices, kv_buffer.shape[0], topk_length,
                                  out_of_range_is_bad=self.out_of_range_is_bad)
        query = _padded_query(torch.cat([q_nope, q_pe], dim=-1))
        padded_heads = query.shape[1]
        output = torch.empty(tokens, padded_heads, kv_lora_rank, dtype=q_nope.dtype, device=device)
        raw_lse = None
        if index.kv_indices.numel():
            raw_lse = _sparse_mla_decode_fwd(query, kv_buffer, output, index, scale, with_lse, probe)
        # aiter leaves a request without tokens undefined; the convention is 0 / -inf.
        has_tokens = (index.counts > 0).unsqueeze(1)
        out = torch.where(has_tokens.unsqueeze(2), output[:, :num_heads], torch.zeros((), dtype=output.dtype, device=device))
        lse = None
        if with_lse:
            minus_inf = torch.full((), float("-inf"), device=device)
            if raw_lse is None:  # no entries at all: aiter was not called
                lse = minus_inf.expand(tokens, num_heads).clone()
            else:
                lse = torch.where(has_tokens, raw_lse.reshape(tokens, padded_heads)[:, :num_heads].float(), minus_inf)
            if attn_sink is not None:
                factor = torch.sigmoid(torch.where(has_tokens, lse, 0.0) - attn_sink.to(device=device, dtype=torch.float32))
                factor = torch.where(has_tokens, factor, 1.0)
                out = (out.float() * factor.unsqueeze(2)).to(output.dtype)
        if index.bad is not None:
            bad = index.bad.unsqueeze(1)
            out = out.masked_fill(bad.unsqueeze(2), float("nan"))
            lse = lse.masked_fill(bad, float("nan")) if lse is not None else None
            # recorded on the device without a synchronisation
            errors.error_flag(device).bitwise_or_(index.bad.any().to(torch.int32) * errors.SPARSE_INDEX)
        return out, lse


class AiterSparseDecodeImpl(_AiterSparseImpl):
    """Sparse decode over the paged cache [num_blocks, block_size, 576] (bfloat16), viewed with page size 1."""

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        """q_nope [T, N, 512], q_pe [T, N, 64] bfloat16; kv the paged bfloat16 cache; indices int32 [T, topk]
        (slot = block * block_size + offset); topk_length [T]; attn_sink float32 [N].

        Returns out [T, N, 512] bfloat16 and lse [T, N] float32, or None where the installed aiter returns no LSE.
        """
        if kv.dim() != 3 or kv.dtype != torch.bfloat16:
            raise ValueError(
                f"kv_cache is {dtype_name(kv.dtype)} of shape {tuple(kv.shape)}; accepted by ROCM_AITER sparse decode: "
                "a bfloat16 cache [num_blocks, block_size, 576]"
            )
        if not kv.is_contiguous():
            raise ValueError("kv_cache is not contiguous; accepted by ROCM_AITER: a contiguous cache (viewed with page size 1)")
        num_blocks, block_size, width = kv.shape
        kv_buffer = kv.view(num_blocks * block_size, 1, 1, width)
        return self._attend(q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink)


class AiterSparsePrefillImpl(_AiterSparseImpl):
    """Sparse prefill over kv rows [S_kv, 576] (bfloat16), a cache of one-token pages; an index -1 or outside
    [0, S_kv) is no token."""

    out_of_range_is_bad: ClassVar[bool] = False
    phase: ClassVar[str] = "sparse_prefill"

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        """q_nope [T, N, 512], q_pe [T, N, 64] bfloat16; kv [S_kv, 576] bfloat16; indices int32 [T, topk] rows of kv.

        Returns out [T, N, 512] bfloat16 and lse [T, N] float32, or None where the installed aiter returns no LSE.
        """
        if kv.dim() != 2 or kv.dtype != torch.bfloat16:
            raise ValueError(
                f"kv is {dtype_name(kv.dtype)} of shape {tuple(kv.shape)}; accepted by ROCM_AITER sparse prefill: "
                "bfloat16 rows [S_kv, 576]"
            )
        rows, width = kv.shape
        kv_buffer = kv.contiguous().view(rows, 1, 1, width)
        return self._attend(q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink)


def _sparse_fp8_future(probe: AiterProbe) -> str:
    present = probe.sparse_fp8_kernels
    where = f"present in {probe.label}: {', '.join(present)}" if present else f"none of them is in {probe.label}"
    return (
        "possible future paths in aiter's source: hk_mla_v32_decode_fwd, HipKittens' DeepSeek V3.2 decode kernel "
        "(FP8 query and cache, heads x query tokens = 128, or 64 on gfx950; gfx942 / gfx950; experimental, behind "
        "mla_decode_fwd's persistent metadata), and mla_decode_fwd_ds32 (gfx950; FP8 NoPE with E8M0 block scales "
        f"and bf16 RoPE in separate buffers); {where}"
    )


def _sparse_kv_dtype_reasons(probe: AiterProbe, where: str, kv_dtype: torch.dtype) -> list[str]:
    """Why an FP8 or fp8_ds_mla cache cannot go through the sparse path (the base class names the dtype)."""
    if kv_dtype in FP8_DTYPES:
        return [
            f"an FP8 cache ({dtype_name(kv_dtype)}) is not supported by ROCM_AITER sparse MLA on {where}: the sparse "
            "path passes the bfloat16 query as it is, and mla_decode_fwd reads an FP8 cache only in its a8w8 kernels "
            "(FP8 query with a per-tensor q_scale); " + _sparse_fp8_future(probe)
        ]
    if kv_dtype == torch.uint8:
        return [
            f"the fp8_ds_mla cache (uint8, 656 bytes a token: FP8 values with a float32 scale per 128, then bf16 "
            f"rotary values) is not supported by ROCM_AITER sparse MLA on {where}: mla_decode_fwd has no kernel that "
            "reads this layout; " + _sparse_fp8_future(probe)
        ]
    return []


class _AiterSparseBackend(MLASparseBackend):
    """What both sparse phases need: an aiter with `mla_decode_fwd` on ROCm gfx942 / gfx950, bfloat16 throughout."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.bfloat16,)
    supported_kv_dtypes = (torch.bfloat16,)
    max_num_heads = 128
    # Query tokens are flattened: each is a request of its own.
    max_query_len = 1 << 16
    # As the dense decode: the indexing is built on the device with static shapes (sparse_kv_indices).
    supports_cuda_graphs: ClassVar[bool] = True

    @classmethod
    def availability_reasons(cls) -> list[str]:
        return _call_reasons(SPARSE_MLA_DECODE_FWD, "decode")

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        reasons = _rocm_platform_reasons(platform)
        probe = probe_aiter()
        if reasons or probe.error:
            return reasons
        return _arch_reasons(probe, platform, "MLA decode")

    @classmethod
    def provides_lse(cls) -> bool:
        """Whether forward returns an LSE, and so takes attn_sink (aiter's mla_decode_fwd has `return_lse`)."""
        probe = probe_aiter()
        return probe.error is None and probe.decode_has("return_lse")

    @classmethod
    def validate_configuration(cls, platform: Platform, config: SparseSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can)."""
        reasons = super().validate_configuration(platform, config)
        probe = probe_aiter()
        if probe.error or platform.vendor != "rocm":
            return reasons
        where = f"{probe.label} on {_where(platform)}"
        reasons += _sparse_kv_dtype_reasons(probe, where, config.kv_dtype)
        reasons += _decode_shape_reasons(config.dims, where)
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probe = probe_aiter()
        info.update(
            aiter_version=probe.version,
            num_heads=_decode_num_heads_text(),
            cuda_graphs=cls.supports_cuda_graphs,
            returns_lse=cls.provides_lse(),
            attn_sink="applied from the LSE" if cls.provides_lse() else "needs an aiter with return_lse (ValueError)",
        )
        return info


class AiterSparseDecodeBackend(_AiterSparseBackend):
    """Sparse decode through `aiter.mla.mla_decode_fwd`, one request per query token (bfloat16 caches)."""

    @staticmethod
    def get_impl_cls():
        return AiterSparseDecodeImpl


class AiterSparsePrefillBackend(_AiterSparseBackend):
    """Sparse prefill through `aiter.mla.mla_decode_fwd` over kv rows as one-token pages (bfloat16)."""

    @staticmethod
    def get_impl_cls():
        return AiterSparsePrefillImpl


__all__ = [
    "AITER_CALLS",
    "AiterCall",
    "AiterMLADecodeBackend",
    "AiterMLADecodeImpl",
    "AiterMLAPrefillBackend",
    "AiterMLAPrefillImpl",
    "AiterProbe",
    "AiterSparseDecodeBackend",
    "AiterSparseDecodeImpl",
    "AiterSparsePrefillBackend",
    "AiterSparsePrefillImpl",
    "SparseKVIndices",
    "clear_probe_cache",
    "paged_kv_indices",
    "probe_aiter",
    "sparse_kv_indices",
]
