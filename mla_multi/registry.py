"""Backend registration, per-platform priorities and selection with reasons.

Backends are registered by name with the *qualified name* of their class, so a
backend module (and the optional library behind it) is imported only when a
selection looks at it; an import that raises anything becomes a reason.

The priority lists for every platform live in `PREFILL_PRIORITIES` and
`DECODE_PRIORITIES` below and nowhere else, beside the sparse phases' lists
(`SPARSE_DECODE_PRIORITIES`, `SPARSE_PREFILL_PRIORITIES`); they are the one
place that names every backend of a platform. `SELECTION_RULES` beside them
holds the measured exceptions as deltas: under a condition (vendor, arch,
head-count range, cache dtypes, the planned call's token count, ...) a rule
moves the backends it prefers ahead of the ones it names, each rule naming its
measurement in bench/RESULTS.md; a backend added to a list therefore appears
under every rule. Adding a backend is one module, one row in the phase's
backends (plus its place in the lists) and one extra in pyproject.toml.
`select_*` walks the list of the
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
import warnings
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
    """A measured exception to a platform's priority list, as a delta applied to that list.

    Under its condition, every backend of `prefer` that comes after the first
    backend of `over` in the order so far moves to just ahead of it (in
    `prefer`'s order); with `over` empty, the backends of `prefer` go ahead of
    every other. Backends the rule does not name keep their places, so a
    backend added to a platform's list appears under every rule. A rule whose
    backends are absent from the list changes nothing.

    The condition: platform `vendor` (None: any) and `arch` (None: any), head
    count in `num_heads` (inclusive), the cache dtype (decode's
    kv_cache_dtype, the sparse phases' kv_dtype) in `kv_cache_dtypes`, the
    planned call's query tokens in `num_tokens` (inclusive, high None: no
    bound; a configuration planned without a count, num_tokens None, as when
    a layer is built, never matches a rule that names a range), and
    `when(platform, config)`, a further condition. `needs_wgmma`: the rule
    holds only where the sm_90 warpgroup decode kernels can run
    (`launch_config.wgmma_decode_reason`: an sm_90 device, a Triton with
    Gluon, a 16-bit or float8_e4m3fn cache), since they are what it measured.
    `measured` names the record in bench/RESULTS.md the rule comes from.
    Every matching rule applies, in `SELECTION_RULES` order.

    `priority` (a whole order, as rules were once written) is deprecated: it
    is read as `prefer=priority` with `over` empty.
    """

    name: str
    phase: str
    vendor: str | None = None
    arch: str | None = None
    prefer: tuple[str, ...] = ()
    over: tuple[str, ...] = ()
    measured: str = ""
    num_heads: tuple[int, int] = (1, 1 << 20)
    kv_cache_dtypes: frozenset | None = None
    num_tokens: tuple[int, int | None] | None = None
    needs_wgmma: bool = False
    when: Callable[[Platform, object], bool] | None = None  # a further condition on (platform, config)
    priority: tuple[str, ...] = ()  # deprecated: a whole order, read as prefer=priority

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"SelectionRule {self.name!r}: phase={self.phase!r}; accepted: {', '.join(PHASES)}")
        if self.priority:
            warnings.warn(f"SelectionRule {self.name!r}: priority= (a whole order) is deprecated; accepted: "
                          "prefer= and over= (the backends it moves ahead, of which)", DeprecationWarning, stacklevel=3)
            if self.prefer or self.over:
                raise ValueError(f"SelectionRule {self.name!r}: priority={self.priority!r} beside prefer / over; "
                                 "accepted: prefer= and over= alone")
            object.__setattr__(self, "prefer", tuple(self.priority))
        for field in ("prefer", "over"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(n, str) and n == n.upper() and n for n in value):
                raise ValueError(f"SelectionRule {self.name!r}: {field}={value!r}; accepted: a tuple of upper-case "
                                 "backend names")
            object.__setattr__(self, field, tuple(value))
        if not self.prefer:
            raise ValueError(f"SelectionRule {self.name!r}: prefer=(); accepted: at least one backend name")
        both = sorted(set(self.prefer) & set(self.over))
        if both:
            raise ValueError(f"SelectionRule {self.name!r}: {', '.join(both)} in both prefer and over; accepted: "
                             "each backend in one of them")
        low, high = self.num_heads
        if not 1 <= low <= high:
            raise ValueError(f"SelectionRule {self.name!r}: num_heads={self.num_heads!r}; accepted: (low, high) "
                             "with 1 <= low <= high")
        if self.num_tokens is not None:
            low, high = self.num_tokens
            if not (isinstance(low, int) and low >= 0 and (high is None or (isinstance(high, int) and high >= low))):
                raise ValueError(f"SelectionRule {self.name!r}: num_tokens={self.num_tokens!r}; accepted: None or "
                                 "(low, high) with 0 <= low <= high, high None for no bound")
        if not isinstance(self.measured, str) or not self.measured.strip():
            raise ValueError(f"SelectionRule {self.name!r}: measured={self.measured!r}; accepted: the record the "
                             "rule comes from ('bench/RESULTS.md, <its title>')")

    def names(self) -> tuple[str, ...]:
        """Every backend the rule names."""
        return self.prefer + self.over

    def matches(self, platform: Platform, config) -> bool:
        if self.vendor is not None and platform.vendor != self.vendor:
            return False
        if self.arch is not None and platform.arch != self.arch:
            return False
        low, high = self.num_heads
        if not low <= config.dims.num_heads <= high:
            return False
        kv_dtype = getattr(config, "kv_cache_dtype", None) or getattr(config, "kv_dtype", None)
        if self.kv_cache_dtypes is not None and kv_dtype not in self.kv_cache_dtypes:
            return False
        if self.num_tokens is not None:
            tokens = getattr(config, "num_tokens", None)
            low, high = self.num_tokens
            if tokens is None or tokens < low or (high is not None and tokens > high):
                return False
        if self.needs_wgmma:
            from mla_multi.kernels.launch_config import wgmma_decode_reason

            dims = config.dims
            kv = kv_dtype if kv_dtype is not None else torch.bfloat16
            if wgmma_decode_reason(platform, kv, dims.kv_lora_rank, dims.qk_rope_head_dim):
                return False
        return self.when is None or bool(self.when(platform, config))

    def apply(self, order: Sequence[str]) -> tuple[str, ...]:
        """`order` with the rule's delta applied (the same order where it changes nothing)."""
        order = tuple(order)
        if self.over:
            targets = [order.index(n) for n in self.over if n in order]
            if not targets:
                return order
            first = order[min(targets)]
            late = [n for n in self.prefer if n in order and order.index(n) > order.index(first)]
            if not late:
                return order
            rest = [n for n in order if n not in late]
            at = rest.index(first)
            return tuple(rest[:at] + late + rest[at:])
        ahead = [n for n in self.prefer if n in order]
        return tuple(ahead + [n for n in order if n not in ahead])

    def describe(self) -> str:
        return f"{self.name} ({self.measured})"

    def delta(self) -> str:
        """The rule's delta in words: 'FLASHMLA ahead of TRITON'."""
        return f"{', '.join(self.prefer)} ahead of {', '.join(self.over) if self.over else 'every other backend'}"


def few_sparse_tokens(platform: Platform, config) -> bool:
    """A planned sparse decode over the fp8_ds_mla cache, without per-token lengths, of one token or of tokens
    whose heads fit one 64-row head block and fill at most half the device's compute units: there TRITON's
    sm_90 kernels read the index lists as they are, in one-tile splits, and beat FlashMLA (bench/RESULTS.md,
    'Sparse decode: TRITON where the batch is small'); a layer built without a batch (num_tokens None) keeps
    the platform's order."""
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    tokens = getattr(config, "num_tokens", None)
    if (tokens is None or config.with_lengths or config.kv_dtype != torch.uint8 or getattr(config, "v4", False)
            or ds_mla_decode_reason(platform)):
        return False
    return tokens == 1 or (config.dims.num_heads <= 64 and tokens <= platform.num_compute_units // 2)


def v4_read_in_place(platform: Platform, config) -> bool:
    """A planned V4 sparse decode over ``fp8_ds_mla_v4`` caches (both segments) where TRITON's sm_90 kernels
    read them in place (`TritonSparseDecodeImpl._v4_in_place_reason`'s platform and format conditions)."""
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    return (getattr(config, "kv_format", None) == "fp8_ds_mla_v4"
            and getattr(config, "extra_kv_format", None) in (None, "fp8_ds_mla_v4")
            and config.dtype == torch.bfloat16 and not ds_mla_decode_reason(platform))


# the sm_90 sparse decode's rules: TRITON moved ahead of FLASHMLA, each under its own condition
_sm90_sparse_triton = functools.partial(SelectionRule, phase="sparse_decode", vendor="cuda", arch="sm_90",
                                        prefer=("TRITON",), over=("FLASHMLA",))
# the V4 ones: where TRITON reads the fp8_ds_mla_v4 caches in place, each with its head and token range
_sm90_v4_triton = functools.partial(
    _sm90_sparse_triton, when=v4_read_in_place,
    measured="bench/RESULTS.md, 'DeepSeek-V4 sparse decode and prefill beside FlashMLA' (H200, fp8_ds_mla_v4)")


# Measured exceptions to the lists above, as deltas: each that matches a configuration moves the backends it
# prefers ahead of the ones it names, in this order. Each names its measurement.
SELECTION_RULES: tuple[SelectionRule, ...] = (
    _sm90_sparse_triton(
        # 128 heads: B = 1 TRITON 17.0 µs, FLASHMLA 21.7; B = 2-16 within 4 % either way, TRITON behind from
        # B = 24. 64 heads: TRITON ahead 3-28 % up to B = 64 (80.1 against 85.0 µs), 3.5 % behind at B = 128
        name="nvidia-sm90-sparse-decode-few-tokens",
        when=few_sparse_tokens,
        measured="bench/RESULTS.md, 'Sparse decode: TRITON where the batch is small' (H200, fp8_ds_mla, topk 2048)",
    ),
    _sm90_v4_triton(
        # 64 heads, top-k 512 + a 128 window, the sink applied by the kernels, captured µs TRITON / FLASHMLA:
        # B = 1 13.4 / 17.1, 8 18.5 / 20.0, 32 31.0 / 34.7, 64 41.9 / 54.0, 128 58.7 / 58.1 (the index lists read
        # by the kernels); top-k 2048 (lists compacted first, before): B = 64 85.0 / 98.6, 128 137.0 / 148.9.
        # Every batch, so a layer built without one too
        name="nvidia-sm90-v4-sparse-decode-64-heads",
        num_heads=(1, 64),
    ),
    _sm90_v4_triton(
        # 128 heads, 1-12 tokens, the index lists read by the kernels (TRITON) and both lists sanitised in one
        # launch (FLASHMLA), captured µs TRITON / FLASHMLA: 1 14.8 / 16.2, 2 17.6 / 17.0, 4 17.7 / 18.4, 8 20.9 /
        # 20.6, 12 24.2 / 24.6 (within 4 % either way from 2 tokens; TRITON's eager call takes half FLASHMLA's host
        # time: one launch pair against four); from 13 tokens FLASHMLA ahead: 16 27.8 / 26.6, 24 35.1 / 31.9
        name="nvidia-sm90-v4-sparse-decode-128-heads-few-tokens",
        num_heads=(65, 128),
        num_tokens=(1, 12),
    ),
    _sm90_v4_triton(
        # 128 heads: two splits a token from 25 to 32 tokens (`heuristics.gathered_tile_splits`: one wave of
        # 100-128 programs), B = 32 TRITON 39.7 µs against FLASHMLA 42.0; from 33 tokens FLASHMLA ahead: 48 53.2
        # / 41.2, 64 55.7 / 42.8, 128 101.0 / 73.7 (each 64-head program gathers the rows the other reads too)
        name="nvidia-sm90-v4-sparse-decode-128-heads-two-splits",
        num_heads=(65, 128),
        num_tokens=(25, 32),
    ),
    SelectionRule(
        # every head count: at 128 heads TRITON is 0.90-1.41x FlashInfer's speed (0.90-0.93 at B = 128,
        # S = 8192-16384; 1.41 at B = 1), where FlashInfer first was 0.71x at B = 1
        name="nvidia-sm90-decode-warpgroup",
        phase="decode",
        vendor="cuda",
        arch="sm_90",
        needs_wgmma=True,
        prefer=("TRITON",),
        over=("FLASHINFER",),
        measured="bench/RESULTS.md, 'Decode on sm_90: the warpgroup kernels beside FlashInfer' (16-128 heads, bf16 and FP8)",
    ),
    SelectionRule(
        name="nvidia-decode-few-heads",
        phase="decode",
        vendor="cuda",
        num_heads=(1, 16),
        prefer=("TRITON",),
        over=("FLASHINFER",),
        measured="bench/RESULTS.md, 'Decode: every installed backend' (16 heads)",
    ),
    SelectionRule(
        name="nvidia-decode-fp8-up-to-32-heads",
        phase="decode",
        vendor="cuda",
        num_heads=(17, 32),
        kv_cache_dtypes=frozenset({torch.float8_e4m3fn}),
        prefer=("TRITON",),
        over=("FLASHINFER",),
        measured="bench/RESULTS.md, 'Decode: every installed backend' (FP8 caches)",
    ),
    SelectionRule(
        # planned with its batch (num_tokens = B x Q): H200, S = 8192, captured, FLASHMLA against TRITON µs:
        # B = 32 151.1 / 148.7, B = 64 269.5 / 283.0, B = 128 543.8 / 672.0 (an earlier run: 129.2 / 145.8,
        # 238.6 / 279.5, 535.4 / 569.7); at B = 8 and below TRITON is faster, and at B = 32 the functional op's
        # FLASHMLA path (its schedule and empty-row masks every call) took 165.6 µs captured. After the
        # warpgroup rule: where it held, FLASHMLA, TRITON, FLASHINFER
        name="nvidia-sm90-decode-flashmla-from-64-tokens",
        phase="decode",
        vendor="cuda",
        arch="sm_90",
        num_heads=(128, 128),
        kv_cache_dtypes=frozenset({torch.bfloat16}),
        num_tokens=(64, None),
        prefer=("FLASHMLA",),
        over=("TRITON",),
        measured="bench/RESULTS.md, 'Dense decode on sm_90: FLASHMLA from B = 64 (H200)' (128 heads, bf16 cache)",
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
        for rule in self.rules:
            self._check_phase(rule.phase)
            known = self.backends.get(rule.phase, {})
            unknown = [n for n in rule.names() if n not in known]
            if unknown:
                raise UnknownBackendError(
                    f"selection rule {rule.name!r} names {', '.join(unknown)}, not {rule.phase} backends; "
                    f"valid names: {', '.join(known)}"
                )
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
    def base_priority(self, phase: Phase, platform: Platform) -> tuple[str, ...]:
        """The platform's own list for `phase`: the entry of (vendor, arch), else of vendor, else none."""
        self._check_phase(phase)
        table = self.priorities[phase]
        for key in ((platform.vendor, platform.arch), (platform.vendor, None)):
            if key in table:
                return tuple(table[key])
        return ()

    def ordering(self, phase: Phase, platform: Platform,
                 config=None) -> tuple[tuple[str, ...], tuple[SelectionRule, ...]]:
        """(the order tried for `config`, the rules that changed it): the platform's list with every matching
        rule's delta applied in turn."""
        order = self.base_priority(phase, platform)
        applied = []
        if config is not None:
            for rule in self.rules:
                if rule.phase == phase and rule.matches(platform, config):
                    changed = rule.apply(order)
                    if changed != order:
                        order = changed
                        applied.append(rule)
        return order, tuple(applied)

    def rules_for(self, phase: Phase, platform: Platform, config) -> tuple[SelectionRule, ...]:
        """The selection rules that change the order of `config` on `platform`, in the order they apply."""
        return self.ordering(phase, platform, config)[1]

    def rule_for(self, phase: Phase, platform: Platform, config) -> SelectionRule | None:
        """The last rule that changes the order of `config` on `platform` (the one with the last word), None
        when the platform's list applies as it is; `rules_for` gives them all."""
        applied = self.rules_for(phase, platform, config)
        return applied[-1] if applied else None

    def priority(self, phase: Phase, platform: Platform, config=None) -> tuple[str, ...]:
        """The ordered backend names tried for `phase` on `platform` (for `config`, with the rules' deltas)."""
        return self.ordering(phase, platform, config)[0]

    def num_tokens_bounds(self, phase: Phase) -> tuple[int, ...]:
        """The token counts at which a rule of `phase` starts or stops holding (its `num_tokens` ranges): a
        planned call's selection can change only there, as far as the rules' ranges go."""
        self._check_phase(phase)
        bounds = set()
        for rule in self.rules:
            if rule.phase == phase and rule.num_tokens is not None:
                low, high = rule.num_tokens
                bounds.add(low)
                if high is not None:
                    bounds.add(high + 1)
        return tuple(sorted(bounds))

    def by_num_tokens(self, phase: Phase, config, platform: Platform | None = None, backend: str | None = None,
                      max_tokens: int | None = None) -> list[tuple[int, int | None, type]]:
        """[(low, high, backend class)]: what a call of `config` planned with low..high query tokens gets (high
        None: no bound), one entry per range the rules' `num_tokens` bounds make, neighbours of one backend
        joined, from 1 up to `max_tokens`. Raises `NoBackendError` as `select` does."""
        self._check_phase(phase)
        if max_tokens is not None:
            check_positive_int("max_tokens", max_tokens)
        starts = [1] + [b for b in self.num_tokens_bounds(phase) if b > 1 and (max_tokens is None or b <= max_tokens)]
        ranges: list[tuple[int, int | None, type]] = []
        for i, low in enumerate(starts):
            high = starts[i + 1] - 1 if i + 1 < len(starts) else max_tokens
            chosen = self.select(phase, dataclasses.replace(config, num_tokens=low), platform, backend)
            if ranges and ranges[-1][2] is chosen:
                ranges[-1] = (ranges[-1][0], high, chosen)
            else:
                ranges.append((low, high, chosen))
        return ranges

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
    num_tokens: int | None = None,
    needs_lse: bool = False,
) -> DecodeSelectorConfig:
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}; accepted: a torch.dtype")
    check_positive_int("block_size", block_size)
    check_positive_int("max_query_len", max_query_len)
    _check_num_tokens(num_tokens)
    resolved = resolve_kv_cache_dtype(kv_cache_dtype, dtype, platform or current_platform())
    return DecodeSelectorConfig(dims, dtype, resolved, block_size, max_query_len, num_tokens,
                                needs_lse=bool(needs_lse))


def _check_num_tokens(num_tokens) -> None:
    if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0):
        raise ValueError(f"num_tokens={num_tokens!r}; accepted: None or an int >= 0")


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
    num_tokens: int | None = None,
    needs_lse: bool = False,
) -> type[MLADecodeBackend]:
    """The decode backend class for the configuration on the current platform; raises `NoBackendError`.
    num_tokens: the planned call's query tokens (batch x query length; None where unknown, as when a layer is
    built): a rule may depend on it (`nvidia-sm90-decode-flashmla-from-64-tokens`). needs_lse: the caller uses
    the decode LSE (a backend whose kernel writes none declines)."""
    config = decode_config(dims, dtype, kv_cache_dtype, block_size, max_query_len, platform, num_tokens,
                           needs_lse)
    return default_registry.select("decode", config, platform, backend)


def sparse_config(dims: MLADims, dtype: torch.dtype, kv_dtype: torch.dtype, topk: int,
                  max_query_len: int = 1, num_tokens: int | None = None,
                  with_lengths: bool = False, kv_format: str | None = None, extra_kv_format: str | None = None,
                  with_sink: bool = False) -> SparseSelectorConfig:
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    for name, value in (("topk", topk), ("max_query_len", max_query_len)):
        check_positive_int(name, value)
    _check_num_tokens(num_tokens)
    if extra_kv_format is not None and kv_format is None:
        raise ValueError(f"extra_kv_format={extra_kv_format!r} without a kv_format; a second KV segment is part of "
                         "the V4 contract (kv_format set)")
    return SparseSelectorConfig(dims, dtype, kv_dtype, topk, max_query_len, num_tokens, bool(with_lengths),
                                kv_format, extra_kv_format, bool(with_sink))


def select_sparse_backend(
    phase: Literal["sparse_decode", "sparse_prefill"], dims: MLADims, dtype: torch.dtype, kv_dtype: torch.dtype,
    topk: int, *, max_query_len: int = 1, backend: str | None = None, platform: Platform | None = None,
    num_tokens: int | None = None, with_lengths: bool = False, kv_format: str | None = None,
    extra_kv_format: str | None = None, with_sink: bool = False,
) -> type[MLASparseBackend]:
    """The sparse backend class of `phase` for the configuration; raises `NoBackendError`. num_tokens /
    with_lengths: the planned call's query tokens and whether it passes topk_length (a rule may depend on
    them: `few_sparse_tokens`). kv_format (a `mla_multi.cache_formats` name, or "rows" for float rows) selects
    for the V4 contract (d_qk = d_v = 512), extra_kv_format its second segment's format, with_sink a sink."""
    if phase not in ("sparse_decode", "sparse_prefill"):
        raise ValueError(f"phase={phase!r}; accepted: sparse_decode, sparse_prefill")
    config = sparse_config(dims, dtype, kv_dtype, topk, max_query_len, num_tokens, with_lengths, kv_format,
                           extra_kv_format, with_sink)
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
