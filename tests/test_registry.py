"""Backend selection: per-platform priorities, reasons, forcing, caching, and the package's default registry.

The registry under test is a fresh `Registry` with test-only backends, so these
tests do not change when the package gains backends.
"""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch

import mla_multi as mm
from mla_multi.backends.base import (
    FP8_DTYPES,
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLAPrefillBackend,
    PrefillSelectorConfig,
    resolve_kv_cache_dtype,
)
from mla_multi.backends.reference import ReferenceDecodeImpl, ReferencePrefillImpl
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS, Platform, override
from mla_multi.registry import NoBackendError, Registry, UnknownBackendError, decode_config, default_registry

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


# --------------------------------------------------------------------------- test-only backends


class _Decode(MLADecodeBackend):
    @staticmethod
    def get_decode_impl_cls():
        return ReferenceDecodeImpl


class _Prefill(MLAPrefillBackend):
    @staticmethod
    def get_prefill_impl_cls():
        return ReferencePrefillImpl


class AiterLikeDecode(_Decode):
    """CDNA3+ only, bf16, 16 or 128 heads, block sizes 1 and 64, bf16 or fp8 cache."""

    name = "AITER_LIKE"
    vendors = frozenset({"rocm"})
    supported_dtypes = (BF16,)
    supported_kv_cache_dtypes = (BF16,) + FP8_DTYPES
    supported_num_heads = (16, 128)
    supported_block_sizes = (1, 64)

    @classmethod
    def validate_configuration(cls, platform, config):
        reasons = super().validate_configuration(platform, config)
        if platform.is_rocm() and not platform.is_cdna3_or_newer():
            reasons.append(f"arch {platform.arch} is not gfx942 or gfx950")
        return reasons


class FlashMLALikeDecode(_Decode):
    """NVIDIA sm_90+ only, block size 64."""

    name = "FLASHMLA_LIKE"
    vendors = frozenset({"cuda"})
    supported_block_sizes = (64,)

    @classmethod
    def validate_configuration(cls, platform, config):
        reasons = super().validate_configuration(platform, config)
        if platform.is_cuda() and not platform.has_device_capability(9, 0):
            reasons.append(f"needs compute capability 9.0, {platform.name} has {platform.device_capability}")
        return reasons


class PortableDecode(_Decode):
    name = "PORTABLE"
    vendors = frozenset({"cuda", "rocm"})
    supported_dtypes = (FP16, BF16, FP32)
    supported_kv_cache_dtypes = (FP16, BF16, FP32) + FP8_DTYPES


class FallbackDecode(_Decode):
    name = "FALLBACK"
    supported_dtypes = (FP16, BF16, FP32, FP64)
    supported_kv_cache_dtypes = (FP16, BF16, FP32, FP64) + FP8_DTYPES


class UnavailableDecode(_Decode):
    name = "UNAVAILABLE"

    @classmethod
    def availability_reasons(cls):
        return ["libunavailable is not installed"]


class BuggyDecode(_Decode):
    name = "BUGGY"

    @classmethod
    def validate_configuration(cls, platform, config):
        raise ZeroDivisionError("probe divided by zero")


class CountingDecode(_Decode):
    """Counts its validations, to see the selection cache at work."""

    name = "COUNTING"
    calls = 0

    @classmethod
    def validate_configuration(cls, platform, config):
        CountingDecode.calls += 1
        return super().validate_configuration(platform, config)


class RocmPrefill(_Prefill):
    name = "PF_ROCM"
    vendors = frozenset({"rocm"})
    supported_dtypes = (BF16,)


class CudaSm90Prefill(_Prefill):
    name = "PF_CUDA_SM90"
    vendors = frozenset({"cuda"})

    @classmethod
    def validate_configuration(cls, platform, config):
        reasons = super().validate_configuration(platform, config)
        if platform.is_cuda() and not platform.has_device_capability(9, 0):
            reasons.append("needs compute capability 9.0")
        return reasons


class AnyPrefill(_Prefill):
    name = "PF_ANY"
    supported_dtypes = (FP16, BF16, FP32, FP64)


BROKEN_MODULE = "mla_multi_test_broken_backend"
LAZY_MODULE = "mla_multi_test_lazy_backend"

BROKEN_SOURCE = 'raise RuntimeError("libbroken needs a ROCm runtime")\n'
LAZY_SOURCE = textwrap.dedent(
    """
    from mla_multi.backends.base import MLADecodeBackend
    from mla_multi.backends.reference import ReferenceDecodeImpl

    class LazyDecode(MLADecodeBackend):
        name = "LAZY"
        vendors = frozenset({"rocm"})

        @staticmethod
        def get_decode_impl_cls():
            return ReferenceDecodeImpl
    """
)

DECODE_PRIORITIES = {
    ("rocm", "gfx942"): ("BROKEN_IMPORT", "AITER_LIKE", "PORTABLE", "FALLBACK"),
    ("rocm", "gfx950"): ("AITER_LIKE", "PORTABLE", "FALLBACK"),
    ("rocm", None): ("UNAVAILABLE", "PORTABLE", "FALLBACK"),
    ("cuda", "sm_90"): ("FLASHMLA_LIKE", "PORTABLE", "FALLBACK"),
    # On sm_100 the portable backend is preferred even though FLASHMLA_LIKE fits too.
    ("cuda", "sm_100"): ("PORTABLE", "FLASHMLA_LIKE", "FALLBACK"),
    ("cuda", None): ("UNAVAILABLE", "FLASHMLA_LIKE", "PORTABLE", "FALLBACK"),
    ("cpu", None): ("PORTABLE", "FALLBACK"),
}
PREFILL_PRIORITIES = {
    ("rocm", "gfx942"): ("PF_ROCM", "PF_ANY"),
    ("rocm", None): ("PF_ANY",),
    ("cuda", None): ("PF_CUDA_SM90", "PF_ANY"),
    ("cpu", None): ("PF_ANY",),
}


@pytest.fixture
def backend_modules(tmp_path, monkeypatch):
    """Write the broken and the lazy backend modules onto sys.path (and forget them afterwards)."""
    (tmp_path / f"{BROKEN_MODULE}.py").write_text(BROKEN_SOURCE)
    (tmp_path / f"{LAZY_MODULE}.py").write_text(LAZY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in (BROKEN_MODULE, LAZY_MODULE):
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield
    for module in (BROKEN_MODULE, LAZY_MODULE):
        sys.modules.pop(module, None)


@pytest.fixture
def registry(backend_modules, monkeypatch):
    for name in ("MLA_MULTI_PREFILL_BACKEND", "MLA_MULTI_DECODE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    CountingDecode.calls = 0
    return Registry(
        backends={
            "prefill": {"PF_ROCM": RocmPrefill, "PF_CUDA_SM90": CudaSm90Prefill, "PF_ANY": AnyPrefill},
            "decode": {
                "BROKEN_IMPORT": f"{BROKEN_MODULE}:BrokenDecode",
                "AITER_LIKE": AiterLikeDecode,
                "FLASHMLA_LIKE": FlashMLALikeDecode,
                "PORTABLE": PortableDecode,
                "FALLBACK": FallbackDecode,
                "UNAVAILABLE": UnavailableDecode,
            },
        },
        priorities={"prefill": dict(PREFILL_PRIORITIES), "decode": dict(DECODE_PRIORITIES)},
    )


def dconfig(num_heads=16, dtype=BF16, kv_cache_dtype=None, block_size=64, max_query_len=1):
    return DecodeSelectorConfig(MLADims(num_heads), dtype, kv_cache_dtype or dtype, block_size, max_query_len)


def pconfig(num_heads=16, dtype=BF16):
    return PrefillSelectorConfig(MLADims(num_heads), dtype)


# --------------------------------------------------------------------------- priorities


@pytest.mark.parametrize(
    "platform, key",
    [("MI300X", ("rocm", "gfx942")), ("MI325X", ("rocm", "gfx942")), ("MI355X", ("rocm", "gfx950")),
     ("MI250X", ("rocm", None)), ("RX7900XTX", ("rocm", None)), ("A100", ("cuda", None)),
     ("H100", ("cuda", "sm_90")), ("H200", ("cuda", "sm_90")), ("B200", ("cuda", "sm_100")), ("CPU", ("cpu", None))],
)
def test_arch_entries_beat_vendor_entries(registry, platform, key):
    assert registry.priority("decode", SPECS[platform]) == DECODE_PRIORITIES[key]


def test_platform_without_entry_has_no_candidates(registry):
    del registry.priorities["decode"][("cpu", None)]
    assert registry.priority("decode", SPECS["CPU"]) == ()
    with pytest.raises(NoBackendError) as info:
        registry.select("decode", dconfig(), SPECS["CPU"])
    assert "no decode backend is listed for cpu cpu" in str(info.value)


# (platform, config) -> the first fitting backend of the platform's list
DECODE_CASES = [
    # bf16, 16 heads, bf16 cache, block 64
    ("MI300X", dconfig(), "AITER_LIKE"),
    ("MI325X", dconfig(), "AITER_LIKE"),
    ("MI355X", dconfig(), "AITER_LIKE"),
    ("MI250X", dconfig(), "PORTABLE"),
    ("RX7900XTX", dconfig(), "PORTABLE"),
    ("A100", dconfig(), "PORTABLE"),
    ("H100", dconfig(), "FLASHMLA_LIKE"),
    ("H200", dconfig(), "FLASHMLA_LIKE"),
    ("B200", dconfig(), "PORTABLE"),
    ("CPU", dconfig(), "FALLBACK"),
    # 32 heads: AITER_LIKE only runs 16 or 128
    ("MI300X", dconfig(num_heads=32), "PORTABLE"),
    ("H100", dconfig(num_heads=32), "FLASHMLA_LIKE"),
    # block size 16: only 1/64 on AITER_LIKE, 64 on FLASHMLA_LIKE
    ("MI355X", dconfig(block_size=16), "PORTABLE"),
    ("H100", dconfig(block_size=16), "PORTABLE"),
    # block size 1
    ("MI300X", dconfig(block_size=1), "AITER_LIKE"),
    # fp32: neither vendor library
    ("MI300X", dconfig(dtype=FP32), "PORTABLE"),
    ("H200", dconfig(dtype=FP32), "PORTABLE"),
    # fp8 caches
    ("MI300X", dconfig(kv_cache_dtype=torch.float8_e4m3fnuz), "AITER_LIKE"),
    ("H100", dconfig(kv_cache_dtype=torch.float8_e4m3fn), "PORTABLE"),
    # float64 runs only on the fallback
    ("MI300X", dconfig(dtype=FP64), "FALLBACK"),
    ("H100", dconfig(dtype=FP64), "FALLBACK"),
    ("CPU", dconfig(dtype=FP64), "FALLBACK"),
    # 200 heads: over every declared maximum but PORTABLE/FALLBACK's default of 128 -> see the error test
]


@pytest.mark.parametrize("platform, config, expected", DECODE_CASES,
                         ids=[f"{p}-{c.dtype}-N{c.dims.num_heads}-bs{c.block_size}-{c.kv_cache_dtype}".replace("torch.", "")
                              for p, c, _ in DECODE_CASES])
def test_decode_priority_order(registry, platform, config, expected):
    chosen = registry.select("decode", config, SPECS[platform])
    assert chosen.name == expected
    # The same through the impersonated current platform.
    registry.clear_cache()
    with override(platform):
        assert registry.select("decode", config) is chosen


@pytest.mark.parametrize(
    "platform, config, expected",
    [("MI300X", pconfig(), "PF_ROCM"), ("MI325X", pconfig(), "PF_ROCM"), ("MI300X", pconfig(dtype=FP16), "PF_ANY"),
     ("MI355X", pconfig(), "PF_ANY"), ("RX7900XTX", pconfig(), "PF_ANY"), ("A100", pconfig(), "PF_ANY"),
     ("H100", pconfig(), "PF_CUDA_SM90"), ("B200", pconfig(), "PF_CUDA_SM90"), ("CPU", pconfig(), "PF_ANY")],
)
def test_prefill_priority_order(registry, platform, config, expected):
    with override(platform):
        assert registry.select("prefill", config).name == expected


def test_first_fitting_backend_wins(registry):
    # On B200 both PORTABLE and FLASHMLA_LIKE fit; the list puts PORTABLE first.
    config = dconfig()
    b200 = SPECS["B200"]
    assert registry.reasons("decode", "PORTABLE", b200, config) == []
    assert registry.reasons("decode", "FLASHMLA_LIKE", b200, config) == []
    assert registry.select("decode", config, b200).name == "PORTABLE"
    registry.priorities["decode"][("cuda", "sm_100")] = ("FLASHMLA_LIKE", "PORTABLE")
    registry.clear_cache()
    assert registry.select("decode", config, b200).name == "FLASHMLA_LIKE"


def test_custom_platform_uses_the_vendor_entry(registry):
    gfx1201 = Platform("RX9070XT", "rocm", "gfx1201", 64, 32, torch.float8_e4m3fn, 64 * 1024)
    assert registry.priority("decode", gfx1201) == DECODE_PRIORITIES[("rocm", None)]
    assert registry.select("decode", dconfig(), gfx1201).name == "PORTABLE"


# --------------------------------------------------------------------------- reasons and NoBackendError


def test_reasons_of_each_kind(registry):
    mi300x, h100, a100, cpu = SPECS["MI300X"], SPECS["H100"], SPECS["A100"], SPECS["CPU"]
    config = dconfig(num_heads=32, dtype=FP32, block_size=16)
    reasons = registry.reasons("decode", "AITER_LIKE", mi300x, config)
    assert any("dtype float32 is not supported; supported: bfloat16" in r for r in reasons)
    assert any("kv_cache_dtype float32 is not supported" in r for r in reasons)
    assert any("block_size 16 is not supported; supported: 1, 64" in r for r in reasons)
    assert any("num_heads 32 is not supported; supported: 16, 128" in r for r in reasons)
    assert len(reasons) == 4
    assert registry.reasons("decode", "AITER_LIKE", SPECS["MI250X"], dconfig()) == ["arch gfx90a is not gfx942 or gfx950"]
    assert any("supported vendors: rocm" in r for r in registry.reasons("decode", "AITER_LIKE", h100, dconfig()))
    assert any("capability 9.0" in r for r in registry.reasons("decode", "FLASHMLA_LIKE", a100, dconfig()))
    assert any("supported vendors: cuda, rocm" in r for r in registry.reasons("decode", "PORTABLE", cpu, dconfig()))
    assert registry.reasons("decode", "UNAVAILABLE", cpu, dconfig()) == ["libunavailable is not installed"]
    assert registry.reasons("decode", "FALLBACK", cpu, dconfig(num_heads=129)) == [
        "num_heads 129 is over the maximum of 128"
    ]
    too_long = registry.reasons("decode", "FALLBACK", cpu, dconfig(max_query_len=4))
    assert len(too_long) == 1 and "max_query_len 4" in too_long[0] and "maximum of 1" in too_long[0]


def test_is_available_and_supports_platform():
    assert UnavailableDecode.is_available() is False
    assert PortableDecode.is_available() is True
    assert AiterLikeDecode.supports_platform(SPECS["MI300X"]) is True
    assert AiterLikeDecode.supports_platform(SPECS["H100"]) is False
    assert PortableDecode.supports_dtype(FP32) and not PortableDecode.supports_dtype(FP64)


def test_broken_import_is_a_reason(registry):
    assert BROKEN_MODULE not in sys.modules
    reasons = registry.reasons("decode", "BROKEN_IMPORT", SPECS["MI300X"], dconfig())
    assert len(reasons) == 1
    assert f"importing {BROKEN_MODULE} failed: RuntimeError: libbroken needs a ROCm runtime" == reasons[0]
    with pytest.raises(ImportError, match="libbroken"):
        registry.load("decode", "BROKEN_IMPORT")


def test_raising_validation_is_a_reason(registry):
    registry.register("decode", "buggy", BuggyDecode)
    assert "BUGGY" in registry.names("decode")
    reasons = registry.reasons("decode", "BUGGY", SPECS["CPU"], dconfig())
    assert reasons == ["validate_configuration raised ZeroDivisionError: probe divided by zero"]
    registry.priorities["decode"][("cpu", None)] = ("BUGGY", "FALLBACK")
    assert registry.select("decode", dconfig(), SPECS["CPU"]).name == "FALLBACK"


def test_backend_modules_are_imported_only_when_looked_at(registry):
    registry.register("decode", "LAZY", f"{LAZY_MODULE}:LazyDecode")
    assert LAZY_MODULE not in sys.modules
    registry.select("decode", dconfig(), SPECS["CPU"])  # LAZY is not in the CPU list
    assert LAZY_MODULE not in sys.modules
    registry.priorities["decode"][("rocm", "gfx950")] = ("LAZY", "FALLBACK")
    registry.clear_cache()
    chosen = registry.select("decode", dconfig(), SPECS["MI355X"])
    assert LAZY_MODULE in sys.modules
    assert chosen is sys.modules[LAZY_MODULE].LazyDecode


def block_of(message: str, name: str) -> list[str]:
    """The reason lines under `  NAME:` in a NoBackendError message."""
    lines = message.splitlines()
    start = lines.index(f"  {name}:") + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("    - "):
            break
        block.append(line.removeprefix("    - "))
    return block


def test_no_backend_error_lists_config_and_one_block_per_backend(registry):
    config = dconfig(num_heads=200)
    mi300x = SPECS["MI300X"]
    with pytest.raises(NoBackendError) as info:
        registry.select("decode", config, mi300x)
    error = info.value
    message = str(error)
    assert isinstance(error, RuntimeError)
    assert error.phase == "decode" and error.platform is mi300x and error.config == config and error.forced is None
    assert message.startswith("No MLA decode backend can run this configuration on MI300X (rocm gfx942):")
    assert f"config: {config.describe()}" in message
    assert "num_heads=200" in message and "dtype=bfloat16" in message and "block_size=64" in message
    order = DECODE_PRIORITIES[("rocm", "gfx942")]
    assert list(error.reasons) == list(order)
    # One block per backend, in priority order, each with exactly that backend's reasons.
    positions = [message.index(f"\n  {name}:\n") for name in order]
    assert positions == sorted(positions)
    for name in order:
        assert block_of(message, name) == error.reasons[name] == registry.reasons("decode", name, mi300x, config)
        assert error.reasons[name]
    assert "RuntimeError: libbroken" in block_of(message, "BROKEN_IMPORT")[0]
    assert block_of(message, "AITER_LIKE") == ["num_heads 200 is not supported; supported: 16, 128"]
    assert block_of(message, "FALLBACK") == ["num_heads 200 is over the maximum of 128"]


def test_no_backend_error_for_prefill(registry):
    with pytest.raises(NoBackendError) as info:
        registry.select("prefill", pconfig(dtype=torch.int8), SPECS["H100"])
    message = str(info.value)
    assert "No MLA prefill backend" in message and "on H100 (cuda sm_90)" in message
    assert pconfig(dtype=torch.int8).describe() in message
    assert block_of(message, "PF_CUDA_SM90") == ["dtype int8 is not supported; supported: float16, bfloat16"]
    assert block_of(message, "PF_ANY") == ["dtype int8 is not supported; supported: float16, bfloat16, float32, float64"]


# --------------------------------------------------------------------------- forcing


def test_forcing_by_argument_picks_a_lower_priority_backend(registry):
    assert registry.select("decode", dconfig(), SPECS["MI300X"], backend="portable").name == "PORTABLE"
    assert registry.select("decode", dconfig(), SPECS["MI300X"], backend="FALLBACK").name == "FALLBACK"


@pytest.mark.parametrize(
    "forced, platform, expected_reason",
    [
        ("FLASHMLA_LIKE", "MI300X", "supported vendors: cuda"),
        ("AITER_LIKE", "MI250X", "arch gfx90a is not gfx942 or gfx950"),
        ("UNAVAILABLE", "H100", "libunavailable is not installed"),
        ("BROKEN_IMPORT", "MI300X", "RuntimeError: libbroken needs a ROCm runtime"),
        ("PORTABLE", "CPU", "supported vendors: cuda, rocm"),
    ],
)
def test_forced_backend_that_does_not_fit_raises_and_never_falls_back(registry, forced, platform, expected_reason):
    with pytest.raises(NoBackendError) as info:
        registry.select("decode", dconfig(), SPECS[platform], backend=forced.lower())
    error = info.value
    assert error.forced == forced
    assert list(error.reasons) == [forced]
    message = str(error)
    assert message.startswith(f"The forced decode backend {forced} cannot run this configuration on {platform}")
    assert any(expected_reason in r for r in block_of(message, forced))


def test_forcing_by_environment(registry, monkeypatch):
    monkeypatch.setenv("MLA_MULTI_DECODE_BACKEND", "portable")
    assert registry.select("decode", dconfig(), SPECS["MI300X"]).name == "PORTABLE"
    monkeypatch.setenv("MLA_MULTI_DECODE_BACKEND", "flashmla_like")
    with pytest.raises(NoBackendError) as info:
        registry.select("decode", dconfig(), SPECS["MI300X"])
    assert info.value.forced == "FLASHMLA_LIKE"
    assert "supported vendors: cuda" in str(info.value)
    # The argument beats the environment.
    assert registry.select("decode", dconfig(), SPECS["MI300X"], backend="fallback").name == "FALLBACK"
    # The decode variable does not force prefill.
    assert registry.select("prefill", pconfig(), SPECS["MI300X"]).name == "PF_ROCM"
    monkeypatch.setenv("MLA_MULTI_PREFILL_BACKEND", "pf_any")
    assert registry.select("prefill", pconfig(), SPECS["MI300X"]).name == "PF_ANY"
    monkeypatch.delenv("MLA_MULTI_DECODE_BACKEND")
    assert registry.select("decode", dconfig(), SPECS["MI300X"]).name == "AITER_LIKE"


def test_unknown_names_list_valid_ones(registry, monkeypatch):
    with pytest.raises(UnknownBackendError) as info:
        registry.select("decode", dconfig(), SPECS["CPU"], backend="FlashInfer")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "unknown decode backend 'FlashInfer'" in message
    for name in registry.names("decode"):
        assert name in message
    monkeypatch.setenv("MLA_MULTI_PREFILL_BACKEND", "nope")
    with pytest.raises(UnknownBackendError) as info:
        registry.select("prefill", pconfig(), SPECS["CPU"])
    assert "'NOPE'" in str(info.value)
    assert "PF_ROCM, PF_CUDA_SM90, PF_ANY" in str(info.value)
    with pytest.raises(UnknownBackendError):
        registry.load("prefill", "AITER_LIKE")  # a decode name is not a prefill name


def test_bad_phase(registry):
    with pytest.raises(ValueError, match="phase='encode'; accepted: prefill, decode"):
        registry.select("encode", dconfig(), SPECS["CPU"])
    with pytest.raises(ValueError, match="phase"):
        registry.names("both")


# --------------------------------------------------------------------------- caching and explain


def test_selection_is_cached_per_config_and_platform(registry):
    registry.register("decode", "COUNTING", CountingDecode)
    registry.priorities["decode"][("cpu", None)] = ("COUNTING", "FALLBACK")
    cpu = SPECS["CPU"]
    first = registry.select("decode", dconfig(), cpu)
    assert first is CountingDecode and CountingDecode.calls == 1
    for _ in range(5):
        assert registry.select("decode", dconfig(), cpu) is first  # an equal, new config object
    assert CountingDecode.calls == 1
    registry.select("decode", dconfig(num_heads=8), cpu)
    assert CountingDecode.calls == 2
    custom_cpu = Platform("CPU", "cpu", "cpu", 7, 1, None, 0)
    registry.select("decode", dconfig(), custom_cpu)
    assert CountingDecode.calls == 3
    registry.clear_cache()
    registry.select("decode", dconfig(), cpu)
    assert CountingDecode.calls == 4
    registry.select("decode", dconfig(), cpu)
    assert CountingDecode.calls == 4
    # Registering a backend clears the cache too.
    registry.register("decode", "UNAVAILABLE", UnavailableDecode)
    registry.select("decode", dconfig(), cpu)
    assert CountingDecode.calls == 5


def test_failed_selection_is_cached_and_raises_each_time(registry):
    registry.register("decode", "COUNTING", CountingDecode)
    registry.priorities["decode"][("cpu", None)] = ("COUNTING",)
    for _ in range(3):
        with pytest.raises(NoBackendError):
            registry.select("decode", dconfig(dtype=FP64), SPECS["CPU"])
    # lru_cache does not keep exceptions, so each failing selection validates again.
    assert CountingDecode.calls == 3


def test_explain(registry):
    mi300x = SPECS["MI300X"]
    rows = registry.explain("decode", dconfig(), mi300x)
    order = DECODE_PRIORITIES[("rocm", "gfx942")]
    assert [row["name"] for row in rows] == list(order) + ["FLASHMLA_LIKE", "UNAVAILABLE"]
    by_name = {row["name"]: row for row in rows}
    assert [row["name"] for row in rows if row["selected"]] == ["AITER_LIKE"]
    assert registry.select("decode", dconfig(), mi300x).name == "AITER_LIKE"
    for rank, name in enumerate(order):
        assert by_name[name]["rank"] == rank
    assert by_name["BROKEN_IMPORT"]["available"] is False
    assert "RuntimeError" in by_name["BROKEN_IMPORT"]["reasons"][0]
    # PORTABLE and FALLBACK fit but come after the chosen one.
    assert by_name["PORTABLE"]["available"] is True and by_name["PORTABLE"]["selected"] is False
    assert by_name["FALLBACK"]["available"] is True and by_name["FALLBACK"]["reasons"] == []
    for name in ("FLASHMLA_LIKE", "UNAVAILABLE"):
        assert by_name[name]["rank"] is None and by_name[name]["selected"] is False
        assert by_name[name]["reasons"][-1] == "not in the decode priority list of rocm gfx942"
    # Nothing fits: no row is selected.
    rows = registry.explain("decode", dconfig(num_heads=200), mi300x)
    assert not any(row["selected"] for row in rows)
    assert all(row["reasons"] for row in rows)


def test_explain_uses_the_current_platform(registry):
    with override("H100"):
        rows = registry.explain("decode", dconfig())
    assert [row["name"] for row in rows if row["selected"]] == ["FLASHMLA_LIKE"]


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "spelling, platform, expected",
    [("auto", "MI300X", BF16), ("fp8", "MI300X", torch.float8_e4m3fnuz), ("fp8_e4m3", "MI325X", torch.float8_e4m3fnuz),
     ("fp8", "MI355X", torch.float8_e4m3fn), ("fp8", "H100", torch.float8_e4m3fn), ("fp8", "CPU", torch.float8_e4m3fn),
     ("fp8", "A100", torch.float8_e4m3fn), ("float16", "CPU", FP16), (torch.float8_e4m3fnuz, "H100", torch.float8_e4m3fnuz)],
)
def test_resolve_kv_cache_dtype(spelling, platform, expected):
    assert resolve_kv_cache_dtype(spelling, BF16, SPECS[platform]) == expected


def test_resolve_kv_cache_dtype_rejects_unknown_spelling():
    with pytest.raises(ValueError) as info:
        resolve_kv_cache_dtype("fp8_e5m2x", BF16, SPECS["CPU"])
    message = str(info.value)
    assert "'fp8_e5m2x'" in message and "auto" in message and "fp8" in message


@pytest.mark.parametrize(
    "kwargs, argument",
    [(dict(dims=16), "dims"), (dict(dtype="bfloat16"), "dtype"), (dict(block_size=0), "block_size"),
     (dict(max_query_len=0), "max_query_len"), (dict(kv_cache_dtype="int4"), "kv_cache_dtype")],
)
def test_decode_config_validates(kwargs, argument):
    arguments = dict(dims=MLADims(16), dtype=BF16, kv_cache_dtype="auto", block_size=64, max_query_len=1)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(argument)):
        decode_config(**arguments, platform=SPECS["CPU"])


def test_configs_are_hashable_and_equal_by_value():
    assert dconfig() == dconfig() and hash(dconfig()) == hash(dconfig())
    assert dconfig() != dconfig(block_size=16)
    assert decode_config(MLADims(16), BF16, "fp8", 16, platform=SPECS["MI300X"]) == DecodeSelectorConfig(
        MLADims(16), BF16, torch.float8_e4m3fnuz, 16, 1
    )


# --------------------------------------------------------------------------- the package's default registry


@pytest.fixture
def no_forced_env(monkeypatch):
    for name in ("MLA_MULTI_PREFILL_BACKEND", "MLA_MULTI_DECODE_BACKEND"):
        monkeypatch.delenv(name, raising=False)


def test_default_registry_on_the_cpu(no_forced_env):
    dims = MLADims.deepseek_v3()
    with override("CPU"):
        assert mm.select_prefill_backend(dims, BF16).name == "REFERENCE"
        assert mm.select_decode_backend(dims, BF16).name == "REFERENCE"
        assert mm.select_decode_backend(dims, FP32, "fp8", 16).name == "REFERENCE"
        assert mm.select_decode_backend(MLADims(3), FP64, "auto", 1, max_query_len=4).name == "REFERENCE"
        assert mm.select_prefill_backend(dims, BF16, backend="reference").name == "REFERENCE"
        assert issubclass(mm.select_prefill_backend(dims, BF16), MLAPrefillBackend)
        assert issubclass(mm.select_decode_backend(dims, BF16), MLADecodeBackend)
    assert "REFERENCE" in default_registry.names("prefill") and "REFERENCE" in default_registry.names("decode")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the import-time choice on a GPU machine is a GPU backend")
def test_selected_backends_on_a_cpu_machine():
    assert mm.selected_backends() == {"prefill": "REFERENCE", "decode": "REFERENCE"}


def test_default_registry_errors(no_forced_env):
    with override("CPU"):
        with pytest.raises(mm.NoBackendError) as info:
            mm.select_prefill_backend(MLADims(16), torch.int8)
        assert "dtype int8 is not supported" in block_of(str(info.value), "REFERENCE")[0]
        with pytest.raises(mm.UnknownBackendError) as info:
            mm.select_decode_backend(MLADims(16), BF16, backend="NOT_A_BACKEND")
        assert "REFERENCE" in str(info.value)
        with pytest.raises(ValueError, match="dims"):
            mm.select_prefill_backend(16, BF16)


@pytest.mark.parametrize("name", ["block_size", "max_query_len"])
@pytest.mark.parametrize("bad", [0, True, 64.0])
def test_decode_config_names_a_size_that_is_not_a_positive_int(name, bad):
    from mla_multi.dims import MLADims
    from mla_multi.registry import decode_config

    with pytest.raises(ValueError, match=rf"{name}={bad!r}; accepted: a positive int"):
        decode_config(MLADims.deepseek_v3(num_heads=16), torch.bfloat16, **{name: bad})
