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

from mla_multi.backends.base import (
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    PrefillSelectorConfig,
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

AITER_CALLS: tuple[AiterCall, ...] = (MLA_DECODE_FWD, FLASH_ATTN_VARLEN_FUNC)

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
    return AiterProbe(
        version=version,
        decode_parameters=_parameters(decode_function) if decode_function is not None else (),
        prefill_parameters=_parameters(prefill_function) if prefill_function is not None else (),
        kernel_archs=_kernel_archs(aiter_module),
    )


def clear_probe_cache() -> None:
    """Forget the probe (tests that change what `import aiter` finds call this)."""
    probe_aiter.cache_clear()


def _missing_keywords(call: AiterCall, parameters: tuple[str, ...]) -> list[str]:
    return [name for name in call.keywords if name not in parameters]


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

        query = torch.cat([q_nope, q_pe], dim=-1)
        padded_heads = max(num_heads, AITER_DECODE_PADDED_NUM_HEADS)
        if padded_heads != num_heads:
            # Zero queries on the extra heads; their outputs are dropped below.
            padded = query.new_zeros(batch, padded_heads, width)
            padded[:, :num_heads] = query
            query = padded
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
        probe = probe_aiter()
        if probe.error:
            return [probe.error]
        if not probe.decode_parameters:
            return [f"{probe.label} has no aiter.mla.mla_decode_fwd"]
        missing = _missing_keywords(MLA_DECODE_FWD, probe.decode_parameters)
        if missing:
            return [f"{probe.label}'s mla_decode_fwd lacks the parameters {', '.join(missing)}"]
        return []

    @classmethod
    def provides_decode_lse(cls) -> bool:
        """Whether forward_mqa returns an LSE (aiter's mla_decode_fwd has `return_lse`)."""
        probe = probe_aiter()
        return probe.error is None and probe.decode_has("return_lse")

    @classmethod
    def supported_num_heads_text(cls) -> str:
        return f"1-{AITER_DECODE_PADDED_NUM_HEADS - 1} (padded to {AITER_DECODE_PADDED_NUM_HEADS}), " + ", ".join(
            map(str, AITER_DECODE_NATIVE_NUM_HEADS)
        )

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
        num_heads = config.dims.num_heads
        if not (num_heads < AITER_DECODE_PADDED_NUM_HEADS or num_heads in AITER_DECODE_NATIVE_NUM_HEADS):
            reasons.append(
                f"num_heads {num_heads} is not supported by {where}'s mla_decode_fwd; "
                f"supported: {cls.supported_num_heads_text()}"
            )
        dims = config.dims
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (AITER_DECODE_KV_LORA_RANK, AITER_DECODE_QK_ROPE_HEAD_DIM):
            reasons.append(
                f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim} are not supported by "
                f"{where}; its kernels are built for {AITER_DECODE_KV_LORA_RANK} / {AITER_DECODE_QK_ROPE_HEAD_DIM}"
            )
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
        probe = probe_aiter()
        if probe.error:
            return [probe.error]
        if not probe.prefill_parameters:
            return [f"{probe.label} has no aiter.flash_attn_varlen_func"]
        missing = _missing_keywords(FLASH_ATTN_VARLEN_FUNC, probe.prefill_parameters)
        if missing:
            return [f"{probe.label}'s flash_attn_varlen_func lacks the parameters {', '.join(missing)}"]
        return []

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


__all__ = [
    "AITER_CALLS",
    "AiterCall",
    "AiterMLADecodeBackend",
    "AiterMLADecodeImpl",
    "AiterMLAPrefillBackend",
    "AiterMLAPrefillImpl",
    "AiterProbe",
    "clear_probe_cache",
    "paged_kv_indices",
    "probe_aiter",
]
