"""Backend registration, per-platform priorities and selection with reasons.

Backends are registered by name with the *qualified name* of their class, so a
backend module (and the optional library behind it) is imported only when a
selection looks at it; an import that raises anything becomes a reason.

The priority lists for every platform live in `PREFILL_PRIORITIES` and
`DECODE_PRIORITIES` below and nowhere else; `SELECTION_RULES` beside them holds
the measured exceptions (a head-count range or cache dtype on which another
backend is faster), each naming its measurement in bench/RESULTS.md; the sparse
phases' lists (`SPARSE_DECODE_PRIORITIES`, `SPARSE_PREFILL_PRIORITIES`) sit beside them.  `select_*` walks the list of the
current platform and returns the first backend without reasons; when none
fits, `NoBackendError` prints the configuration and one block of reasons per
backend.  A backend forced by argument or by `MLA_MULTI_PREFILL_BACKEND` /
`MLA_MULTI_DECODE_BACKEND` is validated and raises with its reasons; it never
falls back silently.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from mla_multi import envs
from mla_multi.checks import check_positive_int
from mla_multi.backends.base import (
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLAPrefillBackend,
    MLASparseBackend,
    PrefillSelectorConfig,
    SparseSelectorConfig,
    resolve_kv_cache_dtype,
)
from mla_multi.dims import MLADims
from mla_multi.platforms import Platform, current_platform

logger = logging.getLogger("mla_multi")

Phase = Literal["prefill", "decode", "sparse_decode", "sparse_prefill"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "sparse_decode", "sparse_prefill")

# name -> "module:Class"
PREFILL_BACKENDS: dict[str, str] = {
    "ROCM_AITER": "mla_multi.backends.rocm_aiter:AiterMLAPrefillBackend",
    "CUDA_FLASH_ATTN": "mla_multi.backends.cuda_flash_attn:FlashAttnPrefillBackend",
    "FLASHINFER": "mla_multi.backends.flashinfer:FlashInferPrefillBackend",
    "TRITON": "mla_multi.backends.triton:TritonPrefillBackend",
    "REFERENCE": "mla_multi.backends.reference:ReferencePrefillBackend",
}
DECODE_BACKENDS: dict[str, str] = {
    "ROCM_AITER": "mla_multi.backends.rocm_aiter:AiterMLADecodeBackend",
    "CUDA_FLASH_ATTN": "mla_multi.backends.cuda_flash_attn:FlashAttnMLADecodeBackend",
    "FLASHINFER": "mla_multi.backends.flashinfer:FlashInferDecodeBackend",
    "FLASHMLA": "mla_multi.backends.flashmla:FlashMLADecodeBackend",
    "TRITON": "mla_multi.backends.triton:TritonDecodeBackend",
    "REFERENCE": "mla_multi.backends.reference:ReferenceDecodeBackend",
}

# Sparse MLA (DeepSeek Sparse Attention), one phase each for decode and prefill.
SPARSE_DECODE_BACKENDS: dict[str, str] = {
    "ROCM_AITER": "mla_multi.backends.rocm_aiter:AiterSparseDecodeBackend",
    "FLASHMLA": "mla_multi.backends.flashmla:FlashMLASparseDecodeBackend",
    "TRITON": "mla_multi.backends.triton:TritonSparseDecodeBackend",
    "REFERENCE": "mla_multi.backends.reference:ReferenceSparseDecodeBackend",
}
SPARSE_PREFILL_BACKENDS: dict[str, str] = {
    "ROCM_AITER": "mla_multi.backends.rocm_aiter:AiterSparsePrefillBackend",
    "FLASHMLA": "mla_multi.backends.flashmla:FlashMLASparsePrefillBackend",
    "TRITON": "mla_multi.backends.triton:TritonSparsePrefillBackend",
    "REFERENCE": "mla_multi.backends.reference:ReferenceSparsePrefillBackend",
}

# Priority by platform: the first key that matches wins: (vendor, arch), then vendor.
# REFERENCE ends every GPU list as the correct-but-slow last resort; selecting
# it on a GPU logs a warning.
PREFILL_PRIORITIES: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("rocm", "gfx942"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", "gfx950"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", None): ("TRITON", "REFERENCE"),
    ("cuda", None): ("FLASHINFER", "TRITON", "CUDA_FLASH_ATTN", "REFERENCE"),
    ("cpu", None): ("REFERENCE",),
}
DECODE_PRIORITIES: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("rocm", "gfx942"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", "gfx950"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", None): ("TRITON", "REFERENCE"),
    ("cuda", None): ("FLASHINFER", "TRITON", "CUDA_FLASH_ATTN", "FLASHMLA", "REFERENCE"),
    ("cpu", None): ("REFERENCE",),
}

# Sparse MLA: FLASHMLA first on NVIDIA where its wheel is installed (sm_90 / sm_100, 64 or 128
# heads, fp8_ds_mla decode and bf16 prefill): its kernels are the fastest measured there. TRITON
# next on every GPU (bench/RESULTS.md, "Sparse MLA on an H100": every cache through the dense decode
# kernels over compacted indices), then the PyTorch REFERENCE (every
# platform, one gather, no host sync). On gfx942 / gfx950 ROCM_AITER (aiter's MLA decode kernel,
# one request per query token, bfloat16 caches) comes first; both phases (the prefill list is a copy).
SPARSE_DECODE_PRIORITIES: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("rocm", "gfx942"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", "gfx950"): ("ROCM_AITER", "TRITON", "REFERENCE"),
    ("rocm", None): ("TRITON", "REFERENCE"),
    ("cuda", None): ("FLASHMLA", "TRITON", "REFERENCE"),
    ("cpu", None): ("REFERENCE",),
}
SPARSE_PREFILL_PRIORITIES: dict[tuple[str, str | None], tuple[str, ...]] = dict(SPARSE_DECODE_PRIORITIES)


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """A measured exception to a platform's priority list.

    A configuration the rule matches (platform vendor and arch, head count in
    `num_heads` inclusive, KV-cache dtype in `kv_cache_dtypes` for decode) is
    tried in the rule's `priority` order instead of the platform's. `measured`
    names the record in bench/RESULTS.md that the order comes from.
    `needs_wgmma`: the rule holds only where the sm_90 warpgroup decode kernels
    can run (`launch_config.wgmma_decode_reason`: an sm_90 device, a Triton
    with Gluon, a 16-bit or float8_e4m3fn cache), since they are what it measured.
    """

    name: str
    phase: str
    vendor: str
    arch: str | None
    priority: tuple[str, ...]
    measured: str
    num_heads: tuple[int, int] = (1, 1 << 20)
    kv_cache_dtypes: frozenset | None = None
    needs_wgmma: bool = False
    when: Callable[[Platform, object], bool] | None = None  # a further condition on (platform, config)

    def matches(self, platform: Platform, config) -> bool:
        if platform.vendor != self.vendor or (self.arch is not None and platform.arch != self.arch):
            return False
        low, high = self.num_heads
        if not low <= config.dims.num_heads <= high:
            return False
        kv_dtype = getattr(config, "kv_cache_dtype", None)
        if self.kv_cache_dtypes is not None and kv_dtype not in self.kv_cache_dtypes:
            return False
        if self.needs_wgmma:
            from mla_multi.kernels.launch_config import wgmma_decode_reason

            dims = config.dims
            kv = kv_dtype if kv_dtype is not None else torch.bfloat16
            if wgmma_decode_reason(platform, kv, dims.kv_lora_rank, dims.qk_rope_head_dim):
                return False
        return self.when is None or bool(self.when(platform, config))

    def describe(self) -> str:
        return f"{self.name} ({self.measured})"


def few_sparse_tokens(platform: Platform, config) -> bool:
    """A planned sparse decode over the fp8_ds_mla cache, without per-token lengths, of one token or of tokens
    whose heads fit one 64-row head block and fill at most half the device's compute units: there TRITON's
    sm_90 kernels read the index lists as they are, in one-tile splits, and beat FlashMLA (bench/RESULTS.md,
    'Sparse decode: TRITON where the batch is small'); a layer built without a batch (num_tokens None) keeps
    the platform's order."""
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    tokens = getattr(config, "num_tokens", None)
    if tokens is None or config.with_lengths or config.kv_dtype != torch.uint8 or ds_mla_decode_reason(platform):
        return False
    return tokens == 1 or (config.dims.num_heads <= 64 and tokens <= platform.num_compute_units // 2)


# Measured exceptions to the lists above, tried in order; the first that
# matches a configuration gives its priority. Each names its measurement.
SELECTION_RULES: tuple[SelectionRule, ...] = (
    SelectionRule(
        # 128 heads: B = 1 TRITON 17.0 µs, FLASHMLA 21.7; B = 2-16 within 4 % either way, TRITON behind from
        # B = 24. 64 heads: TRITON ahead 3-28 % up to B = 64 (80.1 against 85.0 µs), 3.5 % behind at B = 128
        name="nvidia-sm90-sparse-decode-few-tokens",
        phase="sparse_decode",
        vendor="cuda",
        arch="sm_90",
        priority=("TRITON", "FLASHMLA", "REFERENCE"),
        when=few_sparse_tokens,
        measured="bench/RESULTS.md, 'Sparse decode: TRITON where the batch is small' (H200, fp8_ds_mla, topk 2048)",
    ),
    SelectionRule(
        # every head count: at 128 heads TRITON is 0.90-1.41x FlashInfer's speed (0.90-0.93 at B = 128,
        # S = 8192-16384; 1.41 at B = 1), where FlashInfer first was 0.71x at B = 1
        name="nvidia-sm90-decode-warpgroup",
        phase="decode",
        vendor="cuda",
        arch="sm_90",
        needs_wgmma=True,
        priority=("TRITON", "FLASHINFER", "CUDA_FLASH_ATTN", "FLASHMLA", "REFERENCE"),
        measured="bench/RESULTS.md, 'Decode on sm_90: the warpgroup kernels beside FlashInfer' (16-128 heads, bf16 and FP8)",
    ),
    SelectionRule(
        name="nvidia-decode-few-heads",
        phase="decode",
        vendor="cuda",
        arch=None,
        num_heads=(1, 16),
        priority=("TRITON", "FLASHINFER", "CUDA_FLASH_ATTN", "FLASHMLA", "REFERENCE"),
        measured="bench/RESULTS.md, 'Decode: every installed backend' (16 heads)",
    ),
    SelectionRule(
        name="nvidia-decode-fp8-up-to-32-heads",
        phase="decode",
        vendor="cuda",
        arch=None,
        num_heads=(17, 32),
        kv_cache_dtypes=frozenset({torch.float8_e4m3fn}),
        priority=("TRITON", "FLASHINFER", "CUDA_FLASH_ATTN", "FLASHMLA", "REFERENCE"),
        measured="bench/RESULTS.md, 'Decode: every installed backend' (FP8 caches)",
    ),
)


class NoBackendError(RuntimeError):
    """No backend (or not the forced one) can run a configuration; the message lists every reason."""

    def __init__(self, phase: str, platform: Platform, config, reasons: dict[str, list[str]], forced: str | None = None):
        self.phase = phase
        self.platform = platform
        self.config = config
        self.reasons = reasons
        self.forced = forced
        if forced:
            head = f"The forced {phase} backend {forced} cannot run this configuration"
        else:
            head = f"No MLA {phase} backend can run this configuration"
        lines = [
            f"{head} on {platform.name} ({platform.vendor} {platform.arch}):",
            f"  config: {config.describe()}",
        ]
        for name, backend_reasons in reasons.items():
            lines.append(f"  {name}:")
            lines.extend(f"    - {reason}" for reason in backend_reasons)
        super().__init__("\n".join(lines))


class UnknownBackendError(ValueError):
    """A backend name that is not registered for the phase."""


@dataclasses.dataclass
class Registry:
    """Backends by phase and their per-platform priorities.

    The module-level `default_registry` holds the package's backends; tests
    build their own `Registry` with test-only backends and tables.
    """

    backends: dict[str, dict[str, str | type]]
    priorities: dict[str, dict[tuple[str, str | None], tuple[str, ...]]]
    rules: tuple[SelectionRule, ...] = ()

    def __post_init__(self) -> None:
        self._select_cached = functools.lru_cache(maxsize=256)(self._select_uncached)
        self._load = functools.lru_cache(maxsize=64)(self._load_uncached)

    # -- registration ---------------------------------------------------------
    def register(self, phase: Phase, name: str, backend: str | type) -> None:
        """Register `backend` (a class or "module:Class") under `name` for `phase`."""
        self._check_phase(phase)
        self.backends[phase][name.upper()] = backend
        self.clear_cache()

    def names(self, phase: Phase) -> list[str]:
        self._check_phase(phase)
        return list(self.backends[phase])

    def clear_cache(self) -> None:
        self._select_cached.cache_clear()
        self._load.cache_clear()

    # -- lookup ---------------------------------------------------------------
    def rule_for(self, phase: Phase, platform: Platform, config) -> SelectionRule | None:
        """The first selection rule that matches `config` on `platform`, None when the platform's list applies."""
        if config is None:
            return None
        return next((r for r in self.rules if r.phase == phase and r.matches(platform, config)), None)

    def priority(self, phase: Phase, platform: Platform, config=None) -> tuple[str, ...]:
        """The ordered backend names tried for `phase` on `platform` (for `config`, when a rule matches it)."""
        self._check_phase(phase)
        rule = self.rule_for(phase, platform, config)
        if rule is not None:
            return rule.priority
        table = self.priorities[phase]
        for key in ((platform.vendor, platform.arch), (platform.vendor, None)):
            if key in table:
                return table[key]
        return ()

    def check_name(self, phase: Phase, name: str) -> str:
        normalized = name.upper()
        if normalized not in self.backends[phase]:
            raise UnknownBackendError(
                f"unknown {phase} backend {name!r}; valid names: {', '.join(self.backends[phase])}"
            )
        return normalized

    def _load_uncached(self, phase: Phase, name: str) -> tuple[type | None, str | None]:
        target = self.backends[phase][name]
        if not isinstance(target, str):
            return target, None
        module_name, _, class_name = target.partition(":")
        try:
            return getattr(importlib.import_module(module_name), class_name), None
        except Exception as error:  # an optional library may raise anything on import
            return None, f"importing {module_name} failed: {type(error).__name__}: {error}"

    def load(self, phase: Phase, name: str) -> type:
        backend, error = self._load(phase, self.check_name(phase, name))
        if backend is None:
            raise ImportError(error)
        return backend

    def reasons(self, phase: Phase, name: str, platform: Platform, config) -> list[str]:
        """Why backend `name` cannot run `config` on `platform` (empty: it can). Never raises."""
        backend, error = self._load(phase, self.check_name(phase, name))
        if backend is None:
            return [error]
        try:
            return list(backend.validate_configuration(platform, config))
        except Exception as error:  # a buggy probe is a reason, not a crash
            return [f"validate_configuration raised {type(error).__name__}: {error}"]

    # -- selection ------------------------------------------------------------
    def select(self, phase: Phase, config, platform: Platform | None = None, backend: str | None = None) -> type:
        """The backend class for `config`: the forced one (argument, then environment) or the first fitting by priority."""
        self._check_phase(phase)
        platform = platform or current_platform()
        forced = backend or _forced_from_env(phase)
        if forced is not None:
            forced = self.check_name(phase, forced)
        return self._select_cached(phase, config, platform, forced)

    def _select_uncached(self, phase: Phase, config, platform: Platform, forced: str | None) -> type:
        if forced is not None:
            reasons = self.reasons(phase, forced, platform, config)
            if reasons:
                raise NoBackendError(phase, platform, config, {forced: reasons}, forced=forced)
            return self.load(phase, forced)
        all_reasons: dict[str, list[str]] = {}
        for name in self.priority(phase, platform, config):
            reasons = self.reasons(phase, name, platform, config)
            if not reasons:
                logger.debug("selected %s backend %s on %s", phase, name, platform.name)
                if name == "REFERENCE" and platform.is_gpu():
                    logger.warning(
                        "%s on %s falls back to the slow REFERENCE backend; `mla-multi info` lists why the others "
                        "were rejected: %s", phase, platform.name,
                        "; ".join(f"{rejected}: {' / '.join(why)}" for rejected, why in all_reasons.items()),
                    )
                return self.load(phase, name)
            all_reasons[name] = reasons
        if not all_reasons:
            all_reasons["(none)"] = [f"no {phase} backend is listed for {platform.vendor} {platform.arch}"]
        raise NoBackendError(phase, platform, config, all_reasons)

    def explain(self, phase: Phase, config, platform: Platform | None = None) -> list[dict]:
        """Every registered backend of `phase`: its priority rank, reasons and whether it would be chosen."""
        platform = platform or current_platform()
        order = self.priority(phase, platform, config)
        rows = []
        chosen = None
        for name in list(order) + [n for n in self.backends[phase] if n not in order]:
            reasons = self.reasons(phase, name, platform, config)
            if name not in order:
                reasons = reasons + [f"not in the {phase} priority list of {platform.vendor} {platform.arch}"]
            selected = chosen is None and not reasons
            if selected:
                chosen = name
            rows.append({"name": name, "rank": order.index(name) if name in order else None,
                         "available": not reasons, "selected": selected, "reasons": reasons})
        return rows

    @staticmethod
    def _check_phase(phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}; accepted: {', '.join(PHASES)}")


_FORCING_VARIABLES = {
    "prefill": "MLA_MULTI_PREFILL_BACKEND",
    "decode": "MLA_MULTI_DECODE_BACKEND",
    "sparse_decode": "MLA_MULTI_SPARSE_DECODE_BACKEND",
    "sparse_prefill": "MLA_MULTI_SPARSE_PREFILL_BACKEND",
}


def _forced_from_env(phase: Phase) -> str | None:
    return getattr(envs, _FORCING_VARIABLES[phase])


default_registry = Registry(
    backends={"prefill": PREFILL_BACKENDS, "decode": DECODE_BACKENDS, "sparse_decode": SPARSE_DECODE_BACKENDS,
              "sparse_prefill": SPARSE_PREFILL_BACKENDS},
    priorities={"prefill": PREFILL_PRIORITIES, "decode": DECODE_PRIORITIES,
                "sparse_decode": SPARSE_DECODE_PRIORITIES, "sparse_prefill": SPARSE_PREFILL_PRIORITIES},
    rules=SELECTION_RULES,
)


def prefill_config(dims: MLADims, dtype: torch.dtype) -> PrefillSelectorConfig:
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}; accepted: a torch.dtype")
    return PrefillSelectorConfig(dims, dtype)


def decode_config(
    dims: MLADims,
    dtype: torch.dtype,
    kv_cache_dtype: str | torch.dtype = "auto",
    block_size: int = 64,
    max_query_len: int = 1,
    platform: Platform | None = None,
) -> DecodeSelectorConfig:
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}; accepted: a torch.dtype")
    check_positive_int("block_size", block_size)
    check_positive_int("max_query_len", max_query_len)
    resolved = resolve_kv_cache_dtype(kv_cache_dtype, dtype, platform or current_platform())
    return DecodeSelectorConfig(dims, dtype, resolved, block_size, max_query_len)


def select_prefill_backend(
    dims: MLADims, dtype: torch.dtype, *, backend: str | None = None, platform: Platform | None = None
) -> type[MLAPrefillBackend]:
    """The prefill backend class for (dims, dtype) on the current platform; raises `NoBackendError`."""
    return default_registry.select("prefill", prefill_config(dims, dtype), platform, backend)


def select_decode_backend(
    dims: MLADims,
    dtype: torch.dtype,
    kv_cache_dtype: str | torch.dtype = "auto",
    block_size: int = 64,
    *,
    max_query_len: int = 1,
    backend: str | None = None,
    platform: Platform | None = None,
) -> type[MLADecodeBackend]:
    """The decode backend class for the configuration on the current platform; raises `NoBackendError`."""
    config = decode_config(dims, dtype, kv_cache_dtype, block_size, max_query_len, platform)
    return default_registry.select("decode", config, platform, backend)


def sparse_config(dims: MLADims, dtype: torch.dtype, kv_dtype: torch.dtype, topk: int,
                  max_query_len: int = 1, num_tokens: int | None = None,
                  with_lengths: bool = False) -> SparseSelectorConfig:
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    for name, value in (("topk", topk), ("max_query_len", max_query_len)):
        check_positive_int(name, value)
    if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0):
        raise ValueError(f"num_tokens={num_tokens!r}; accepted: None or an int >= 0")
    return SparseSelectorConfig(dims, dtype, kv_dtype, topk, max_query_len, num_tokens, bool(with_lengths))


def select_sparse_backend(
    phase: Literal["sparse_decode", "sparse_prefill"], dims: MLADims, dtype: torch.dtype, kv_dtype: torch.dtype,
    topk: int, *, max_query_len: int = 1, backend: str | None = None, platform: Platform | None = None,
    num_tokens: int | None = None, with_lengths: bool = False,
) -> type[MLASparseBackend]:
    """The sparse backend class of `phase` for the configuration; raises `NoBackendError`. num_tokens /
    with_lengths: the planned call's query tokens and whether it passes topk_length (a rule may depend on
    them: `few_sparse_tokens`)."""
    if phase not in ("sparse_decode", "sparse_prefill"):
        raise ValueError(f"phase={phase!r}; accepted: sparse_decode, sparse_prefill")
    config = sparse_config(dims, dtype, kv_dtype, topk, max_query_len, num_tokens, with_lengths)
    return default_registry.select(phase, config, platform, backend)


def check_forced_names() -> None:
    """Fail on an `MLA_MULTI_*_BACKEND` value that names no registered backend, naming the variable.

    Only the name is checked here (at import); whether the forced backend can run a configuration is
    checked, with its reasons, where a configuration is selected.
    """
    import difflib

    for phase in PHASES:
        forced = _forced_from_env(phase)
        if forced is None:
            continue
        try:
            default_registry.check_name(phase, forced)
        except UnknownBackendError as error:
            close = difflib.get_close_matches(forced, default_registry.names(phase), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            variable = _FORCING_VARIABLES[phase]
            raw = envs.ENV_VARS[variable].raw() if hasattr(envs.ENV_VARS[variable], "raw") else forced
            raise UnknownBackendError(f"{variable}={raw!r}: {error}{hint}") from None


def names(phase: Phase) -> Sequence[str]:
    return default_registry.names(phase)
